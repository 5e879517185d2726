//! A container's or a claim's share, opened the same way by both modes.
//!
//! The device plugin's allocation and the DRA driver's prepared claim are
//! different records, but what they leave on the node is one thing: a vm
//! directory with the quota files, a sealed ledger per GPU for shares, and
//! `vcuda.sock` serving the registration protocol. Each daemon translates
//! its record into a [`ShareSpec`] (a few lines), and [`Shares`] writes,
//! serves, undoes on failure and closes it — so a new tier of isolation
//! (MIG, priorities) lands here once, not in each daemon.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use qos_page::{QosPage, Tier};
use quota_config::{GpuQuota, MultiGpuQuota, ResourceData};

use crate::registry::{LedgerGpu, QosDevice, Registry, ShareExtras, ShareMemory, ShareQos};
use crate::vm::{VmDirs, VmError};

/// One GPU of a share, as its quota file carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareGpu {
    /// PCI bus id as NVML prints it (shortened for the file here).
    pub pci_bus_id: String,
    pub uuid: String,
    /// Memory quota on this GPU, bytes.
    pub memory_bytes: u64,
    /// Compute quota, percent of this GPU.
    pub cores: u32,
    /// Ceiling a soft share may burst to, percent (`cores` when hard).
    pub limit: u32,
    /// The GPU's (or MIG device's) memory, bytes: what lending on it is
    /// judged against.
    pub card_bytes: u64,
}

