//! `--mig-dynamic` while the manager runs: a pass every
//! `--mig-rescan-period` and whenever an unscheduled pod changes reads
//! what pods need ([`crate::mig::demand`]) and the dynamic GPUs' instances
//! (NVML, the kubelet's records of who holds what, the record of what
//! vcuda made), decides ([`crate::mig::dynamic`]), makes and destroys
//! instances, and hands the MIG plugins the node's devices at once, so the
//! kubelet advertises a new instance without waiting for the rescan.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_allocator::GpuInfo;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use node_agent::geometry::{Created, GiProfile, GiState, MigDriver};
use node_agent::mig::MigGpu;
use node_agent::mig_nvml::NvmlMig;
use nvml_wrapper::error::NvmlError;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::manager::Manager;
use crate::mig::MigPlugins;
use crate::mig::demand;
use crate::mig::dynamic::{self, Action, DynGpu, DynInstance};
use crate::mig::fits::NodeView;
use crate::mig::passed_over::PassedOver;

/// Why a pass did nothing (the next one tries again).
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("NVML device handles: {0}")]
    Handles(#[source] NvmlError),
    #[error("GPU {gpu}: NVML {what}: {source}")]
    Nvml {
        gpu: usize,
        what: &'static str,
        #[source]
        source: NvmlError,
    },
    /// The node's MIG state read again (node-agent's message).
    #[error("{0}")]
    Read(String),
    #[error("a blocking NVML task ended: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error("serving the MIG devices: {0:#}")]
    Plugins(anyhow::Error),
}

/// What a pass needs.
pub struct DynamicMig {
    pub settings: Arc<Settings>,
    pub nvml: Arc<nvml_wrapper::Nvml>,
    pub gpus: Vec<GpuInfo>,
    /// The `--mig-dynamic` GPUs in MIG mode, by index.
    pub dynamic: BTreeSet<usize>,
    pub mig: MigPlugins,
    pub mgr: Arc<Manager>,
    pub client: kube::Client,
}

/// A dynamic GPU as NVML shows it.
struct Read {
    index: usize,
    profiles: Vec<GiProfile>,
    instances: Vec<GiState>,
}

/// Between passes: when each free instance of ours was first seen free,
/// the last shortfall logged.
#[derive(Default)]
struct Memory {
    free_since: BTreeMap<(usize, u32), Instant>,
    unplaced: BTreeMap<String, usize>,
    passed_over: PassedOver,
}

impl DynamicMig {
    /// Watches the unscheduled pods and runs passes until `cancel`.
    pub fn spawn(self, period: Duration, cancel: CancellationToken) {
        // Its metrics from the start, zero.
        self.mig.note_dynamic(BTreeMap::new(), 0, 0);
        let wake = Arc::new(Notify::new());
        let woken = wake.clone();
        let api: Api<Pod> = Api::all(self.client.clone());
        let cfg = watcher::Config::default().fields("spec.nodeName=,status.phase=Pending");
        let pending = daemon_kit::reflect::spawn(
            api,
            cfg,
            cancel.clone(),
            move |_| woken.notify_one(),
            |e| tracing::warn!(error = %e, "watching unscheduled pods for dynamic MIG; retrying"),
        );
        tokio::spawn(async move {
            let mut memory = Memory::default();
            let mut failures = node_agent::mig::FailureLog::default();
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(period) => {}
                    _ = wake.notified() => {
                        // A burst of pod changes makes one pass.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                let r = self.pass(&pending, &mut memory).await;
                failures.note(r, "dynamic MIG pass failed; tried again at the next");
            }
        });
    }

