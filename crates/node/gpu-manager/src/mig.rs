//! MIG devices served whole, one device plugin per profile (NVIDIA's
//! `mixed` strategy): `tencent.com/mig-3g.40gb` advertises each 3g.40gb
//! MIG device on the node by its UUID, and Allocate gives the container
//! the instance's device nodes, `NVIDIA_VISIBLE_DEVICES=MIG-…` and the
//! untouched driver ([`node_agent::edits::for_mig`]).
//!
//! Nothing is recorded: the kubelet's own checkpoint says which MIG device
//! a pod holds, and a MIG device is never split, so these plugins need
//! neither the manager's state nor its handover gate. They are served on
//! this manager's own sockets, not through the supervisor: across a
//! restart the kubelet sees them go and come back (running pods keep their
//! devices; an admission in the gap is retried by the kubelet). The
//! devices follow the instances an operator makes or destroys while the
//! manager runs ([`MigPlugins::refresh`], every `--mig-rescan-period`); a
//! device destroyed under a pod stays listed, Unhealthy, and the pod is
//! told ([`lost`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use device_plugin::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, DevicePluginOptions,
};
use device_plugin::{DeviceList, DevicePluginService};
use gpu_allocator::GpuInfo;
use node_agent::edits::{self, GpuEdits, MigEditsInput};
use node_agent::mig::{MigDevice, MigGpu};
use tokio::sync::watch;
use tonic::Status;

use gpu_pods::mig_resource_name;

/// A MIG device and the GPU it is on.
#[derive(Debug, Clone)]
struct Served {
    parent: GpuInfo,
    device: MigDevice,
    /// Its instance is gone (a rescan no longer finds it): listed
    /// Unhealthy while a pod may hold it ([`lost`]).
    lost: bool,
}

/// What a MIG plugin's Allocate needs besides its devices.
#[derive(Debug, Clone)]
pub struct MigContext {
    pub host_root: PathBuf,
    pub vdriver_dir: PathBuf,
    pub extra_devices: Vec<String>,
}

/// The plugin of one profile.
pub struct MigPlugin {
    pub resource: String,
    pub profile: String,
    /// Its devices now (a rescan replaces them: [`MigPlugins::refresh`]).
    served: Mutex<Vec<Served>>,
    list: DeviceList,
    ctx: Arc<MigContext>,
}

/// A GPU (`None`) or one of its GPU instances.
type Unit = (usize, Option<u32>);

/// Where plugins made after the start are served.
struct Serving {
    dir: PathBuf,
    instance: String,
    cancel: tokio_util::sync::CancellationToken,
}

/// Every MIG plugin of the node, by resource name.
#[derive(Clone)]
pub struct MigPlugins {
    prefix: String,
    ctx: Arc<MigContext>,
    plugins: Arc<Mutex<BTreeMap<String, Arc<MigPlugin>>>>,
    /// Serving them ([`MigPlugins::start`]; one runtime more for each
    /// rescan that found new profiles).
    running: Arc<Mutex<Vec<device_plugin::RuntimeHandle>>>,
    serving: Arc<Mutex<Option<Serving>>>,
    /// GPUs (`None`) and GPU instances with a recent critical Xid.
    out: Arc<Mutex<BTreeSet<Unit>>>,
    /// Lost devices whose pods were told, by UUID.
    told: Arc<Mutex<BTreeSet<String>>>,
    /// Dynamic MIG's state for `/metrics` (none without `--mig-dynamic`).
    dynamic: Arc<Mutex<Option<gpu_display::DynamicMigView>>>,
    /// Where what is served is recorded ([`record`]; none: not recorded).
    record_dir: Option<Arc<Path>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The MIG devices of the GPUs in MIG mode, by profile.
fn by_profile(gpus: &[GpuInfo], mig: &[MigGpu]) -> BTreeMap<String, Vec<Served>> {
    let mut by: BTreeMap<String, Vec<Served>> = BTreeMap::new();
    for (g, m) in gpus.iter().zip(mig).filter(|(_, m)| m.enabled) {
        for d in &m.devices {
            by.entry(d.profile.clone()).or_default().push(Served {
                parent: g.clone(),
                device: d.clone(),
                lost: false,
            });
        }
    }
    by
}

/// Healthy while its instance is there and neither its GPU nor its GPU
/// instance is `out`.
fn healthy(s: &Served, out: &BTreeSet<Unit>) -> bool {
    let (g, gi) = (s.parent.index, s.device.gpu_instance);
    !s.lost && !out.contains(&(g, None)) && !out.contains(&(g, Some(gi)))
}

/// A list's devices and whether each is lost, to see what changed.
fn listing(served: &[Served]) -> Vec<(String, bool)> {
    served
        .iter()
        .map(|s| (s.device.uuid.clone(), s.lost))
        .collect()
}

impl MigPlugin {
    /// Replaces its devices, each advertised with its health.
    fn set_served(&self, served: Vec<Served>, out: &BTreeSet<Unit>) {
        let devices = served
            .iter()
            .map(|s| {
                let numa = s.parent.numa_node.map(i64::from);
                device_plugin::device(s.device.uuid.clone(), healthy(s, out), numa)
            })
            .collect();
        *locked(&self.served) = served;
        self.list.replace(devices);
    }