/// What a share is, in neither daemon's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareSpec {
    /// The registry's key: one per vm directory.
    pub id: String,
    /// First level of the vm directory: the pod's or the claim's UID.
    pub owner: String,
    /// Second level: the container's name or the claim's request slot.
    pub slot: String,
    /// Whole GPUs: a quota file with nothing to enforce, no ledger, no
    /// socket. Only `gpus[0]` is written.
    pub whole: bool,
    /// True: never above `cores`; false: may burst to `limit`.
    pub hard_limit: bool,
    pub driver_version: (i32, i32),
    /// In the order the container sees them; two or more (not whole) make
    /// a multi-GPU share (`vcuda-gpus.config`, a ledger each), as does one
    /// whose `uuid` is a MIG device's (a share inside that instance).
    pub gpus: Vec<ShareGpu>,
    /// Compute tier (docs/qos.md), ordered against the tenants of each of
    /// its GPUs (of its MIG device, for a share inside one).
    pub tier: Tier,
    /// Memory it may borrow up to, above its quota (docs/qos.md, "Memory");
    /// one-GPU shares only.
    pub memory_limit: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("a share needs at least one GPU")]
    NoGpu,
    #[error("vm directory: {0}")]
    Vm(#[from] VmError),
    #[error("serving {}: {source}", dir.join(quota_config::SOCKET_FILE).display())]
    Serve {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ShareSpec {
    /// Quotas in `vcuda-gpus.config`: on two or more GPUs, or inside a
    /// MIG device (relative to the instance, which the one-GPU file cannot
    /// say).
    fn is_multi(&self) -> bool {
        let in_mig = |g: &ShareGpu| g.uuid.starts_with(quota_config::MIG_UUID_PREFIX);
        !self.whole && (self.gpus.len() >= 2 || self.gpus.iter().any(in_mig))
    }

    /// Guarantees per ledger and the borrowing limit, for the registry.
    fn memory(&self) -> ShareMemory {
        ShareMemory {
            gpus: self
                .gpus
                .iter()
                .map(|g| LedgerGpu {
                    uuid: g.uuid.clone(),
                    guarantee: g.memory_bytes,
                    card_bytes: g.card_bytes,
                })
                .collect(),
            limit: self
                .memory_limit
                .filter(|_| self.gpus.len() == 1)
                .unwrap_or(0),
        }
    }

    /// `vcuda.config` of a one-GPU share or of whole GPUs.
    pub fn resource_data(&self) -> Result<ResourceData, ShareError> {
        let g = self.gpus.first().ok_or(ShareError::NoGpu)?;
        Ok(ResourceData {
            pod_uid: self.owner.clone(),
            limit: g.limit as i32,
            container_name: self.slot.clone(),
            bus_id: crate::short_bus_id(&g.pci_bus_id),
            gpu_memory: g.memory_bytes,
            utilization: g.cores as i32,
            hard_limit: self.hard_limit,
            driver_version: self.driver_version,
            enable: !self.whole,
        })
    }

    /// The quota files of a share on several GPUs (`None` otherwise).
    pub fn multi_quota(&self) -> Option<MultiGpuQuota> {
        self.is_multi().then(|| MultiGpuQuota {
            pod_uid: self.owner.clone(),
            container_name: self.slot.clone(),
            hard_limit: self.hard_limit,
            driver_version: self.driver_version,
            gpus: self
                .gpus
                .iter()
                .map(|g| GpuQuota {
                    bus_id: crate::short_bus_id(&g.pci_bus_id),
                    uuid: g.uuid.clone(),
                    gpu_memory: g.memory_bytes,
                    utilization: g.cores as i32,
                    limit: g.limit as i32,
                })
                .collect(),
        })
    }
}

/// The node's open shares: vm directories and their sockets.
pub struct Shares {
    vm: VmDirs,
    registry: Registry,
    /// Each GPU's QoS page (by UUID), made when a share of a tier first
    /// opens on it; lives as long as the daemon (a restarted one makes
    /// fresh pages, which the re-registering processes pick up).
    pages: Mutex<HashMap<String, QosDevice>>,
    // Orders opens and closes of one directory (a close racing a reopen of
    // the same container must not remove the new files).
    files: Mutex<()>,
}

impl Shares {
    pub fn new(vm_root: &Path) -> Shares {
        Shares {
            vm: VmDirs::new(vm_root),
            registry: Registry::default(),
            pages: Mutex::new(HashMap::new()),
            files: Mutex::new(()),
        }
    }

    pub fn vm(&self) -> &VmDirs {
        &self.vm
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Writes the share's vm directory (quota files, a ledger per GPU for
    /// shares, taken back when live) and serves its socket. Idempotent: a
    /// restart reopens what it recorded. On failure nothing is left served
    /// and a directory this call could not serve is removed.
    pub fn open(&self, s: &ShareSpec) -> Result<PathBuf, ShareError> {
        let _files = self.lock();
        let (dir, ledgers) = match s.multi_quota() {
            Some(q) => self.vm.prepare_multi(&q)?,
            None => {
                let data = s.resource_data()?;
                let quota = (!s.whole).then_some(data.gpu_memory);
                let (dir, ledger) = self.vm.prepare(&data, quota)?;
                (dir, ledger.into_iter().collect())
            }
        };
        if s.whole {
            return Ok(dir);
        }
        let served = self.qos(s).and_then(|qos| {
            let extras = ShareExtras {
                qos,
                memory: s.memory(),
            };
            self.registry
                .serve_share(&s.id, &dir, &s.owner, &s.slot, ledgers, extras)
        });
        if let Err(source) = served {
            self.vm.remove(&s.owner, &s.slot);
            return Err(ShareError::Serve { dir, source });
        }
        Ok(dir)
    }

    /// The share's tier and the QoS page of each device it runs on (made
    /// on first use): its GPUs', or its MIG device's for a share inside an
    /// instance (instances never slow each other down, so tiers order the
    /// tenants of one instance, not of the GPU). `None` for a plain share.
    fn qos(&self, s: &ShareSpec) -> std::io::Result<Option<ShareQos>> {
        if s.tier == Tier::Plain || s.gpus.is_empty() {
            return Ok(None);
        }
        let mut pages = self.pages.lock().unwrap_or_else(PoisonError::into_inner);
        let mut devices = Vec::with_capacity(s.gpus.len());
        for g in &s.gpus {
            if !pages.contains_key(&g.uuid) {
                let index = pages.len();
                let (page, file) = QosPage::create_sealed(index)
                    .map_err(|e| std::io::Error::other(format!("QoS page of {}: {e}", g.uuid)))?;
                pages.insert(g.uuid.clone(), QosDevice::new(index, page, file));
            }
            devices.push(pages[&g.uuid].clone());
        }
        Ok(Some(ShareQos {
            tier: s.tier,
            pages: devices,
        }))
    }

    /// Stops the share's socket and removes its directory, unless `reopened`
    /// says the same owner and slot were opened again meanwhile (decided
    /// under the same lock as [`Shares::open`]).
    pub fn close_unless(&self, id: &str, owner: &str, slot: &str, reopened: impl FnOnce() -> bool) {
        let _files = self.lock();
        if reopened() {
            return;
        }
        self.registry.stop(id);
        self.vm.remove(owner, slot);
    }

    /// [`Shares::close_unless`] for owners that never reopen a closing share.
    pub fn close(&self, id: &str, owner: &str, slot: &str) {
        self.close_unless(id, owner, slot, || false)
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        // Guards no data: a panic while held leaves nothing half-changed.
        self.files.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