    async fn pass(&self, pending: &Store<Pod>, memory: &mut Memory) -> Result<(), PassError> {
        let unscheduled = pending.state();
        let bound = self.mgr.pods_now();
        let node = self.node(&unscheduled).await;
        let (nvml, dynamic, count) = (self.nvml.clone(), self.dynamic.clone(), self.gpus.len());
        let (read, states) = tokio::task::spawn_blocking(move || {
            let again = node_agent::mig::read_again(&nvml, count).map_err(PassError::Read);
            Ok::<_, PassError>((read(&nvml, &dynamic)?, again?))
        })
        .await??;
        let profiles: Vec<String> = read
            .iter()
            .flat_map(|r| r.profiles.iter().map(|p| p.name.clone()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let held = self.held(&profiles).await;
        let created = Created::load(&self.settings.checkpoint_path);
        let gpus = self.gpus_now(&read, &held, &created, memory);
        let prefix = &self.settings.mig_resource_prefix;
        let unscheduled: Vec<&Pod> = unscheduled.iter().map(AsRef::as_ref).collect();
        let waiting = demand::waiting(prefix, &profiles, &unscheduled, &node);
        let patience = self.settings.mig_dynamic_grace * 2;
        let (waiting, passed) =
            memory
                .passed_over
                .retain(waiting, &free(&gpus), Instant::now(), patience);
        for w in passed {
            tracing::info!(pod = %w.name, need = ?w.need, pause_s = crate::mig::passed_over::PAUSE.as_secs(), "a pod waited here longer than twice the grace period beside a free instance it needs: the scheduler does not place it here (another of its constraints), so it is not counted for a while");
        }
        let bound: Vec<&Pod> = bound.iter().map(AsRef::as_ref).collect();
        let needed = demand::needed(prefix, &profiles, &bound, &waiting);
        let existing = existing(&states);
        let d = dynamic::decide(&gpus, &needed, &existing);
        let unplaced = needed
            .keys()
            .map(|p| (p.clone(), d.unplaced.get(p).copied().unwrap_or(0) as u64))
            .collect();
        if d.unplaced != memory.unplaced {
            if !d.unplaced.is_empty() {
                tracing::info!(unplaced = ?d.unplaced, ?needed, "MIG devices pods need fit on no dynamic GPU now (free slices too few): waiting for instances to be freed");
            }
            memory.unplaced = d.unplaced.clone();
        }
        if d.actions.is_empty() {
            self.mig.note_dynamic(unplaced, 0, 0);
            return Ok(());
        }
        // A GPU-instance id freed here may come back at once for a new
        // instance, which must not inherit the old one's free time.
        for a in &d.actions {
            if let Action::Destroy { gpu, gi, .. } = a {
                memory.free_since.remove(&(*gpu, *gi));
            }
        }
        let (nvml, gpus, state) = (
            self.nvml.clone(),
            self.gpus.clone(),
            self.settings.checkpoint_path.clone(),
        );
        let (states, made, destroyed) =
            tokio::task::spawn_blocking(move || act(&nvml, &gpus, &d.actions, created, &state))
                .await??;
        self.mig
            .note_dynamic(unplaced, made, destroyed.len() as u64);
        self.mig
            .refresh(&self.gpus, &states)
            .map_err(PassError::Plugins)?;
        // Destroyed for want of a holder: not lost, just gone.
        self.mig.forget(&destroyed);
        Ok(())
    }

    /// This node's name, labels and taints when there are unscheduled
    /// pods (when the API server does not answer, only the name: such
    /// pods then fit only where they select and tolerate nothing).
    async fn node(&self, unscheduled: &[Arc<Pod>]) -> NodeView {
        let mut view = NodeView {
            name: self.settings.node_name.clone(),
            ..Default::default()
        };
        if unscheduled.is_empty() {
            return view;
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        match nodes.get(&self.settings.node_name).await {
            Ok(n) => {
                view.labels = n.metadata.labels.unwrap_or_default();
                view.taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
            }
            Err(e) => tracing::warn!(error = %e, "reading this node for dynamic MIG"),
        }
        view
    }

    /// The MIG UUIDs pods hold (the kubelet's records); `None` when they
    /// cannot be read (then nothing counts as free).
    async fn held(&self, profiles: &[String]) -> Option<BTreeSet<String>> {
        let prefix = &self.settings.mig_resource_prefix;
        let names: Vec<String> = profiles
            .iter()
            .map(|p| gpu_pods::mig_resource_name(prefix, p))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        match self.mgr.kubelet().held(&names).await {
            Ok(h) => Some(
                h.into_iter()
                    .flat_map(|h| h.ids.into_values().flatten())
                    .collect(),
            ),
            Err(e) => {
                tracing::warn!(error = %e, "kubelet's records unread: no dynamic MIG instance counts as free");
                None
            }
        }
    }

    /// The dynamic GPUs for [`dynamic::decide`]; `memory` learns which
    /// instances of ours are free since when.
    fn gpus_now(
        &self,
        read: &[Read],
        held: &Option<BTreeSet<String>>,
        created: &Created,
        memory: &mut Memory,
    ) -> Vec<DynGpu> {
        let now = Instant::now();
        let grace = self.settings.mig_dynamic_grace;
        let mut seen = BTreeSet::new();
        let gpus = read
            .iter()
            .map(|r| {
                let uuid = &self.gpus[r.index].uuid;
                let ours = created.gpus.get(uuid);
                let instances = r
                    .instances
                    .iter()
                    .map(|g| {
                        let in_use = g.busy
                            || held
                                .as_ref()
                                .is_none_or(|h| g.uuids.iter().any(|u| h.contains(u)));
                        let ours =
                            ours.is_some_and(|o| o.contains(&(g.id, g.profile, g.slices.start)));
                        let key = (r.index, g.id);
                        let settled = if ours && !in_use {
                            seen.insert(key);
                            let since = *memory.free_since.entry(key).or_insert(now);
                            now.duration_since(since) >= grace
                        } else {
                            false
                        };
                        DynInstance {
                            gi: g.id,
                            profile: g.profile,
                            slices: g.slices,
                            in_use,
                            ours,
                            settled,
                        }
                    })
                    .collect();
                DynGpu {
                    index: r.index,
                    profiles: r.profiles.clone(),
                    instances,
                }
            })
            .collect();
        memory.free_since.retain(|k, _| seen.contains(k));
        gpus
    }
}

/// `--mig-dynamic` at start: each GPU named put in MIG mode (when idle,
/// as `--mig-geometry` does; a mode pending a GPU reset makes it dynamic
/// from the next start after it). The GPUs in MIG mode by index, and the
/// GPUs read again when a mode changed.
pub fn enable(
    s: &Settings,
    nvml: &nvml_wrapper::Nvml,
    found: node_agent::nvml::Discovered,
) -> anyhow::Result<(node_agent::nvml::Discovered, BTreeSet<usize>)> {
    if s.mig_dynamic.is_empty() {
        return Ok((found, BTreeSet::new()));
    }
    let uuids: Vec<String> = found
        .topology
        .gpus()
        .iter()
        .map(|g| g.uuid.clone())
        .collect();
    let named = node_agent::geometry::resolve_gpus("mig-dynamic", &s.mig_dynamic, &uuids)?;
    let geometry = node_agent::geometry::resolve_gpus(
        "mig-geometry",
        &s.mig_geometry.gpus.keys().cloned().collect::<Vec<_>>(),
        &uuids,
    )
    .unwrap_or_default();
    if let Some(g) = named.intersection(&geometry).next() {
        anyhow::bail!("GPU {g} is in both --mig-geometry and --mig-dynamic: name it in one");
    }
    let devices = devices(nvml, uuids.len())?;
    let driver = NvmlMig {
        nvml,
        devices: &devices,
    };
    let shared = holding_shares(s);
    let whole: Vec<String> = node_agent::geometry::left_whole(
        "mig-dynamic",
        PODS_HOLD,
        &s.mig_dynamic,
        &found,
        shared.as_ref(),
    )
    .into_iter()
    .collect();
    let whole = node_agent::geometry::resolve_gpus("mig-dynamic", &whole, &uuids)?;
    let mut on = BTreeSet::new();
    let mut switched = false;
    for gpu in named {
        let was = found.mig.get(gpu).is_some_and(|m| m.enabled);
        if whole.contains(&gpu) {
            continue;
        }
        match node_agent::geometry::ensure_mig_mode(&driver, gpu) {
            Ok(true) => {
                switched |= !was;
                tracing::info!(
                    gpu,
                    "dynamic MIG: instances made and destroyed toward what pods need"
                );
                on.insert(gpu);
            }
            Ok(false) => tracing::warn!(
                gpu,
                "MIG mode enabled, pending a GPU reset (nvidia-smi -r, or a reboot): dynamic MIG from the next start after it"
            ),
            Err(e) => {
                tracing::error!(gpu, error = %e, "dynamic MIG not available on this GPU (MIG mode refused: a process on it?): served as it is")
            }
        }
    }
    if !switched {
        return Ok((found, on));
    }
    let again = node_agent::nvml::discover(nvml)?;
    node_agent::mig::log(&again.mig);
    Ok((again, on))
}

/// Why [`holding_shares`] keeps a GPU whole, as its log says.
pub const PODS_HOLD: &str = "the GPU holds shares of pods";

/// The UUIDs of the GPUs the checkpoint says hold shares or whole-GPU
/// allocations of pods (MIG mode would take them from under the pods,
/// with no process on the GPU to refuse it); `None` when it cannot be
/// read.
pub fn holding_shares(s: &Settings) -> Option<BTreeSet<String>> {
    use crate::allocation::PlacementRecord as P;
    let saved = match crate::world::checkpoint::Checkpoint::new(&s.checkpoint_path).load() {
        Ok(saved) => saved,
        Err(e) => {
            tracing::warn!(error = %e, "checkpoint unread: every GPU counts as holding shares for MIG");
            return None;
        }
    };
    let Some((uuids, allocs)) = saved else {
        return Some(BTreeSet::new());
    };
    let indices = allocs.iter().flat_map(|a| match &a.placement {
        P::Share { gpu, .. } | P::InMig { gpu, .. } => vec![*gpu],
        P::Exclusive { gpus } | P::Shares { gpus, .. } => gpus.clone(),
    });
    Some(indices.filter_map(|i| uuids.get(i).cloned()).collect())
}

/// The handles of the node's first `count` GPUs.
fn devices(
    nvml: &nvml_wrapper::Nvml,
    count: usize,
) -> Result<Vec<nvml_wrapper::Device<'_>>, PassError> {
    (0..count as u32)
        .map(|i| nvml.device_by_index(i))
        .collect::<Result<Vec<_>, _>>()
        .map_err(PassError::Handles)
}

/// The dynamic GPUs' profiles and instances (blocking).
fn read(nvml: &nvml_wrapper::Nvml, dynamic: &BTreeSet<usize>) -> Result<Vec<Read>, PassError> {
    let count = dynamic.iter().max().map_or(0, |m| m + 1);
    let devices = devices(nvml, count)?;
    let driver = NvmlMig {
        nvml,
        devices: &devices,
    };
    dynamic
        .iter()
        .map(|&index| {
            let err = |what: &'static str| {
                move |source| PassError::Nvml {
                    gpu: index,
                    what,
                    source,
                }
            };
            Ok(Read {
                index,
                profiles: driver
                    .profiles(index)
                    .map_err(err("GPU-instance profiles"))?,
                instances: driver.instances(index).map_err(err("GPU instances"))?,
            })
        })
        .collect()
}

/// The dynamic GPUs' free instances (no pod, no process) by profile name.
fn free(gpus: &[DynGpu]) -> BTreeMap<String, usize> {
    let mut n = BTreeMap::new();
    for g in gpus {
        for i in g.instances.iter().filter(|i| !i.in_use) {
            if let Some(p) = g.profiles.iter().find(|p| p.id == i.profile) {
                *n.entry(p.name.clone()).or_default() += 1;
            }
        }
    }
    n
}

/// The node's MIG devices by profile name, on any GPU: the pods bound
/// here that [`crate::mig::demand`] counts hold them wherever they are.
fn existing(states: &[MigGpu]) -> BTreeMap<String, usize> {
    let mut n = BTreeMap::new();
    for d in states.iter().filter(|m| m.enabled).flat_map(|m| &m.devices) {
        *n.entry(d.profile.clone()).or_default() += 1;
    }
    n
}

/// Carries out `actions` (blocking), recording what was made and
/// destroyed in `created` (as the pass read it) and storing it; the
/// node's MIG state after. A step NVML refuses is logged
/// and the rest go on (the next pass decides again). Also returns how
/// many were made and the MIG UUIDs destroyed.
fn act(
    nvml: &nvml_wrapper::Nvml,
    gpus: &[GpuInfo],
    actions: &[Action],
    mut created: Created,
    state_dir: &std::path::Path,
) -> Result<(Vec<MigGpu>, u64, Vec<String>), PassError> {
    let devices = devices(nvml, gpus.len())?;
    let driver = NvmlMig {
        nvml,
        devices: &devices,
    };
    let (mut made, mut destroyed) = (0, Vec::new());
    // The MIG UUIDs of the instances to destroy, while they are there.
    let mut uuids: BTreeMap<(usize, u32), Vec<String>> = BTreeMap::new();
    for a in actions {
        if let Action::Destroy { gpu, gi, .. } = a
            && let Ok(now) = driver.instances(*gpu)
        {
            let of = now.into_iter().find(|g| g.id == *gi);
            uuids.insert((*gpu, *gi), of.map(|g| g.uuids).unwrap_or_default());
        }
    }
    for a in actions {
        match a {
            Action::Destroy { gpu, gi, profile } => match driver.destroy(*gpu, *gi) {
                Ok(()) => {
                    destroyed.extend(uuids.get(&(*gpu, *gi)).into_iter().flatten().cloned());
                    let uuid = &gpus[*gpu].uuid;
                    if let Some(r) = created.gpus.get_mut(uuid) {
                        r.retain(|(id, _, _)| id != gi);
                    }
                    tracing::info!(gpu, gpu_instance = gi, %profile, "dynamic MIG: an instance nobody needs destroyed");
                }
                Err(e) => {
                    tracing::warn!(gpu, gpu_instance = gi, %profile, error = %e, "dynamic MIG: destroying an instance nobody needs")
                }
            },
            Action::Create {
                gpu,
                profile,
                name,
                slices,
            } => match driver.create(*gpu, *profile, *slices) {
                Ok(id) => {
                    made += 1;
                    created
                        .gpus
                        .entry(gpus[*gpu].uuid.clone())
                        .or_default()
                        .insert((id, *profile, slices.start));
                    tracing::info!(gpu, gpu_instance = id, profile = %name, start = slices.start, "dynamic MIG: an instance made for pods that need it");
                }
                Err(e) => {
                    tracing::warn!(gpu, profile = %name, start = slices.start, error = %e, "dynamic MIG: making an instance")
                }
            },
        }
    }
    if let Err(e) = created.store(state_dir) {
        tracing::error!(error = %e, "the record of vcuda's MIG instances was not stored: those made now will be read as an operator's");
    }
    let states = node_agent::mig::read_again(nvml, gpus.len()).map_err(PassError::Read)?;
    Ok((states, made, destroyed))
}