    /// `now`, and what it served before that `now` lacks, lost.
    fn with_lost(&self, mut now: Vec<Served>) -> Vec<Served> {
        let lost: Vec<Served> = locked(&self.served)
            .iter()
            .filter(|s| !now.iter().any(|n| n.device.uuid == s.device.uuid))
            .map(|s| Served {
                lost: true,
                ..s.clone()
            })
            .collect();
        now.extend(lost);
        now
    }

    /// How many devices it serves.
    pub fn len(&self) -> usize {
        locked(&self.served).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl MigPlugins {
    /// One plugin per profile found on the GPUs in MIG mode (`mig[i]` is
    /// GPU `gpus[i]`'s state).
    pub fn new(prefix: &str, gpus: &[GpuInfo], mig: &[MigGpu], ctx: MigContext) -> MigPlugins {
        let m = MigPlugins {
            prefix: prefix.to_string(),
            ctx: Arc::new(ctx),
            plugins: Default::default(),
            running: Default::default(),
            serving: Default::default(),
            out: Default::default(),
            told: Default::default(),
            dynamic: Default::default(),
            record_dir: None,
        };
        m.add_and_update(by_profile(gpus, mig));
        m
    }

    /// Starts from what the last manager recorded in `state_dir` as well:
    /// its devices that are gone now (destroyed while no manager ran) are
    /// listed lost, so the pods holding them are told ([`lost`]). From now
    /// on what is served is recorded there. `gpus`: the node's now (a
    /// device is found by its GPU's UUID).
    pub fn with_record(mut self, state_dir: &Path, gpus: &[GpuInfo]) -> MigPlugins {
        let served: BTreeSet<String> = self
            .all_served()
            .into_iter()
            .map(|r| r.device.uuid)
            .collect();
        let gone: Vec<Served> = record::load(state_dir)
            .into_iter()
            .filter(|r| !served.contains(&r.device.uuid))
            .filter_map(|r| {
                let Some(parent) = gpus.iter().find(|g| g.uuid == r.gpu) else {
                    tracing::info!(uuid = %r.device.uuid, gpu = %r.gpu, "a recorded MIG device's GPU is not on this node any more: dropped");
                    return None;
                };
                tracing::warn!(uuid = %r.device.uuid, profile = %r.device.profile, gpu = parent.index, "a MIG device served before this manager started is gone (destroyed while no manager ran): listed Unhealthy while a pod may hold it");
                Some(Served {
                    parent: parent.clone(),
                    device: r.device,
                    lost: true,
                })
            })
            .collect();
        self.record_dir = Some(state_dir.into());
        self.add_lost(gone);
        self.store();
        self
    }

    /// Adds devices already lost, each to its profile's plugin (made for a
    /// profile with nothing else left).
    fn add_lost(&self, gone: Vec<Served>) {
        let out = locked(&self.out).clone();
        let mut plugins = locked(&self.plugins);
        for s in gone {
            let resource = mig_resource_name(&self.prefix, &s.device.profile);
            let p = plugins
                .entry(resource.clone())
                .or_insert_with(|| self.plugin_of(resource, s.device.profile.clone()))
                .clone();
            let mut now = locked(&p.served).clone();
            now.push(s);
            p.set_served(now, &out);
        }
    }

    fn plugin_of(&self, resource: String, profile: String) -> Arc<MigPlugin> {
        Arc::new(MigPlugin {
            resource,
            profile,
            served: Default::default(),
            list: DeviceList::new(Vec::new()),
            ctx: self.ctx.clone(),
        })
    }

    /// Every device listed, lost or not, as the record keeps it.
    fn all_served(&self) -> Vec<record::RecordedDevice> {
        let plugins = locked(&self.plugins);
        let mut out = Vec::new();
        for p in plugins.values() {
            for s in locked(&p.served).iter() {
                out.push(record::RecordedDevice {
                    gpu: s.parent.uuid.clone(),
                    device: s.device.clone(),
                });
            }
        }
        out
    }

    /// Records what is listed now (where [`Self::with_record`] said); a
    /// failure is logged: the devices are served all the same.
    fn store(&self) {
        let Some(dir) = &self.record_dir else {
            return;
        };
        if let Err(e) = record::store(dir, self.all_served()) {
            tracing::warn!(error = %e, "recording the MIG devices served: a manager started later will not know of devices destroyed before it");
        }
    }

    /// The plugin of `resource`.
    pub fn plugin(&self, resource: &str) -> Option<Arc<MigPlugin>> {
        locked(&self.plugins).get(resource).cloned()
    }

    /// Dynamic MIG's last pass: per profile needed, how many fit nowhere;
    /// instances made and destroyed by it.
    pub fn note_dynamic(&self, unplaced: BTreeMap<String, u64>, made: u64, destroyed: u64) {
        let mut d = locked(&self.dynamic);
        let v = d.get_or_insert_with(Default::default);
        v.unplaced = unplaced;
        v.made += made;
        v.destroyed += destroyed;
    }

    /// What `/metrics` shows of dynamic MIG (none without it).
    pub fn dynamic_view(&self) -> Option<gpu_display::DynamicMigView> {
        locked(&self.dynamic).clone()
    }

    /// The resources served, in order.
    pub fn resources(&self) -> Vec<String> {
        locked(&self.plugins).keys().cloned().collect()
    }

    /// Sets each profile's devices to `by`'s (none for a profile gone: its
    /// plugin stays, advertising nothing; a device gone stays, lost) and
    /// makes plugins for profiles new to it, returned. What changed is
    /// logged.
    fn add_and_update(&self, mut by: BTreeMap<String, Vec<Served>>) -> Vec<Arc<MigPlugin>> {
        let out = locked(&self.out).clone();
        let mut plugins = locked(&self.plugins);
        let mut told = locked(&self.told);
        let mut changed = false;
        for p in plugins.values() {
            let now = p.with_lost(by.remove(&p.profile).unwrap_or_default());
            // Served again: told again if lost again.
            now.iter()
                .filter(|s| !s.lost)
                .for_each(|s| _ = told.remove(&s.device.uuid));
            let was = listing(&locked(&p.served));
            let is = listing(&now);
            if was != is {
                tracing::info!(resource = %p.resource, before = ?was, now = ?is, "MIG devices changed (true: lost, listed Unhealthy while a pod may hold it)");
                p.set_served(now, &out);
                changed = true;
            }
        }
        let mut added = Vec::new();
        changed |= !by.is_empty();
        for (profile, served) in by {
            let resource = mig_resource_name(&self.prefix, &profile);
            let p = self.plugin_of(resource.clone(), profile);
            p.set_served(served, &out);
            plugins.insert(resource, p.clone());
            added.push(p);
        }
        drop((plugins, told));
        if changed {
            self.store();
        }
        added
    }

    /// The node's MIG devices now (a rescan: instances an operator made or
    /// destroyed since): each profile's plugin advertises what is there,
    /// and a profile new to this manager gets a plugin of its own,
    /// registered at once when the others are served.
    pub fn refresh(&self, gpus: &[GpuInfo], mig: &[MigGpu]) -> anyhow::Result<()> {
        let added = self.add_and_update(by_profile(gpus, mig));
        if added.is_empty() {
            return Ok(());
        }
        let serving = locked(&self.serving);
        let Some(at) = serving.as_ref() else {
            return Ok(());
        };
        let h = runtime(&at.dir, &at.instance, &added).start(at.cancel.clone())?;
        locked(&self.running).push(h);
        Ok(())
    }

    /// An Xid on GPU `gpu` (or its quiet period) for its MIG devices.
    pub fn set_gpu_health(&self, gpu: usize, healthy: bool) {
        self.set_out((gpu, None), !healthy);
    }

    /// An Xid inside GPU instance `gi` of GPU `gpu` (or its quiet period):
    /// that instance's MIG devices alone.
    pub fn set_instance_health(&self, gpu: usize, gi: u32, healthy: bool) {
        tracing::warn!(
            gpu,
            gpu_instance = gi,
            healthy,
            "MIG GPU instance health changed"
        );
        self.set_out((gpu, Some(gi)), !healthy);
    }

    /// Marks `unit` out (or back) and sets each device's health.
    fn set_out(&self, unit: Unit, out: bool) {
        let mut set = locked(&self.out);
        if out {
            set.insert(unit);
        } else {
            set.remove(&unit);
        }
        for p in locked(&self.plugins).values() {
            for s in locked(&p.served).iter() {
                p.list.set_health(&s.device.uuid, healthy(s, &set));
            }
        }
    }
}

/// A runtime serving `plugins` on this instance's sockets in `dir`.
fn runtime(dir: &Path, instance: &str, plugins: &[Arc<MigPlugin>]) -> device_plugin::PluginRuntime {
    let mut rt = device_plugin::PluginRuntime::new(dir);
    for p in plugins {
        tracing::info!(resource = %p.resource, devices = p.len(), "serving MIG devices");
        let socket = node_agent::mode::mig_plugin_socket(&p.profile, instance);
        rt = rt.plugin(p.resource.clone(), socket, p.clone());
    }
    rt
}

/// Why a MIG Allocate is refused.
#[derive(Debug, thiserror::Error)]
pub enum MigRefusal {
    #[error("{resource}: no MIG device {id:?} on this node")]
    Unknown { resource: String, id: String },
    #[error("{resource}: the container asks for no device")]
    Empty { resource: String },
    #[error("{resource}: MIG device {uuid}'s instance was destroyed")]
    Lost { resource: String, uuid: String },
    #[error("{resource}: MIG device {uuid}: {source}")]
    Caps {
        resource: String,
        uuid: String,
        #[source]
        source: node_agent::mig::CapError,
    },
}

impl MigPlugin {
    /// The edits of one container holding `ids` (MIG UUIDs of this profile).
    pub fn edits(&self, ids: &[String]) -> Result<GpuEdits, MigRefusal> {
        let mut out: Option<GpuEdits> = None;
        for id in ids {
            let s = locked(&self.served)
                .iter()
                .find(|s| &s.device.uuid == id)
                .cloned()
                .ok_or_else(|| MigRefusal::Unknown {
                    resource: self.resource.clone(),
                    id: id.clone(),
                })?;
            if s.lost {
                return Err(MigRefusal::Lost {
                    resource: self.resource.clone(),
                    uuid: id.clone(),
                });
            }
            let caps = node_agent::mig::access_caps(&self.ctx.host_root, s.parent.minor, &s.device)
                .map_err(|source| MigRefusal::Caps {
                    resource: self.resource.clone(),
                    uuid: id.clone(),
                    source,
                })?;
            let e = edits::for_mig(&MigEditsInput {
                parent: &s.parent,
                uuid: id,
                caps,
                vdriver_dir: &self.ctx.vdriver_dir,
                extra_devices: &self.ctx.extra_devices,
                share_vm_dir: None,
            });
            out = Some(match out {
                None => e,
                Some(acc) => merge(acc, e),
            });
        }
        out.ok_or_else(|| MigRefusal::Empty {
            resource: self.resource.clone(),
        })
    }
}

/// Two MIG devices in one container: every node once, the UUIDs listed.
fn merge(mut acc: GpuEdits, e: GpuEdits) -> GpuEdits {
    for n in &e.gpus {
        if !acc.gpus.contains(n) {
            acc.gpus.push(n.clone());
        }
    }
    let uuid = |x: &GpuEdits| {
        x.common
            .env
            .iter()
            .find(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES")
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let joined = format!("{},{}", uuid(&acc), uuid(&e));
    for (k, v) in &mut acc.common.env {
        if k == "NVIDIA_VISIBLE_DEVICES" {
            *v = joined.clone();
        }
    }
    acc
}

#[tonic::async_trait]
impl DevicePluginService for MigPlugin {
    fn options(&self) -> DevicePluginOptions {
        DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: false,
        }
    }

    fn devices(&self) -> watch::Receiver<Vec<device_plugin::api::Device>> {
        self.list.subscribe()
    }

    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let container_responses = request
            .container_requests
            .iter()
            .map(|c| {
                let e = self.edits(&c.devices_ids).map_err(|r| {
                    tracing::warn!(error = %r, "MIG Allocate refused");
                    match r {
                        MigRefusal::Caps { .. } | MigRefusal::Lost { .. } => {
                            Status::failed_precondition(r.to_string())
                        }
                        _ => Status::invalid_argument(r.to_string()),
                    }
                })?;
                tracing::info!(resource = %self.resource, devices = ?c.devices_ids, "MIG devices allocated");
                Ok(crate::decide::response::render(&e, Default::default()))
            })
            .collect::<Result<Vec<ContainerAllocateResponse>, Status>>()?;
        Ok(AllocateResponse {
            container_responses,
        })
    }
}

impl MigPlugins {
    /// Serves every MIG plugin on sockets of its own in `dir` until
    /// `cancel`, and the plugins of profiles a rescan finds later.
    pub fn start(
        &self,
        dir: &Path,
        instance: &str,
        cancel: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<()> {
        remove_stale(dir);
        let plugins: Vec<Arc<MigPlugin>> = locked(&self.plugins).values().cloned().collect();
        *locked(&self.serving) = Some(Serving {
            dir: dir.to_path_buf(),
            instance: instance.to_string(),
            cancel: cancel.clone(),
        });
        if !plugins.is_empty() {
            let h = runtime(dir, instance, &plugins).start(cancel)?;
            locked(&self.running).push(h);
        }
        Ok(())
    }

    /// Copies of the kubelet's connections to these plugins: a manager
    /// handing the node over passes them on with the others, so that its
    /// exit ends no stream (kubelet ≥ 1.26 would drop the successor's
    /// registration of the same resources).
    pub fn kubelet_connections(&self) -> Vec<std::os::fd::OwnedFd> {
        locked(&self.running)
            .iter()
            .flat_map(|h| h.kubelet_connections())
            .collect()
    }

    /// Waits for the plugins to stop (after the `cancel` given to `start`).
    pub async fn stopped(&self) {
        let handles = std::mem::take(&mut *locked(&self.running));
        for h in handles {
            if let Err(e) = h.wait().await {
                tracing::warn!(error = %e, "stopping the MIG plugins");
            }
        }
    }
}

/// MIG plugin sockets of managers that died without removing them (in
/// supervised mode nobody else removes them).
fn remove_stale(dir: &Path) {
    let stale = node_agent::mode::device_plugin_sockets(dir)
        .into_iter()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vcuda-mig-"))
        })
        .filter(|p| !node_agent::mode::serving(p));
    for p in stale {
        if let Err(e) = std::fs::remove_file(&p) {
            tracing::warn!(socket = %p.display(), error = %e, "removing a stale MIG plugin socket");
        }
    }
}

pub mod demand;
pub mod dynamic;
pub mod fits;
mod lost;
pub mod passed_over;
pub mod record;
#[cfg(test)]
mod tests;
