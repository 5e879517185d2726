//! NodePrepareResources / NodeUnprepareResources, protocol aside: a
//! prepared claim is its planned devices (shares of one or several GPUs,
//! or whole GPUs), one vm directory (`<vm>/<claim uid>/<first request>/`:
//! `vcuda.config`, for shares on several GPUs `vcuda-gpus.config`, a
//! ledger per shared GPU, and for shares `vcuda.sock` served by the
//! manager's [`Registry`]), one CDI spec, and an entry in the checkpoint. Prepare is idempotent (a prepared claim answers from
//! the checkpoint); a restarted driver re-serves the checkpoint's claims
//! and leaves their files as they are (unchanged bytes are not rewritten,
//! the ledger is reopened); unprepare removes all of it. A claim of a
//! MIG device is its CDI spec and checkpoint entry only: the instance is
//! the quota, and it stays as it is when the claim goes.

use std::path::PathBuf;
use std::sync::Arc;

use gpu_allocator::GpuInfo;
use k8s_openapi::api::resource::v1::ResourceClaim;
use node_agent::now;
use node_agent::registry::Registry;
use node_agent::share::{ShareError, ShareGpu, ShareSpec, Shares};

use crate::cdi;
use crate::checkpoint::{Checkpoint, CheckpointError, PreparedClaim, Store};
use crate::kube_api::ApiError;
use crate::mig_health::{InstanceXids, LostDevice};
use crate::partition::{self, PartitionError, Partitioner};
use crate::plan::{self, Inventory, PlanError, PlannedDevice, PlannedMig};

mod mig_claims;
pub use mig_claims::RescanError;

/// Where the driver reads allocated claims (the API server; a map in tests).
#[async_trait::async_trait]
pub trait ClaimSource: Send + Sync {
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError>;
}

/// Why a claim was not prepared or unprepared: what the kubelet reports
/// for it (each message names the claim).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error(transparent)]
    Read(#[from] ApiError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("claim {claim}: {source}")]
    Claim {
        claim: String,
        #[source]
        source: ClaimFailure,
    },
}

