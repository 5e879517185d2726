//! The manager's state and the decisions behind Allocate and
//! PreStartContainer. One `Mutex<State>` (never held across an await or a
//! disk sync) owns the allocator and the allocations keyed by pod UID +
//! container; an async lock serialises Allocate calls as kubelet does.
//!
//! Durability: every change bumps `State::version`; [`Manager::persist`]
//! writes a snapshot of the allocations (one checkpoint write, one sync, on
//! a blocking thread) and covers every change made before it, so changes
//! that need no sync of their own (releases, vcuda-memory IDs, the verified
//! flag: a checkpoint that over-states is corrected by recovery) ride along
//! with the next Allocate's write or the periodic check's (group commit).
//! An Allocate answers only once a write that includes it is durable.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use device_plugin::DeviceList;
use device_plugin::api::ContainerAllocateResponse;
use gpu_allocator::{
    AllocError, Allocator, ErrorKind, GpuInfo, MEMORY_UNIT_BYTES, Placement, Request,
};
use k8s_openapi::api::core::v1::Pod;
use quota_config::ResourceData;
use tonic::Status;

use crate::checkpoint::{self, Allocation, Checkpoint, CheckpointError, alloc_id};
use crate::config::Settings;
use crate::events::{self, EventSink, PodEvent};
use crate::extra::ExtraConfig;
use crate::ids;
use crate::kube_api::{ApiHealth, PatchJob, Patcher, PodWatch};
use crate::kubelet::{Held, Holder, KubeletRecords, PodKey};
use crate::pods;
use crate::recovery::{self, Evidence, PodPhase, Verdict};
use crate::registry::Registry;
use crate::response::{self, ResponseInput};
use crate::runtime::{LiveContainer, Runtime};
use crate::vm::{self, VmDirs};

/// How long Allocate waits for a just-created pod to reach the reflector.
const POD_WAIT: Duration = Duration::from_secs(1);
/// Changes without a sync of their own are written once no Allocate has
/// come for this long (an Allocate's write covers them anyway), so that
/// the background write rarely makes an Allocate wait.
const LAZY_FLUSH_IDLE: Duration = Duration::from_millis(200);

struct State {
    allocator: Allocator,
    allocs: BTreeMap<String, Allocation>,
    /// vcuda-memory IDs allocated before their container's vcuda-core
    /// (kubelet allocates a container's resources in map order).
    orphan_memory: Vec<Vec<String>>,
    healthy: Vec<bool>,
    /// Pods whose allocation was withdrawn after a wrong guess: candidates
    /// again even while their `gpu-assigned` annotation is being reverted.
    withdrawn: BTreeSet<String>,
    /// Bumped by every change of `allocs`.
    version: u64,
    /// The newest `version` the checkpoint on disk holds.
    durable: u64,
    /// The last checkpoint write failed (logged once it works again).
    write_failed: bool,
    /// When the last Allocate started (the lazy flush waits for a pause).
    last_allocate: Instant,
}

/// Marks the allocations changed; returns the version a write must reach.
fn changed(st: &mut State) -> u64 {
    st.version += 1;
    st.version
}

/// What recovery at start found and did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    /// Allocations kept from the checkpoint.
    pub kept: usize,
    /// Allocations rebuilt from the node (missing from the checkpoint).
    pub rebuilt: usize,
    /// Allocations released (their containers are gone).
    pub released: usize,
    /// vm directories removed that no allocation owned.
    pub orphans_removed: usize,
    /// The checkpoint could not be read and was set aside here.
    pub set_aside: Option<String>,
    /// Sources that could not be asked.
    pub unreachable: Vec<String>,
}

