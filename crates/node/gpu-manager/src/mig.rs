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
//! devices; an admission in the gap is retried by the kubelet).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    served: Vec<Served>,
    list: DeviceList,
    ctx: Arc<MigContext>,
}

/// A GPU (`None`) or one of its GPU instances.
type Unit = (usize, Option<u32>);

/// Every MIG plugin of the node, by resource name.
#[derive(Clone, Default)]
pub struct MigPlugins {
    pub plugins: BTreeMap<String, Arc<MigPlugin>>,
    /// Serving them ([`MigPlugins::start`]).
    running: Arc<std::sync::Mutex<Option<device_plugin::RuntimeHandle>>>,
    /// GPUs (`None`) and GPU instances with a recent critical Xid.
    out: Arc<std::sync::Mutex<std::collections::BTreeSet<Unit>>>,
}

impl MigPlugins {
    /// One plugin per profile found on the GPUs in MIG mode (`mig[i]` is
    /// GPU `gpus[i]`'s state).
    pub fn new(prefix: &str, gpus: &[GpuInfo], mig: &[MigGpu], ctx: MigContext) -> MigPlugins {
        let ctx = Arc::new(ctx);
        let mut by: BTreeMap<String, Vec<Served>> = BTreeMap::new();
        for (g, m) in gpus.iter().zip(mig).filter(|(_, m)| m.enabled) {
            for d in &m.devices {
                by.entry(d.profile.clone()).or_default().push(Served {
                    parent: g.clone(),
                    device: d.clone(),
                });
            }
        }
        let plugins = by
            .into_iter()
            .map(|(profile, served)| {
                let resource = mig_resource_name(prefix, &profile);
                let devices = served
                    .iter()
                    .map(|s| {
                        let numa = s.parent.numa_node.map(i64::from);
                        device_plugin::device(s.device.uuid.clone(), true, numa)
                    })
                    .collect();
                let p = MigPlugin {
                    resource: resource.clone(),
                    profile,
                    served,
                    list: DeviceList::new(devices),
                    ctx: ctx.clone(),
                };
                (resource, Arc::new(p))
            })
            .collect();
        MigPlugins {
            plugins,
            running: Default::default(),
            out: Default::default(),
        }
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

    /// Marks `unit` out (or back) and sets each device's health: healthy
    /// while neither its GPU nor its GPU instance is out.
    fn set_out(&self, unit: Unit, out: bool) {
        let mut set = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if out {
            set.insert(unit);
        } else {
            set.remove(&unit);
        }
        for p in self.plugins.values() {
            for s in &p.served {
                let (g, gi) = (s.parent.index, s.device.gpu_instance);
                let healthy = !set.contains(&(g, None)) && !set.contains(&(g, Some(gi)));
                p.list.set_health(&s.device.uuid, healthy);
            }
        }
    }
}

/// Why a MIG Allocate is refused.
#[derive(Debug, thiserror::Error)]
pub enum MigRefusal {
    #[error("{resource}: no MIG device {id:?} on this node")]
    Unknown { resource: String, id: String },
    #[error("{resource}: the container asks for no device")]
    Empty { resource: String },
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
            let s = self
                .served
                .iter()
                .find(|s| &s.device.uuid == id)
                .ok_or_else(|| MigRefusal::Unknown {
                    resource: self.resource.clone(),
                    id: id.clone(),
                })?;
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
                        MigRefusal::Caps { .. } => Status::failed_precondition(r.to_string()),
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
    /// `cancel` (nothing when the node has no MIG device).
    pub fn start(
        &self,
        dir: &Path,
        instance: &str,
        cancel: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<()> {
        if self.plugins.is_empty() {
            return Ok(());
        }
        remove_stale(dir);
        let mut rt = device_plugin::PluginRuntime::new(dir);
        for (resource, p) in &self.plugins {
            tracing::info!(%resource, devices = p.served.len(), "serving MIG devices");
            let socket = node_agent::mode::mig_plugin_socket(&p.profile, instance);
            rt = rt.plugin(resource.clone(), socket, p.clone());
        }
        *self.lock() = Some(rt.start(cancel)?);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<device_plugin::RuntimeHandle>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Copies of the kubelet's connections to these plugins: a manager
    /// handing the node over passes them on with the others, so that its
    /// exit ends no stream (kubelet ≥ 1.26 would drop the successor's
    /// registration of the same resources).
    pub fn kubelet_connections(&self) -> Vec<std::os::fd::OwnedFd> {
        self.lock()
            .as_ref()
            .map(|h| h.kubelet_connections())
            .unwrap_or_default()
    }

    /// Waits for the plugins to stop (after the `cancel` given to `start`).
    pub async fn stopped(&self) {
        let handle = self.lock().take();
        if let Some(h) = handle
            && let Err(e) = h.wait().await
        {
            tracing::warn!(error = %e, "stopping the MIG plugins");
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

#[cfg(test)]
mod tests;