/// What went wrong with a claim the driver could read and plan.
#[derive(Debug, thiserror::Error)]
pub enum ClaimFailure {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(
        "{device} ({uuid}) had a critical Xid and is out of the ResourceSlice until it is healthy again"
    )]
    Unhealthy { device: String, uuid: String },
    #[error("GPU {0} is not on this node")]
    NoGpu(usize),
    #[error(transparent)]
    Share(#[from] ShareError),
    #[error("{device} ({uuid}) is no longer on this node (was its instance destroyed?)")]
    MigGone { device: String, uuid: String },
    #[error("{device}: {source}")]
    MigCaps {
        device: String,
        #[source]
        source: node_agent::mig::CapError,
    },
    #[error("{device} is already prepared for claim {claim}: a MIG device is one claim's")]
    MigTaken { device: String, claim: String },
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error("writing the CDI spec in {}: {source}", dir.display())]
    Cdi {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

impl ClaimRef {
    /// The error `failure` of this claim.
    fn failed(&self, failure: impl Into<ClaimFailure>) -> PrepareError {
        PrepareError::Claim {
            claim: format!("{}/{}", self.namespace, self.name),
            source: failure.into(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub node: String,
    /// Root of the vm directories (the device plugin's `--vm-dir`).
    pub vm_root: PathBuf,
    /// The vdriver mirror (`nvidia` and `origin` volumes).
    pub vdriver_dir: PathBuf,
    /// Where CDI specs go (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// Where the checkpoint lives.
    pub state_dir: PathBuf,
    pub driver_version: (i32, i32),
    /// Device nodes every GPU container also gets (`/dev/nvidia-uvm-tools`, ...).
    pub extra_devices: Vec<String>,
}

/// One prepared device as the kubelet is told about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    pub planned: PlannedDevice,
    pub cdi_id: String,
}

pub struct Driver {
    cfg: Config,
    inventory: Inventory,
    /// The static MIG devices of each GPU now (`inventory.mig` at start;
    /// a rescan replaces them: [`Driver::set_mig`]).
    mig: std::sync::RwLock<Vec<Option<Vec<node_agent::mig::MigDevice>>>>,
    claims: Arc<dyn ClaimSource>,
    shares: Shares,
    store: Store,
    /// Held across a whole prepare or unprepare (one at a time).
    state: tokio::sync::Mutex<Checkpoint>,
    /// A copy of the prepared claims for synchronous readers (display).
    view: std::sync::Mutex<Vec<PreparedClaim>>,
    /// Per GPU: no recent critical Xid, and why not. A claim the scheduler
    /// placed on a GPU just before it left the slice is refused rather than
    /// started; the kubelet's health stream watches it.
    health: tokio::sync::watch::Sender<NodeHealth>,
    /// Critical Xids inside GPU instances, for their MIG devices' health.
    instance_xids: std::sync::Mutex<InstanceXids>,
    /// Told when instances with an Xid were destroyed (their placements'
    /// taints go at the slice's next publish).
    xids_forgotten: tokio::sync::Notify,
    /// Makes and destroys the instances of placement devices (dynamic
    /// MIG, [`crate::partition`]); none without `--mig-dynamic`.
    partitioner: Option<Arc<dyn Partitioner>>,
    /// The dynamic GPUs' instances as last read ([`Driver::rescan_dynamic`]).
    dynamic_seen: std::sync::RwLock<crate::mig_health::DynamicSeen>,
}

/// What the kubelet's health stream reports: every GPU, and each prepared
/// claim's MIG device by (pool, device name) ([`crate::mig_health`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeHealth {
    pub gpus: Vec<GpuHealth>,
    pub mig: std::collections::BTreeMap<(String, String), GpuHealth>,
}

/// One device's health as the kubelet's health stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHealth {
    pub healthy: bool,
    /// Why it is unhealthy (empty when healthy).
    pub message: String,
}

impl Default for GpuHealth {
    fn default() -> GpuHealth {
        GpuHealth {
            healthy: true,
            message: String::new(),
        }
    }
}

/// The vm directory's "container" name of a request.
fn slot_name(request: &str) -> String {
    request.replace('/', "-")
}

fn registry_id(uid: &str, request: &str) -> String {
    format!("dra/{uid}/{}", slot_name(request))
}

/// The request whose name the claim's vm directory and socket carry.
fn slot_request(devices: &[PlannedDevice]) -> &str {
    devices.first().map_or("claim", |d| d.request.as_str())
}

fn outputs(c: &PreparedClaim) -> Vec<PreparedDevice> {
    c.devices
        .iter()
        .map(|d| PreparedDevice {
            planned: d.clone(),
            cdi_id: cdi::qualified(&cdi::device_name(&c.uid, &d.request, &d.device)),
        })
        .collect()
}

impl Driver {
    /// Loads the checkpoint and re-serves every prepared claim (a restart:
    /// running containers keep their files and reconnect to their sockets).
    /// Needs a tokio runtime (the sockets are served on it).
    pub fn start(
        cfg: Config,
        devices: impl Into<Inventory>,
        claims: Arc<dyn ClaimSource>,
    ) -> Result<Driver, CheckpointError> {
        let inventory = devices.into();
        let store = Store::new(&cfg.state_dir);
        let gpus_len = inventory.gpus.len();
        let ck = store.load(&cfg.node)?;
        let d = Driver {
            shares: Shares::new(&cfg.vm_root),
            cfg,
            mig: std::sync::RwLock::new(inventory.mig.clone()),
            inventory,
            claims,
            store,
            state: tokio::sync::Mutex::new(Checkpoint::default()),
            view: std::sync::Mutex::new(ck.claims.values().cloned().collect()),
            health: tokio::sync::watch::Sender::new(NodeHealth {
                gpus: vec![GpuHealth::default(); gpus_len],
                mig: Default::default(),
            }),
            instance_xids: Default::default(),
            xids_forgotten: Default::default(),
            partitioner: None,
            dynamic_seen: Default::default(),
        };
        for c in ck.claims.values() {
            if let Err(e) = d.restore(c) {
                tracing::error!(claim = %format!("{}/{}", c.namespace, c.name), error = %e, "restoring a prepared claim");
            }
        }
        d.sweep_cdi(&ck);
        tracing::info!(
            claims = ck.claims.len(),
            "prepared claims restored from the checkpoint"
        );
        *d.state.try_lock().expect("not shared yet") = ck;
        d.refresh_mig_health();
        Ok(d)
    }

    /// Dynamic MIG: placement devices' instances are made by `p`.
    pub fn with_partitioner(mut self, p: Arc<dyn Partitioner>) -> Driver {
        self.partitioner = Some(p);
        self
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// What claims are planned against: the GPUs, with their MIG devices
    /// as last read.
    pub(super) fn planning(&self) -> Inventory {
        Inventory {
            mig: self.mig.read().unwrap_or_else(|p| p.into_inner()).clone(),
            ..self.inventory.clone()
        }
    }

    /// GPU `gpu`'s static MIG devices now (`None`: not in MIG mode), from
    /// a rescan ([`crate::controller::SliceController`]): claims are
    /// planned on them from here on; prepared ones keep what they have.
    pub fn set_mig(&self, gpu: usize, devices: Option<Vec<node_agent::mig::MigDevice>>) {
        let mut m = self.mig.write().unwrap_or_else(|p| p.into_inner());
        if m.len() <= gpu {
            m.resize(gpu + 1, None);
        }
        m[gpu] = devices;
        drop(m);
        self.refresh_mig_health();
    }

    /// A critical Xid inside GPU instance `gi` of `gpu` (`None`: its quiet
    /// period passed), for that instance's MIG devices' health.
    pub fn set_instance_xid(&self, gpu: usize, gi: u32, xid: Option<u64>) {
        let mut x = self.instance_xids.lock().unwrap_or_else(|p| p.into_inner());
        match xid {
            Some(xid) => x.insert((gpu, gi), xid),
            None => x.remove(&(gpu, gi)),
        };
        drop(x);
        self.refresh_mig_health();
    }

    /// The critical Xid inside GPU instance `gi` of `gpu`, while its
    /// quiet period lasts and the instance it struck is there.
    pub fn instance_xid(&self, gpu: usize, gi: u32) -> Option<u64> {
        let x = self.instance_xids.lock().unwrap_or_else(|p| p.into_inner());
        x.get(&(gpu, gi)).copied()
    }

    /// Drops the Xids of the instances made for `devices`, just destroyed:
    /// the next instance under the same GPU-instance ID (the same
    /// placement) is new hardware state, not the one that faulted.
    fn forget_instance_xids(&self, devices: &[PlannedDevice]) {
        let mut x = self.instance_xids.lock().unwrap_or_else(|p| p.into_inner());
        let mut forgot = false;
        for d in devices {
            if let Some(m) = d.mig.as_ref().filter(|m| m.placement.is_some()) {
                forgot |= x.remove(&(d.gpu_index, m.gpu_instance)).is_some();
            }
        }
        drop(x);
        if forgot {
            self.refresh_mig_health();
            self.xids_forgotten.notify_one();
        }
    }

    /// Returns when instances with an Xid were destroyed since the last
    /// call (the slice controller republishes then).
    pub async fn instance_xids_forgotten(&self) {
        self.xids_forgotten.notified().await
    }

    /// Prepared claims' MIG devices whose instance is gone.
    pub fn lost_mig_devices(&self) -> Vec<LostDevice> {
        let mig = self.mig.read().unwrap_or_else(|p| p.into_inner());
        let seen = self.dynamic_seen.read().unwrap_or_else(|p| p.into_inner());
        crate::mig_health::lost(&self.prepared(), &mig, &seen)
    }

    /// Recomputes the prepared claims' MIG devices' health; the stream
    /// sends only a change.
    fn refresh_mig_health(&self) {
        let prepared = self.prepared();
        let mig = self.mig.read().unwrap_or_else(|p| p.into_inner()).clone();
        let seen = self
            .dynamic_seen
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let xids = self
            .instance_xids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        self.health.send_if_modified(|h| {
            let now = crate::mig_health::devices(&prepared, &mig, &seen, &h.gpus, &xids);
            let changed = now != h.mig;
            h.mig = now;
            changed
        });
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        &self.inventory.gpus
    }

    pub fn registry(&self) -> &Registry {
        self.shares.registry()
    }

    /// Prepared claims, for display and metrics (never waits on a prepare).
    pub fn prepared(&self) -> Vec<PreparedClaim> {
        self.view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Closes every `vcuda.sock` and its connections, as the process's exit
    /// would: the interposers keep their quota and ledger slot and register
    /// again with the next driver; `pids.config` is kept for it.
    pub fn shutdown(&self) {
        for c in self.prepared() {
            self.shares
                .registry()
                .stop(&registry_id(&c.uid, slot_request(&c.devices)));
        }
    }

    /// Health from the Xid watch, with the reason; prepared claims are not
    /// touched.
    pub fn set_healthy(&self, gpu: usize, healthy: bool, message: &str) {
        let changed = self
            .health
            .send_if_modified(|all| match all.gpus.get_mut(gpu) {
                Some(g) if g.healthy != healthy || g.message != message => {
                    *g = GpuHealth {
                        healthy,
                        message: message.to_string(),
                    };
                    true
                }
                _ => false,
            });
        if changed {
            // Its MIG devices' health follows the GPU's.
            self.refresh_mig_health();
        }
    }

    /// Every GPU's health and the prepared MIG devices', updated as they
    /// change.
    pub fn health_watch(&self) -> tokio::sync::watch::Receiver<NodeHealth> {
        self.health.subscribe()
    }

    fn publish_view(&self, ck: &Checkpoint) {
        *self
            .view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            ck.claims.values().cloned().collect();
        self.refresh_mig_health();
    }

    /// The registry id of a prepared device (its PIDs and ledger counters).
    pub fn registry_id(uid: &str, request: &str) -> String {
        registry_id(uid, request)
    }

    /// A claim in the shared floor's terms: one GPU per device, in the
    /// claim's order (the planner never mixes shares and whole GPUs).
    fn share_spec(&self, uid: &str, devices: &[PlannedDevice]) -> Result<ShareSpec, ClaimFailure> {
        let gpus = devices
            .iter()
            .map(|d| {
                let gpu = self
                    .inventory
                    .gpus
                    .get(d.gpu_index)
                    .ok_or(ClaimFailure::NoGpu(d.gpu_index))?;
                // A share inside a MIG device names the instance.
                let uuid = d.mig.as_ref().map_or(&d.gpu_uuid, |m| &m.uuid);
                Ok(ShareGpu {
                    pci_bus_id: gpu.pci_bus_id.clone(),
                    uuid: uuid.clone(),
                    memory_bytes: d.memory_bytes,
                    cores: d.cores,
                    limit: d.soft_limit.unwrap_or(d.cores),
                    // Inside a MIG device, lending is judged against the
                    // instance's memory (0, nothing lent, when not known).
                    card_bytes: match &d.mig {
                        Some(m) => self.instance_bytes(d.gpu_index, &m.uuid),
                        None => gpu.memory_bytes,
                    },
                })
            })
            .collect::<Result<_, ClaimFailure>>()?;
        Ok(ShareSpec {
            id: registry_id(uid, slot_request(devices)),
            owner: uid.to_string(),
            slot: slot_name(slot_request(devices)),
            whole: devices.iter().any(|d| d.whole),
            hard_limit: devices.iter().all(|d| d.soft_limit.is_none()),
            driver_version: self.cfg.driver_version,
            gpus,
            // The planner gives every device of a claim its one config's tier.
            tier: devices.first().map(|d| d.tier).unwrap_or_default(),
            memory_limit: devices.first().and_then(|d| d.memory_limit),
        })
    }

    /// The memory of MIG device `uuid` on GPU `gpu` as the node showed it.
    fn instance_bytes(&self, gpu: usize, uuid: &str) -> u64 {
        let devices = self.inventory.mig.get(gpu).and_then(Option::as_ref);
        devices
            .and_then(|v| v.iter().find(|m| m.uuid == uuid))
            .map_or(0, |m| m.memory_bytes)
    }

    /// Opens the claim's share: its vm directory and, for shares, its
    /// socket (with one ledger per GPU).
    fn materialize(&self, uid: &str, devices: &[PlannedDevice]) -> Result<PathBuf, ClaimFailure> {
        let spec = self.share_spec(uid, devices)?;
        Ok(self.shares.open(&spec)?)
    }

    fn cdi_failure(&self, source: std::io::Error) -> ClaimFailure {
        ClaimFailure::Cdi {
            dir: self.cfg.cdi_dir.clone(),
            source,
        }
    }

    fn claim_spec(&self, uid: &str, devices: &[PlannedDevice], dir: &std::path::Path) -> cdi::Spec {
        let share = devices.iter().find(|d| !d.whole);
        cdi::claim_spec(&cdi::ClaimInput {
            devices: devices
                .iter()
                .map(|d| {
                    (
                        cdi::device_name(uid, &d.request, &d.device),
                        &self.inventory.gpus[d.gpu_index],
                    )
                })
                .collect(),
            shared: share.is_some(),
            vdriver_dir: &self.cfg.vdriver_dir,
            vm_dir: dir,
            extra_devices: &self.cfg.extra_devices,
        })
    }

    /// What a claim is on disk besides its CDI spec (a vm directory and,
    /// for shares, a socket; nothing for a whole MIG device), and that spec.
    fn files(&self, uid: &str, devices: &[PlannedDevice]) -> Result<cdi::Spec, ClaimFailure> {
        if let Some((d, m)) = Self::mig_of(devices) {
            if d.whole {
                return self.mig_spec(uid, d, m, None);
            }
            let dir = self.materialize(uid, devices)?;
            return self.mig_spec(uid, d, m, Some(&dir));
        }
        let dir = self.materialize(uid, devices)?;
        Ok(self.claim_spec(uid, devices, &dir))
    }

    /// A prepared claim after a restart: its vm directories and sockets,
    /// and its CDI spec where it is missing or differs (a container
    /// restarting later needs it); unchanged files are not rewritten.
    fn restore(&self, c: &PreparedClaim) -> Result<(), ClaimFailure> {
        let spec = self.files(&c.uid, &c.devices)?;
        cdi::write_if_changed(&self.cfg.cdi_dir, &c.uid, &spec)
            .map(|_| ())
            .map_err(|e| self.cdi_failure(e))
    }

    /// Removes this driver's CDI specs of claims the checkpoint does not
    /// hold (a prepare that failed half-way before a crash): the runtime
    /// must not inject devices nobody accounts for. Vm directories are left
    /// alone: their root may be shared with a misconfigured device plugin.
    fn sweep_cdi(&self, ck: &Checkpoint) {
        let prefix = format!("{}-", crate::DRIVER_NAME);
        for e in std::fs::read_dir(&self.cfg.cdi_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(uid) = name
                .strip_prefix(&prefix)
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if !ck.claims.contains_key(uid) {
                tracing::info!(spec = %e.path().display(), "removing the CDI spec of a claim that is not prepared");
                if let Err(err) = std::fs::remove_file(e.path()) {
                    tracing::warn!(spec = %e.path().display(), error = %err, "removing a stray CDI spec");
                }
            }
        }
    }

    /// Takes in what another instance of the driver wrote (a rolling update
    /// runs the new one beside the old until the kubelet calls only the
    /// new): claims it prepared are served here too, claims it unprepared
    /// (their files already gone) are no longer served. Call with the
    /// checkpoint lock held.
    fn sync_from_disk(&self, st: &mut Checkpoint) -> Result<(), CheckpointError> {
        let disk = self.store.load(&self.cfg.node)?;
        if disk.claims == st.claims {
            return Ok(());
        }
        for (uid, c) in &disk.claims {
            if !st.claims.contains_key(uid) {
                tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %uid, "taking over a claim another instance prepared");
                if let Err(e) = self.restore(c) {
                    tracing::error!(claim = %format!("{}/{}", c.namespace, c.name), error = %e, "serving a claim another instance prepared");
                }
            }
        }
        for (uid, c) in &st.claims {
            if !disk.claims.contains_key(uid) {
                tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %uid, "another instance unprepared a claim");
                if !c.devices.is_empty() && Self::mig_of(&c.devices).is_none() {
                    self.shares
                        .registry()
                        .stop(&registry_id(uid, slot_request(&c.devices)));
                }
            }
        }
        *st = disk;
        self.publish_view(st);
        Ok(())
    }

    fn release(&self, uid: &str, devices: &[PlannedDevice]) {
        let whole_mig = Self::mig_of(devices).is_some_and(|(d, _)| d.whole);
        if !devices.is_empty() && !whole_mig {
            let request = slot_request(devices);
            self.shares
                .close(&registry_id(uid, request), uid, &slot_name(request));
        }
        if let Err(e) = cdi::remove(&self.cfg.cdi_dir, uid) {
            tracing::warn!(claim = uid, error = %e, "removing the CDI spec");
        }
    }

    /// Prepares one claim; the error is what the kubelet reports for it.
    pub async fn prepare(&self, c: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        let t0 = std::time::Instant::now();
        let mut st = self.state.lock().await;
        let _lock = self.store.lock().await.map_err(|e| c.failed(e))?;
        self.sync_from_disk(&mut st).map_err(|e| c.failed(e))?;
        if let Some(p) = st.claims.get(&c.uid) {
            return Ok(outputs(p));
        }
        let claim = self.claims.claim(&c.namespace, &c.name).await?;
        let planned = plan::plan(&claim, &c.uid, &self.cfg.node, &self.planning())?;
        let unhealthy = planned.iter().find(|d| {
            self.health
                .borrow()
                .gpus
                .get(d.gpu_index)
                .is_some_and(|g| !g.healthy)
        });
        if let Some(d) = unhealthy {
            return Err(c.failed(ClaimFailure::Unhealthy {
                device: d.device.clone(),
                uuid: d.gpu_uuid.clone(),
            }));
        }
        if let Some(taken) = Self::taken(&st, &planned) {
            return Err(c.failed(taken));
        }
        let mut planned = planned;
        let made =
            partition::create_all(self.partitioner.as_ref(), &self.cfg.state_dir, &mut planned);
        made.map_err(|e| c.failed(ClaimFailure::from(e)))?;
        // On failure everything of this claim goes (release is idempotent).
        let r = (|| {
            let spec = self.files(&c.uid, &planned)?;
            cdi::write(&self.cfg.cdi_dir, &c.uid, &spec).map_err(|e| self.cdi_failure(e))?;
            Ok::<(), ClaimFailure>(())
        })();
        let prepared = PreparedClaim {
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            uid: c.uid.clone(),
            devices: planned,
            prepared_at: now(),
        };
        let r = r.and_then(|()| {
            st.claims.insert(c.uid.clone(), prepared.clone());
            self.store.save(&st).map_err(|e| {
                st.claims.remove(&c.uid);
                ClaimFailure::from(e)
            })
        });
        if let Err(e) = r {
            self.release(&c.uid, &prepared.devices);
            let p = self.partitioner.as_ref();
            if partition::destroy_all(p, &self.cfg.state_dir, &prepared.devices).is_ok() {
                self.forget_instance_xids(&prepared.devices);
            }
            return Err(c.failed(e));
        }
        self.publish_view(&st);
        tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, devices = prepared.devices.len(), ms = t0.elapsed().as_secs_f64() * 1e3, "claim prepared");
        Ok(outputs(&prepared))
    }

    /// Unprepares one claim; an unknown one is already unprepared.
    pub async fn unprepare(&self, c: &ClaimRef) -> Result<(), PrepareError> {
        let t0 = std::time::Instant::now();
        let mut st = self.state.lock().await;
        let _lock = self.store.lock().await.map_err(|e| c.failed(e))?;
        self.sync_from_disk(&mut st).map_err(|e| c.failed(e))?;
        let Some(p) = st.claims.get(&c.uid) else {
            return Ok(());
        };
        // Its instances go first: one NVML refuses (in use) keeps the
        // claim prepared, and the kubelet retries.
        let parts = self.partitioner.as_ref();
        partition::destroy_all(parts, &self.cfg.state_dir, &p.devices)
            .map_err(|e| c.failed(ClaimFailure::from(e)))?;
        self.forget_instance_xids(&p.devices);
        let p = st.claims.remove(&c.uid).expect("just found");
        if let Err(e) = self.store.save(&st) {
            st.claims.insert(c.uid.clone(), p);
            return Err(c.failed(e));
        }
        self.publish_view(&st);
        self.release(&c.uid, &p.devices);
        tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, ms = t0.elapsed().as_secs_f64() * 1e3, "claim unprepared");
        Ok(())
    }
}

#[cfg(test)]
mod tests;