pub struct Manager {
    settings: Arc<Settings>,
    gpus: Vec<GpuInfo>,
    driver_version: (i32, i32),
    state: Mutex<State>,
    alloc_lock: tokio::sync::Mutex<()>,
    /// One checkpoint write at a time; waiters whose change the write
    /// covered return without writing.
    commit_lock: tokio::sync::Mutex<()>,
    /// Wakes the lazy flush after a change that waits for the next write.
    lazy: tokio::sync::Notify,
    pods: PodWatch,
    patcher: Patcher,
    events: Arc<dyn EventSink>,
    kubelet: KubeletRecords,
    vm: VmDirs,
    registry: Registry,
    checkpoint: Checkpoint,
    extra: ExtraConfig,
    runtime: Runtime,
    pub vcore: DeviceList,
    pub vmemory: DeviceList,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn alloc_status(e: AllocError) -> Status {
    match e.kind() {
        ErrorKind::InvalidRequest => Status::invalid_argument(e.to_string()),
        ErrorKind::Insufficient => Status::resource_exhausted(e.to_string()),
        ErrorKind::State => Status::internal(e.to_string()),
    }
}

/// The 16-byte `bus_id` field holds at most 15 characters: drop NVML's
/// 8-digit domain to the usual 4 ("0000:3B:00.0").
fn short_bus_id(bus: &str) -> String {
    let b = bus.trim_end_matches('\0');
    if b.len() > 15 && b.starts_with("0000") {
        b[4..].to_string()
    } else {
        b.to_string()
    }
}

pub struct ManagerParts {
    pub settings: Arc<Settings>,
    pub allocator: Allocator,
    pub driver_version: (i32, i32),
    pub pods: PodWatch,
    pub patcher: Patcher,
    pub events: Arc<dyn EventSink>,
    pub extra: ExtraConfig,
    pub runtime: Runtime,
}

impl Manager {
    pub fn new(p: ManagerParts) -> Arc<Manager> {
        let gpus = p.allocator.topology().gpus().to_vec();
        let n = gpus.len();
        let s = &p.settings;
        Arc::new(Manager {
            vcore: DeviceList::new(ids::vcore_devices(&gpus, |_| true)),
            vmemory: DeviceList::new(ids::vmemory_devices(&gpus, |_| true)),
            kubelet: KubeletRecords::new(&s.pod_resources_socket, &s.device_plugin_path),
            vm: VmDirs::new(&s.virtual_manager_path),
            checkpoint: Checkpoint::new(&s.checkpoint_path),
            registry: Registry::default(),
            gpus,
            driver_version: p.driver_version,
            state: Mutex::new(State {
                allocator: p.allocator,
                allocs: BTreeMap::new(),
                orphan_memory: Vec::new(),
                healthy: vec![true; n],
                withdrawn: BTreeSet::new(),
                version: 0,
                durable: 0,
                write_failed: false,
                last_allocate: Instant::now(),
            }),
            alloc_lock: tokio::sync::Mutex::new(()),
            commit_lock: tokio::sync::Mutex::new(()),
            lazy: tokio::sync::Notify::new(),
            pods: p.pods,
            patcher: p.patcher,
            events: p.events,
            extra: p.extra,
            runtime: p.runtime,
            settings: p.settings,
        })
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Allocations, for display and tests.
    pub fn allocations(&self) -> Vec<Allocation> {
        self.state
            .lock()
            .unwrap()
            .allocs
            .values()
            .cloned()
            .collect()
    }

    /// Per-GPU allocation figures (cores, memory units, shares), by index.
    pub fn gpu_usages(&self) -> Vec<gpu_allocator::GpuUsage> {
        self.state.lock().unwrap().allocator.usages().to_vec()
    }

    /// The GPU tree with current usage, rendered by the allocator.
    pub fn render_tree(&self) -> String {
        self.state.lock().unwrap().allocator.render()
    }

    fn uuids(&self) -> Vec<String> {
        self.gpus.iter().map(|g| g.uuid.clone()).collect()
    }

    /// Makes the allocations durable up to `want` (a [`changed`] version):
    /// returns at once when a write already covered it, else waits for the
    /// write in progress and, if that did not cover it either, writes a
    /// snapshot itself (one slot write and one sync, off the async
    /// threads and outside the state lock). On failure the previous
    /// checkpoint stays intact and the error is reported; the next write
    /// (change or periodic check) tries again.
    pub async fn persist(&self, want: u64) -> Result<(), Status> {
        if self.state.lock().unwrap().durable >= want {
            return Ok(());
        }
        let _writer = self.commit_lock.lock().await;
        let (version, allocs) = {
            let st = self.state.lock().unwrap();
            if st.durable >= want {
                return Ok(());
            }
            (st.version, st.allocs.values().cloned().collect::<Vec<_>>())
        };
        let (cp, uuids) = (self.checkpoint.clone(), self.uuids());
        let r = tokio::task::spawn_blocking(move || cp.write(&checkpoint::encode(&uuids, &allocs)))
            .await
            .unwrap_or_else(|e| {
                Err(CheckpointError::Io {
                    path: self.checkpoint.path().display().to_string(),
                    source: std::io::Error::other(e.to_string()),
                })
            });
        let mut st = self.state.lock().unwrap();
        match r {
            Ok(()) => {
                st.durable = st.durable.max(version);
                if std::mem::take(&mut st.write_failed) {
                    tracing::info!(path = %self.checkpoint.path().display(), "checkpoint written again");
                }
                Ok(())
            }
            Err(e) => {
                st.write_failed = true;
                tracing::error!(
                    error = %e,
                    "writing the allocation checkpoint failed; the previous one is intact (disk full or read-only?); retrying at the next change"
                );
                Err(Status::internal(format!(
                    "recording the allocation durably failed ({e}); the previous checkpoint is intact; free space or make {} writable",
                    self.checkpoint.path().display()
                )))
            }
        }
    }

    /// A change that needs no sync of its own (a release, vcuda-memory
    /// IDs, the verified flag): written with the next Allocate's write, or
    /// by the lazy flush after a pause.
    fn changed_lazily(&self, st: &mut State) {
        changed(st);
        self.lazy.notify_one();
    }

    /// Writes lazy changes in the background once Allocate calls pause
    /// for [`LAZY_FLUSH_IDLE`] (also done by the periodic check and at
    /// shutdown), until `cancel`.
    pub fn spawn_lazy_flush(self: &Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        let mgr = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = mgr.lazy.notified() => {}
                }
                loop {
                    let quiet = {
                        let st = mgr.state.lock().unwrap();
                        if st.durable >= st.version {
                            break;
                        }
                        LAZY_FLUSH_IDLE.saturating_sub(st.last_allocate.elapsed())
                    };
                    if quiet.is_zero() {
                        let _ = mgr.flush().await;
                        break;
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(quiet) => {}
                    }
                }
            }
        });
    }

    /// Writes whatever changed since the last write (periodic check,
    /// shutdown); errors are logged by [`Manager::persist`].
    pub async fn flush(&self) -> Result<(), Status> {
        let want = self.state.lock().unwrap().version;
        self.persist(want).await
    }

    /// Resolves at the next change of the pod watch.
    pub async fn pod_changes(&self) {
        while !self.pods.changed(Duration::from_secs(3600)).await {}
    }

    /// Whether the checkpoint on disk is behind memory (changes waiting
    /// for the next write, or a write failed).
    pub fn checkpoint_dirty(&self) -> bool {
        let st = self.state.lock().unwrap();
        st.durable < st.version
    }

    /// The quota file of an allocation.
    fn resource_data(&self, a: &Allocation) -> ResourceData {
        let p = Placement::from(&a.placement);
        let shared = !p.is_exclusive();
        let first = &self.gpus[p.gpus()[0]];
        ResourceData {
            pod_uid: a.pod_uid.clone(),
            limit: a
                .soft_limit
                .map(|l| l as i32)
                .unwrap_or(a.cores.min(100) as i32),
            container_name: a.container.clone(),
            bus_id: short_bus_id(&first.pci_bus_id),
            gpu_memory: a.memory_units * MEMORY_UNIT_BYTES,
            utilization: a.cores.min(100) as i32,
            hard_limit: a.soft_limit.is_none(),
            driver_version: self.driver_version,
            enable: shared,
        }
    }

    /// Re-creates a kept allocation's vm directory contents (files whose
    /// content is unchanged are left alone; the directory itself is never
    /// replaced, it may be mounted), reopens its ledger and serves its
    /// socket again so interposers reconnect on their own.
    fn revive(&self, a: &Allocation) -> Result<(), String> {
        let data = self.resource_data(a);
        let quota = data.enable.then_some(data.gpu_memory);
        let (dir, ledger) = self
            .vm
            .prepare(&data, quota)
            .map_err(|e| format!("vm directory: {e}"))?;
        if data.enable {
            self.registry
                .serve(&a.id(), &dir, &a.pod_uid, &a.container, ledger)
                .map_err(|e| format!("serving vcuda.sock: {e}"))?;
        }
        Ok(())
    }

    /// The evidence sources, each `None` when it cannot be asked now.
    async fn gather(
        &self,
    ) -> (
        Option<BTreeMap<String, PodPhase>>,
        Option<Vec<Held>>,
        Option<Vec<LiveContainer>>,
        Vec<String>,
    ) {
        let mut unreachable = Vec::new();
        let api = (self.pods.health() == ApiHealth::Ok).then(|| {
            self.pods
                .pods()
                .iter()
                .map(|p| {
                    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                    let ph = if matches!(phase, Some("Succeeded" | "Failed")) {
                        PodPhase::Finished
                    } else {
                        PodPhase::Active
                    };
                    (pods::uid(p).to_string(), ph)
                })
                .collect::<BTreeMap<_, _>>()
        });
        if api.is_none() {
            unreachable.push(format!("API server ({:?})", self.pods.health()));
        }
        let (kubelet, runtime) = tokio::join!(
            self.kubelet
                .held(&[ids::VCORE_RESOURCE, ids::VMEMORY_RESOURCE]),
            self.runtime.containers()
        );
        let kubelet = kubelet
            .map_err(|e| unreachable.push(format!("kubelet: {e}")))
            .ok();
        // Only containers that mount one of our vm directories are ours (a
        // pod UID alone could be another node's or another manager's).
        let runtime = match runtime.map(|r| {
            r.map(|v| {
                v.into_iter()
                    .filter(|c| {
                        self.vm
                            .dir(&c.pod_uid, &c.container)
                            .is_ok_and(|d| c.vm_source.as_deref() == Some(d.as_path()))
                    })
                    .collect::<Vec<_>>()
            })
        }) {
            Ok(r) => r,
            Err(e) => {
                unreachable.push(e.to_string());
                None
            }
        };
        (api, kubelet, runtime, unreachable)
    }

    /// Recovery at start: the checkpoint (an unreadable one is set aside),
    /// reconciled with the API server, kubelet's device records and the
    /// container runtime. Allocations of containers that are gone are
    /// released; live ones keep their capacity and get their vm files,
    /// ledger and socket back; live containers missing from the checkpoint
    /// are rebuilt from the node; vm directories nobody owns are removed.
    pub async fn restore(&self) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        let saved = match self.checkpoint.load() {
            Ok(s) => s,
            Err(e) => {
                let aside = self.checkpoint.set_aside();
                tracing::warn!(
                    error = %e, set_aside = ?aside.as_ref().map(|v| v.iter().map(|p| p.display().to_string()).collect::<Vec<_>>()),
                    "the allocation checkpoint is unreadable; set aside, rebuilding the allocations from the node"
                );
                report.set_aside = Some(match aside {
                    Ok(v) => v
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    Err(e2) => format!("(could not move it: {e2})"),
                });
                None
            }
        };
        let (uuids, allocs) = saved.unwrap_or_else(|| (self.uuids(), Vec::new()));
        if uuids != self.uuids() {
            tracing::warn!(
                checkpoint = ?uuids, node = ?self.uuids(),
                "checkpoint was written for other GPUs; allocations on GPUs whose UUID changed are dropped"
            );
        }
        let (api, kubelet, runtime, unreachable) = self.gather().await;
        for u in &unreachable {
            tracing::warn!(
                source = %u,
                "recovery: source unreachable; its evidence is skipped and nothing is released on its account (retried every --allocation-check-period)"
            );
        }
        report.unreachable = unreachable;
        let ev = Evidence {
            api: api.as_ref(),
            kubelet: kubelet.as_deref(),
            runtime: runtime.as_deref(),
        };
        let now = now();
        let mut kept = Vec::new();
        {
            let mut st = self.state.lock().unwrap();
            for mut a in allocs {
                let p = Placement::from(&a.placement);
                let same = p.gpus().iter().all(|&g| {
                    uuids
                        .get(g)
                        .is_some_and(|u| Some(u) == self.gpus.get(g).map(|x| &x.uuid))
                });
                if !same {
                    tracing::warn!(id = %a.id(), "dropping checkpointed allocation: its GPU changed");
                    continue;
                }
                match recovery::judge(&a, &ev, now.saturating_sub(a.created), 0) {
                    Verdict::Release(why) => {
                        tracing::info!(id = %a.id(), why, "recovery: releasing");
                        report.released += 1;
                        continue;
                    }
                    Verdict::Keep { why, ids } => {
                        if let Some((vcore, vmemory)) = ids {
                            tracing::info!(id = %a.id(), ?vcore, "recovery: kubelet's device IDs adopted");
                            if !vcore.is_empty() {
                                a.vcore_ids = vcore;
                            }
                            if !vmemory.is_empty() {
                                a.vmemory_ids = vmemory;
                            }
                        }
                        tracing::debug!(id = %a.id(), why, "recovery: keeping");
                    }
                }
                if let Err(e) = st.allocator.commit(a.id(), &p) {
                    tracing::error!(id = %a.id(), error = %e, "recovery: checkpointed allocation does not fit; dropped");
                    continue;
                }
                st.allocs.insert(a.id(), a.clone());
                kept.push(a);
            }
        }
        report.kept = kept.len();
        // Live containers the checkpoint does not know (lost, stale or
        // corrupt checkpoint): rebuilt from their vm directory, kubelet's
        // IDs and the runtime's view of their GPUs.
        for c in runtime.iter().flatten() {
            if !c.alive
                || self
                    .state
                    .lock()
                    .unwrap()
                    .allocs
                    .contains_key(&alloc_id(&c.pod_uid, &c.container))
            {
                continue;
            }
            let Ok(dir) = self.vm.dir(&c.pod_uid, &c.container) else {
                continue;
            };
            if c.vm_source.as_deref() != Some(dir.as_path()) {
                continue; // not one of ours
            }
            if api
                .as_ref()
                .is_some_and(|m| m.get(&c.pod_uid) != Some(&PodPhase::Active))
            {
                continue;
            }
            match self.rebuild(c, kubelet.as_deref()).await {
                Ok(a) => {
                    let p = Placement::from(&a.placement);
                    let mut st = self.state.lock().unwrap();
                    match st.allocator.commit(a.id(), &p) {
                        Ok(()) => {
                            tracing::warn!(id = %a.id(), placement = %p, "recovery: allocation rebuilt from the node");
                            st.allocs.insert(a.id(), a.clone());
                            kept.push(a);
                            report.rebuilt += 1;
                        }
                        Err(e) => {
                            tracing::error!(id = %a.id(), error = %e, "recovery: a live container's GPUs conflict with another allocation; not recorded")
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(container = %c.id, pod = %c.pod_uid, error = %e, "recovery: cannot rebuild the allocation of a live container")
                }
            }
        }
        for a in &kept {
            if let Err(e) = self.revive(a) {
                tracing::error!(id = %a.id(), error = %e, "recovery: re-creating the container's files");
            }
        }
        // vm directories no allocation owns: their containers are gone
        // (unless a live container still mounts one: never pulled away).
        for (uid, c) in self.vm.list() {
            let id = alloc_id(&uid, &c);
            if self.state.lock().unwrap().allocs.contains_key(&id) {
                continue;
            }
            let mounted = runtime
                .iter()
                .flatten()
                .any(|x| x.alive && x.pod_uid == uid && x.container == c);
            if mounted {
                tracing::warn!(
                    id,
                    "vm directory of a live container without an allocation is kept"
                );
                continue;
            }
            self.vm.remove(&uid, &c);
            report.orphans_removed += 1;
        }
        // Written even when nothing changed: a migrated or set-aside
        // checkpoint is replaced by slot files before the first Allocate.
        changed(&mut self.state.lock().unwrap());
        let _ = self.flush().await;
        tracing::info!(
            kept = report.kept,
            rebuilt = report.rebuilt,
            released = report.released,
            orphans_removed = report.orphans_removed,
            unreachable = report.unreachable.len(),
            "recovery done"
        );
        report
    }

    /// An allocation for a live container the checkpoint lost: GPUs from
    /// its environment or devices (else the quota file's bus id), sizes
    /// from kubelet's device IDs (else the quota file), the pod from the
    /// runtime's labels and the API server.
    async fn rebuild(
        &self,
        c: &LiveContainer,
        kubelet: Option<&[Held]>,
    ) -> Result<Allocation, String> {
        let dir = self
            .vm
            .dir(&c.pod_uid, &c.container)
            .map_err(|e| e.to_string())?;
        let cfg = quota_config::read_config(&dir.join(quota_config::CONFIG_FILE)).ok();
        let seen = self.runtime.gpus(&c.id).await.map_err(|e| e.to_string())?;
        let mut gpus: Vec<usize> = seen
            .visible
            .iter()
            .filter_map(|u| self.gpus.iter().position(|g| &g.uuid == u))
            .collect();
        if gpus.is_empty() {
            gpus = seen
                .devices
                .iter()
                .filter_map(|d| d.strip_prefix("/dev/nvidia")?.parse::<u32>().ok())
                .filter_map(|m| self.gpus.iter().position(|g| g.minor == m))
                .collect();
        }
        if gpus.is_empty()
            && let Some(cfg) = &cfg
            && let Some(g) = self
                .gpus
                .iter()
                .position(|g| short_bus_id(&g.pci_bus_id) == cfg.bus_id)
        {
            gpus.push(g);
        }
        gpus.sort_unstable();
        gpus.dedup();
        if gpus.is_empty() {
            return Err("no GPU found in its environment, devices or vcuda.config".into());
        }
        let probe = Allocation {
            pod_uid: c.pod_uid.clone(),
            namespace: c.namespace.clone(),
            pod_name: c.pod_name.clone(),
            container: c.container.clone(),
            container_index: 0,
            cores: 0,
            memory_units: 0,
            memory_limit: 0,
            placement: crate::checkpoint::PlacementRecord::Exclusive { gpus: vec![] },
            soft_limit: None,
            vcore_ids: vec![],
            vmemory_ids: vec![],
            verified: false,
            created: now(),
        };
        let held = kubelet.and_then(|k| recovery::held_by(&probe, k));
        let ids_of = |r: &str| held.and_then(|h| h.ids.get(r).cloned()).unwrap_or_default();
        let (vcore_ids, vmemory_ids) = (ids_of(ids::VCORE_RESOURCE), ids_of(ids::VMEMORY_RESOURCE));
        let shared = match &cfg {
            Some(cfg) => cfg.enable,
            None => gpus.len() == 1 && !vcore_ids.is_empty() && vcore_ids.len() < 100,
        };
        let cores = if !vcore_ids.is_empty() {
            vcore_ids.len() as u32
        } else if shared {
            cfg.as_ref().map_or(0, |c| c.utilization.max(0) as u32)
        } else {
            100 * gpus.len() as u32
        };
        let memory_limit = if !vmemory_ids.is_empty() {
            vmemory_ids.len() as u64
        } else {
            cfg.as_ref().map_or(0, |c| c.gpu_memory / MEMORY_UNIT_BYTES)
        };
        let (memory_units, placement) = if shared {
            let units = cfg
                .as_ref()
                .map_or(memory_limit, |c| c.gpu_memory / MEMORY_UNIT_BYTES);
            (
                units,
                Placement::Share {
                    gpu: gpus[0],
                    cores,
                    memory_units: units,
                },
            )
        } else {
            (
                gpus.iter().map(|&g| self.gpus[g].memory_units()).sum(),
                Placement::Exclusive { gpus: gpus.clone() },
            )
        };
        if cores == 0 || (shared && memory_units == 0) {
            return Err(
                "its size is unknown (no kubelet record and no readable vcuda.config)".into(),
            );
        }
        let pod = self
            .pods
            .pods()
            .into_iter()
            .find(|p| pods::uid(p) == c.pod_uid);
        let container_index = pod
            .as_ref()
            .and_then(|p| {
                pods::gpu_containers(p)
                    .into_iter()
                    .find(|(_, n)| *n == c.container)
            })
            .map_or(0, |(i, _)| i);
        Ok(Allocation {
            container_index,
            cores,
            memory_units,
            memory_limit,
            placement: (&placement).into(),
            soft_limit: cfg
                .as_ref()
                .filter(|c| !c.hard_limit)
                .map(|c| c.limit.max(0) as u32),
            verified: held.is_some(),
            vcore_ids,
            vmemory_ids,
            ..probe
        })
    }

    /// Marks a GPU (un)healthy: its advertised IDs and new placements.
    pub fn set_gpu_health(&self, gpu: usize, healthy: bool) {
        {
            let mut st = self.state.lock().unwrap();
            if gpu >= st.healthy.len() || st.healthy[gpu] == healthy {
                return;
            }
            st.healthy[gpu] = healthy;
            let _ = st.allocator.set_healthy(gpu, healthy);
        }
        let f = |id: &str| ids::gpu_of(id) == Some(gpu);
        self.vcore.set_health_where(healthy, f);
        self.vmemory.set_health_where(healthy, f);
        tracing::warn!(gpu, healthy, "GPU health changed");
    }

    async fn find_candidate(&self, cores: u64) -> Result<pods::Candidate, Status> {
        let deadline = Instant::now() + POD_WAIT;
        loop {
            let pods = self.pods.pods();
            let found = {
                let st = self.state.lock().unwrap();
                pods::select(
                    &pods,
                    cores,
                    |uid, c| st.allocs.contains_key(&alloc_id(uid, c)),
                    |uid| st.withdrawn.contains(uid),
                )
            };
            if let Some(c) = found {
                return Ok(c);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.pods.changed(left).await {
                if self.pods.health() == ApiHealth::Starting {
                    return Err(Status::unavailable(format!(
                        "the manager has not listed this node's pods from the API server yet; cannot tell which pod asks for vcuda-core {cores}; kubelet will retry"
                    )));
                }
                if let ApiHealth::Failing(e) = self.pods.health() {
                    return Err(Status::unavailable(format!(
                        "no pending pod on node {} asks for vcuda-core {cores}, and the API server is unreachable ({e}); kubelet will retry",
                        self.settings.node_name
                    )));
                }
                return Err(Status::failed_precondition(format!(
                    "no pending, unassigned pod on node {} has a container asking for vcuda-core {cores} \
                     (pending GPU containers: {}); was the pod deleted, or already allocated?",
                    self.settings.node_name,
                    pods::describe_pending(&pods)
                )));
            }
        }
    }

    /// The placement gpu-admission chose (`predicate-gpu-idx-<i>`), checked
    /// against this node's state; errors name both sides.
    fn predicated(
        &self,
        st: &State,
        pod: &Pod,
        cand: &pods::Candidate,
        req: &Request,
        ours: &Placement,
    ) -> Result<Option<Placement>, Status> {
        let Some(minors) = pods::predicate_minors(pod, cand.container_index) else {
            return Ok(None);
        };
        let key = format!("{}{}", pods::PREDICATE_GPU_IDX_PREFIX, cand.container_index);
        let minors = minors.map_err(Status::invalid_argument)?;
        let mut gpus = Vec::new();
        for m in &minors {
            let g = self.gpus.iter().find(|g| g.minor == *m).ok_or_else(|| {
                Status::failed_precondition(format!(
                    "gpu-admission chose GPU /dev/nvidia{m} ({key}), which this node does not have (its GPUs: {})",
                    self.gpus.iter().map(|g| format!("/dev/nvidia{}", g.minor)).collect::<Vec<_>>().join(",")
                ))
            })?;
            gpus.push(g.index);
        }
        gpus.sort_unstable();
        gpus.dedup();
        let mine = ours
            .gpus()
            .iter()
            .map(|&g| format!("/dev/nvidia{}", self.gpus[g].minor))
            .collect::<Vec<_>>()
            .join(",");
        let theirs = minors
            .iter()
            .map(|m| format!("/dev/nvidia{m}"))
            .collect::<Vec<_>>()
            .join(",");
        let placement = match ours {
            Placement::Share { .. } if gpus.len() == 1 => Placement::Share {
                gpu: gpus[0],
                cores: req.cores,
                memory_units: req.memory_units,
            },
            Placement::Exclusive { gpus: g } if g.len() == gpus.len() => {
                Placement::Exclusive { gpus }
            }
            _ => {
                return Err(Status::failed_precondition(format!(
                    "predicate mismatch: gpu-admission chose {theirs} ({key}) for vcuda-core {}, \
                     but that request needs {} GPU(s); the manager would choose {mine}",
                    req.cores,
                    ours.gpus().len()
                )));
            }
        };
        let mut probe = st.allocator.clone();
        if let Err(e) = probe.commit("predicate-probe", &placement) {
            return Err(Status::failed_precondition(format!(
                "predicate mismatch: gpu-admission chose {theirs} ({key}), but on this node it does not fit ({e}); \
                 the manager would choose {mine}"
            )));
        }
        Ok(Some(placement))
    }

    /// `Allocate` for vcuda-core: find the pod, place, write the vm
    /// directory, checkpoint, answer.
    pub async fn allocate_vcore(
        &self,
        device_ids: Vec<String>,
    ) -> Result<ContainerAllocateResponse, Status> {
        let _serial = self.alloc_lock.lock().await;
        let started = Instant::now();
        self.state.lock().unwrap().last_allocate = started;
        let cores = device_ids.len() as u64;
        self.release_holders_of(&device_ids);
        let cand = self.find_candidate(cores).await?;
        let pod = cand.pod.clone();
        let r = self.allocate_for(cand, device_ids, started).await;
        if let Err(s) = &r {
            // kubelet shows only a generic admission error; say why on the pod.
            self.events.post(PodEvent {
                namespace: pods::namespace(&pod).to_string(),
                name: pods::name(&pod).to_string(),
                uid: pods::uid(&pod).to_string(),
                reason: events::ALLOCATE_FAILED,
                note: s.message().to_string(),
            });
        }
        r
    }

    async fn allocate_for(
        &self,
        cand: pods::Candidate,
        device_ids: Vec<String>,
        started: Instant,
    ) -> Result<ContainerAllocateResponse, Status> {
        let cores = device_ids.len() as u64;
        let pod = cand.pod.clone();
        let (uid, ns, name) = (pods::uid(&pod), pods::namespace(&pod), pods::name(&pod));
        vm::check_pod_uid(uid).map_err(|e| Status::invalid_argument(e.to_string()))?;
        vm::check_container_name(&cand.container)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let soft_limit = match pods::annotation(&pod, pods::VCORE_LIMIT) {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|l| (1..=100).contains(l))
                    .ok_or_else(|| {
                        Status::invalid_argument(format!(
                            "pod {ns}/{name}: annotation {}={v:?} must be a number 1..100",
                            pods::VCORE_LIMIT
                        ))
                    })?,
            ),
        };
        let req = Request {
            cores: u32::try_from(cores).unwrap_or(u32::MAX),
            memory_units: cand.memory_units,
            share_mode: self.settings.share_mode,
        };
        let id = alloc_id(uid, &cand.container);
        let ctx = format!("pod {ns}/{name} container {}", cand.container);
        let undo = |st: &mut State| {
            let _ = st.allocator.release(&id);
            self.registry.stop(&id);
            self.vm.remove(uid, &cand.container);
        };
        // The state lock is never held across the await below.
        let (want, placement, shared, gpus, memory_units, dir) = {
            let mut st = self.state.lock().unwrap();
            let ours = st.allocator.evaluate(&req).map_err(|e| {
                let s = alloc_status(e);
                Status::new(s.code(), format!("{ctx}: {}", s.message()))
            })?;
            let placement = self
                .predicated(&st, &pod, &cand, &req, &ours)?
                .unwrap_or(ours);
            st.allocator
                .commit(id.clone(), &placement)
                .map_err(alloc_status)?;
            let shared = !placement.is_exclusive();
            let gpus: Vec<&GpuInfo> = placement.gpus().iter().map(|&g| &self.gpus[g]).collect();
            let memory_units = if shared {
                req.memory_units
            } else {
                gpus.iter().map(|g| g.memory_units()).sum()
            };
            let data = ResourceData {
                pod_uid: uid.to_string(),
                limit: soft_limit
                    .map(|l| l as i32)
                    .unwrap_or(req.cores.min(100) as i32),
                container_name: cand.container.clone(),
                bus_id: short_bus_id(&gpus[0].pci_bus_id),
                gpu_memory: memory_units * MEMORY_UNIT_BYTES,
                utilization: req.cores.min(100) as i32,
                hard_limit: soft_limit.is_none(),
                driver_version: self.driver_version,
                enable: shared,
            };
            let prepared = self
                .vm
                .prepare(&data, shared.then_some(data.gpu_memory))
                .map_err(|e| Status::internal(format!("{ctx}: {e}")));
            let (dir, ledger) = match prepared {
                Ok(x) => x,
                Err(e) => {
                    undo(&mut st);
                    return Err(e);
                }
            };
            if shared && let Err(e) = self.registry.serve(&id, &dir, uid, &cand.container, ledger) {
                undo(&mut st);
                return Err(Status::internal(format!("{ctx}: serving vcuda.sock: {e}")));
            }
            let memory_limit = cand.memory_units;
            let vmemory_ids = st
                .orphan_memory
                .iter()
                .position(|m| m.len() as u64 == memory_limit)
                .map(|i| st.orphan_memory.remove(i))
                .unwrap_or_default();
            st.allocs.insert(
                id.clone(),
                Allocation {
                    pod_uid: uid.to_string(),
                    namespace: ns.to_string(),
                    pod_name: name.to_string(),
                    container: cand.container.clone(),
                    container_index: cand.container_index,
                    cores: req.cores,
                    memory_units,
                    memory_limit,
                    placement: (&placement).into(),
                    soft_limit,
                    vcore_ids: device_ids,
                    vmemory_ids,
                    verified: false,
                    created: now(),
                },
            );
            let want = changed(&mut st);
            (want, placement, shared, gpus, memory_units, dir)
        };
        // Durable before answering; Allocate calls stay serialised.
        let synced = Instant::now();
        if let Err(e) = self.persist(want).await {
            let mut st = self.state.lock().unwrap();
            st.allocs.remove(&id);
            undo(&mut st);
            self.changed_lazily(&mut st);
            return Err(Status::new(e.code(), format!("{ctx}: {}", e.message())));
        }
        let checkpoint_us = synced.elapsed().as_micros() as u64;
        let patch = {
            let mut st = self.state.lock().unwrap();
            st.withdrawn.remove(uid);
            self.patch_if_complete(&st, &pod)
        };
        // The API server is patched in the background (never on the RPC).
        if let Some(job) = patch {
            self.patcher.submit(job);
        }
        tracing::info!(
            pod = %format!("{ns}/{name}"), container = %cand.container, uid, %placement,
            took_us = started.elapsed().as_micros() as u64, checkpoint_us, "allocated"
        );
        Ok(response::build(&ResponseInput {
            gpus,
            cores: req.cores,
            memory_units,
            shared,
            vdriver_dir: &self.settings.vdriver_path,
            vm_dir: &dir,
            extra_devices: &self.extra.devices,
        }))
    }

    /// kubelet hands out only IDs it considers free: an allocation still
    /// holding them belongs to a pod kubelet has let go of.
    fn release_holders_of(&self, device_ids: &[String]) {
        let stale: Vec<String> = {
            let st = self.state.lock().unwrap();
            st.allocs
                .values()
                .filter(|a| a.vcore_ids.iter().any(|i| device_ids.contains(i)))
                .map(Allocation::id)
                .collect()
        };
        for id in stale {
            tracing::info!(
                id,
                "kubelet reassigned its devices; releasing the old allocation"
            );
            self.release(&id);
        }
    }

    /// The patch that marks a pod assigned, once all its GPU containers are.
    fn patch_if_complete(&self, st: &State, pod: &Pod) -> Option<PatchJob> {
        let uid = pods::uid(pod);
        let mut per = BTreeMap::new();
        for (i, c) in pods::gpu_containers(pod) {
            let a = st.allocs.get(&alloc_id(uid, &c))?;
            let p = Placement::from(&a.placement);
            per.insert(i, p.gpus().iter().map(|&g| self.gpus[g].minor).collect());
        }
        Some(PatchJob {
            namespace: pods::namespace(pod).to_string(),
            name: pods::name(pod).to_string(),
            uid: uid.to_string(),
            annotations: pods::assigned_annotations(&per),
        })
    }

    /// `Allocate` for vcuda-memory: nothing to hand out (vcuda-core's
    /// response carries everything); remember the IDs for PreStart.
    pub fn allocate_vmemory(&self, device_ids: Vec<String>) -> ContainerAllocateResponse {
        let mut st = self.state.lock().unwrap();
        let n = device_ids.len() as u64;
        let target = st
            .allocs
            .values()
            // Not "unverified": kubelet records after Allocate, so the
            // vcuda-core PreStart may have verified it already.
            .filter(|a| a.vmemory_ids.is_empty() && a.memory_limit == n)
            .max_by_key(|a| a.created)
            .map(Allocation::id);
        match target {
            Some(id) => {
                st.allocs.get_mut(&id).unwrap().vmemory_ids = device_ids;
                // Written with the next write (no sync of its own):
                // kubelet's records have the IDs anyway.
                self.changed_lazily(&mut st);
            }
            None => st.orphan_memory.push(device_ids),
        }
        ContainerAllocateResponse::default()
    }

    /// `PreStartContainer`: check the pod guessed at Allocate against what
    /// kubelet recorded. A wrong guess withdraws the allocation and fails
    /// the container, which must never start with another pod's quota.
    pub async fn pre_start(&self, resource: &str, device_ids: &[String]) -> Result<(), Status> {
        let found = {
            let st = self.state.lock().unwrap();
            st.allocs
                .values()
                .find(|a| {
                    let held = if resource == ids::VCORE_RESOURCE {
                        &a.vcore_ids
                    } else {
                        &a.vmemory_ids
                    };
                    held.iter().any(|i| device_ids.contains(i))
                })
                .cloned()
        };
        let Some(a) = found else {
            if resource == ids::VCORE_RESOURCE {
                return Err(Status::failed_precondition(format!(
                    "devices {device_ids:?} have no allocation in the manager (it was withdrawn or never made); \
                     delete the pod to have it allocated again"
                )));
            }
            return Ok(());
        };
        if a.verified {
            return Ok(());
        }
        let mut holder: Option<Holder> = None;
        for (res, list) in [
            (ids::VCORE_RESOURCE, &a.vcore_ids),
            (ids::VMEMORY_RESOURCE, &a.vmemory_ids),
        ] {
            if list.is_empty() {
                continue;
            }
            match self.kubelet.holder(res, list).await {
                Ok(Some(h)) => {
                    holder = Some(h);
                    break;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, id = %a.id(), "cannot read kubelet's device records; allocation stays unverified");
                    return Ok(());
                }
            }
        }
        let Some(h) = holder else {
            tracing::debug!(id = %a.id(), "kubelet has not recorded the devices yet; verifying at a later PreStart");
            return Ok(());
        };
        let same_pod = match &h.pod {
            PodKey::Name { namespace, name } => *namespace == a.namespace && *name == a.pod_name,
            PodKey::Uid(u) => *u == a.pod_uid,
        };
        if same_pod && h.container == a.container {
            let mut st = self.state.lock().unwrap();
            if let Some(x) = st.allocs.get_mut(&a.id()) {
                x.verified = true;
            }
            // Written with the next write: "verified" is re-established
            // from kubelet.
            self.changed_lazily(&mut st);
            return Ok(());
        }
        self.release(&a.id());
        self.state
            .lock()
            .unwrap()
            .withdrawn
            .insert(a.pod_uid.clone());
        // The guessed pod may have been annotated assigned already.
        self.patcher.submit(PatchJob {
            namespace: a.namespace.clone(),
            name: a.pod_name.clone(),
            uid: a.pod_uid.clone(),
            annotations: BTreeMap::from([(pods::GPU_ASSIGNED.to_string(), "false".to_string())]),
        });
        // A rare error path: the withdrawal is written before answering.
        let _ = self.flush().await;
        let msg = wrong_guess(&h, &a);
        // On both pods: the one whose container fails now (kubelet's
        // holder) and the one that waits to be allocated again.
        let holder = self.pods.pods().into_iter().find(|p| match &h.pod {
            PodKey::Name { namespace, name } => {
                pods::namespace(p) == namespace && pods::name(p) == name
            }
            PodKey::Uid(u) => pods::uid(p) == u,
        });
        let mut targets = vec![(a.namespace.clone(), a.pod_name.clone(), a.pod_uid.clone())];
        if let Some(p) = holder {
            targets.push((
                pods::namespace(&p).into(),
                pods::name(&p).into(),
                pods::uid(&p).into(),
            ));
        }
        for (namespace, name, uid) in targets {
            self.events.post(PodEvent {
                namespace,
                name,
                uid,
                reason: events::WRONG_POD_GUESS,
                note: msg.clone(),
            });
        }
        Err(Status::failed_precondition(msg))
    }

    /// Frees an allocation, its vm directory and socket; checkpoints.
    pub fn release(&self, id: &str) -> Option<Allocation> {
        let mut st = self.state.lock().unwrap();
        let a = st.allocs.remove(id)?;
        let _ = st.allocator.release(id);
        self.registry.stop(id);
        self.vm.remove(&a.pod_uid, &a.container);
        // Written with the next write (Allocate or periodic check), no sync
        // of its own: a checkpoint that over-states is corrected by
        // recovery.
        self.changed_lazily(&mut st);
        tracing::info!(id, "released");
        Some(a)
    }

    /// Releases allocations of pods the API server no longer has or that
    /// finished; run on every change of the pod watch, so a deleted pod's
    /// capacity is free as soon as the API server says so.
    pub fn release_deleted_pods(&self) -> usize {
        if self.pods.health() != ApiHealth::Ok {
            return 0;
        }
        // Allocations first, then pods: an allocation made in between has
        // its pod in the (newer) pod list.
        let allocs: Vec<(String, String)> = {
            let st = self.state.lock().unwrap();
            st.allocs
                .values()
                .map(|a| (a.id(), a.pod_uid.clone()))
                .collect()
        };
        let pods = self.pods.pods();
        let by_uid: BTreeMap<&str, &Arc<Pod>> = pods.iter().map(|p| (pods::uid(p), p)).collect();
        let mut n = 0;
        for (id, uid) in allocs {
            let why = match by_uid.get(uid.as_str()) {
                None => "pod is gone",
                Some(p) => match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
                    Some("Succeeded" | "Failed") => "pod finished",
                    _ => continue,
                },
            };
            tracing::info!(id, why, "releasing");
            if self.release(&id).is_some() {
                n += 1;
            }
        }
        n
    }

    /// Periodic check (`--allocation-check-period`): what the watch missed
    /// (deleted or finished pods), containers that died with nobody
    /// releasing them (runtime and kubelet agree; older than `grace`),
    /// annotations missing on complete pods, dead interposer PIDs, and a
    /// checkpoint write that failed before.
    pub async fn check_allocations(&self, grace: Duration) {
        self.release_deleted_pods();
        let snapshot: Vec<Allocation> = self.allocations();
        let (api, kubelet, runtime, unreachable) = self.gather().await;
        for u in &unreachable {
            tracing::debug!(source = %u, "periodic check: source unreachable");
        }
        let ev = Evidence {
            api: api.as_ref(),
            kubelet: kubelet.as_deref(),
            runtime: runtime.as_deref(),
        };
        let now = now();
        for a in &snapshot {
            if let Verdict::Release(why) =
                recovery::judge(a, &ev, now.saturating_sub(a.created), grace.as_secs())
            {
                tracing::info!(id = %a.id(), why, "periodic check: releasing");
                self.release(&a.id());
            }
        }
        if self.pods.health() == ApiHealth::Ok {
            let pods = self.pods.pods();
            let mut patched = BTreeSet::new();
            for p in &pods {
                let uid = pods::uid(p);
                if pods::annotation(p, pods::GPU_ASSIGNED) == Some("true")
                    || !patched.insert(uid.to_string())
                {
                    continue;
                }
                let job = {
                    let st = self.state.lock().unwrap();
                    let any = st.allocs.values().any(|a| a.pod_uid == uid);
                    any.then(|| self.patch_if_complete(&st, p)).flatten()
                };
                if let Some(job) = job {
                    self.patcher.submit(job);
                }
            }
        }
        let pruned = self.registry.prune();
        if pruned > 0 {
            tracing::info!(pruned, "dead interposer PIDs pruned");
        }
        // Releases since the last write, or a write that failed.
        if self.checkpoint_dirty() {
            let _ = self.flush().await;
        }
    }
}

fn wrong_guess(h: &Holder, a: &Allocation) -> String {
    format!(
        "kubelet gave these devices to {h}, but at Allocate the manager assigned them to pod {}/{} container {} \
         (uid {}; chosen from the pending pods by predicate time): the allocation is withdrawn and this container \
         fails so that it never runs with another pod's quota; delete the pod to have it allocated again",
        a.namespace, a.pod_name, a.container, a.pod_uid
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_id_fits_the_quota_file() {
        assert_eq!(short_bus_id("00000000:3B:00.0"), "0000:3B:00.0");
        assert_eq!(short_bus_id("0000:3B:00.0"), "0000:3B:00.0");
    }
}
