//! The node's GPUs from NVML (loaded by path from the host root): identity,
//! memory, NUMA node, pairwise PCIe common ancestor and NVLink links; Xid
//! events for health. Process and utilization samples are gpu-display's
//! sampler's.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpu_allocator::{GpuInfo, PcieLevel, Topology};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;

#[derive(Debug, thiserror::Error)]
pub enum NvmlSetupError {
    #[error("loading NVML from {path}: {source}")]
    Load {
        path: String,
        #[source]
        source: NvmlError,
    },
    #[error("NVML {what}: {source}")]
    Query {
        what: String,
        #[source]
        source: NvmlError,
    },
    #[error("NVML reports no GPUs: nothing to share on this node")]
    NoGpus,
    #[error("GPU topology: {0}")]
    Topology(#[from] gpu_allocator::TopologyError),
    #[error(transparent)]
    Mig(#[from] crate::mig::MigReadError),
}

fn q<T>(what: impl FnOnce() -> String, r: Result<T, NvmlError>) -> Result<T, NvmlSetupError> {
    r.map_err(|source| NvmlSetupError::Query {
        what: what(),
        source,
    })
}

/// NVML_NVLINK_MAX_LINKS of current drivers.
const NVLINK_MAX_LINKS: u32 = 18;

pub fn load(path: &Path) -> Result<Arc<Nvml>, NvmlSetupError> {
    Nvml::builder()
        .lib_path(path.as_os_str())
        .init()
        .map(Arc::new)
        .map_err(|source| NvmlSetupError::Load {
            path: path.display().to_string(),
            source,
        })
}

/// What discovery found.
pub struct Discovered {
    pub topology: Topology,
    pub names: Vec<String>,
    pub driver_version: String,
    /// Each GPU's MIG state, by index.
    pub mig: Vec<crate::mig::MigGpu>,
}

impl Discovered {
    /// An allocator over the node, GPUs in MIG mode marked so.
    pub fn allocator(&self) -> gpu_allocator::Allocator {
        let mut a = gpu_allocator::Allocator::new(self.topology.clone());
        for (i, m) in self.mig.iter().enumerate() {
            if m.enabled {
                a.set_mig(i, true).expect("one MIG state per GPU");
            }
        }
        a
    }
}

/// NVML bus ids have an 8-digit domain; compare on the last 12 characters,
/// case-insensitively ("0000:3b:00.0").
pub fn bus_key(bus: &str) -> String {
    let b = bus.trim_end_matches('\0').to_ascii_lowercase();
    let n = b.len();
    if n > 12 { b[n - 12..].to_string() } else { b }
}

fn level(l: TopologyLevel) -> PcieLevel {
    match l {
        TopologyLevel::Internal => PcieLevel::Internal,
        TopologyLevel::Single => PcieLevel::Single,
        TopologyLevel::Multiple => PcieLevel::Multiple,
        TopologyLevel::HostBridge => PcieLevel::HostBridge,
        TopologyLevel::Node => PcieLevel::Node,
        TopologyLevel::System => PcieLevel::System,
    }
}

// Pairwise matrices read best with explicit indices.
#[allow(clippy::needless_range_loop)]
pub fn discover(nvml: &Nvml) -> Result<Discovered, NvmlSetupError> {
    let count = q(|| "device count".into(), nvml.device_count())? as usize;
    if count == 0 {
        return Err(NvmlSetupError::NoGpus);
    }
    let driver_version = q(|| "driver version".into(), nvml.sys_driver_version())?;
    let mut gpus = Vec::with_capacity(count);
    let mut names = Vec::with_capacity(count);
    let mut devices = Vec::with_capacity(count);
    for i in 0..count {
        let d = q(|| format!("GPU {i}"), nvml.device_by_index(i as u32))?;
        let uuid = q(|| format!("GPU {i} UUID"), d.uuid())?;
        let minor = q(|| format!("GPU {i} minor number"), d.minor_number())?;
        let mem = q(|| format!("GPU {i} memory"), d.memory_info())?.total;
        let bus = q(|| format!("GPU {i} PCI info"), d.pci_info())?.bus_id;
        // Not every platform reports NUMA: no TopologyInfo then.
        let numa = d.numa_node_id().ok();
        names.push(d.name().unwrap_or_else(|_| "NVIDIA GPU".into()));
        gpus.push(GpuInfo {
            index: i,
            uuid,
            minor,
            memory_bytes: mem,
            numa_node: numa,
            pci_bus_id: bus,
        });
        devices.push(d);
    }
    let by_bus: HashMap<String, usize> = gpus
        .iter()
        .map(|g| (bus_key(&g.pci_bus_id), g.index))
        .collect();
    let n = count;
    let mut pcie = vec![vec![PcieLevel::System; n]; n];
    let mut nvlink = vec![vec![0u32; n]; n];
    for a in 0..n {
        for b in a + 1..n {
            let other = q(|| format!("GPU {b}"), nvml.device_by_index(b as u32))?;
            let l = q(
                || format!("topology between GPU {a} and GPU {b}"),
                devices[a].topology_common_ancestor(other),
            )?;
            pcie[a][b] = level(l);
            pcie[b][a] = level(l);
        }
        // NVLink: every active link whose far end is another GPU of this node
        // (links to an NVSwitch or a CPU are not GPU pairs).
        for link in 0..NVLINK_MAX_LINKS {
            let w = devices[a].link_wrapper_for(link);
            match w.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                Err(_) => break, // NOT_SUPPORTED / no more links
            }
            if let Ok(pci) = w.remote_pci_info()
                && let Some(&b) = by_bus.get(&bus_key(&pci.bus_id))
                && b != a
            {
                nvlink[a][b] += 1;
            }
        }
    }
    // Each side counted its own links; keep them symmetric.
    for a in 0..n {
        for b in a + 1..n {
            let m = nvlink[a][b].max(nvlink[b][a]);
            nvlink[a][b] = m;
            nvlink[b][a] = m;
        }
    }
    let topology = Topology::new(gpus, pcie, nvlink)?;
    Ok(Discovered {
        topology,
        names,
        driver_version,
        mig: crate::mig::read(nvml, &devices)?,
    })
}

/// `550.54.15` -> (550, 54).
pub fn driver_major_minor(v: &str) -> (i32, i32) {
    let mut it = v.split('.').map(|s| s.parse::<i32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// One critical Xid on one GPU.
#[derive(Debug, Clone, Copy)]
pub struct XidEvent {
    pub gpu: usize,
    /// The MIG GPU instance the error is in, when NVML names one.
    pub gpu_instance: Option<u32>,
    pub xid: u64,
}

/// NVML's event without an instance (nvml.h: 0xFFFFFFFF).
const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// One event from `set`, GPU instance included: nvml-wrapper's
/// `EventSet::wait` drops it, so nvmlEventSetWait_v2 is called directly.
fn wait_event(
    nvml: &Nvml,
    set: &nvml_wrapper::EventSet<'_>,
    timeout_ms: u32,
) -> Result<(String, u64, Option<u32>), NvmlError> {
    let sym = nvml_wrapper::error::nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref())?;
    // SAFETY: zeroed is a valid event record (a pointer and integers).
    let mut data: nvml_wrapper_sys::bindings::nvmlEventData_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live event set of `nvml`; `data` is the record
    // the call fills.
    nvml_wrapper::error::nvml_try(unsafe { sym(set.handle(), &mut data, timeout_ms) })?;
    // SAFETY: the driver's handle of the device the event is on, valid
    // while `nvml` is.
    let device = unsafe { nvml_wrapper::Device::new(data.device, nvml) };
    let gi = (data.gpuInstanceId != NO_INSTANCE).then_some(data.gpuInstanceId);
    Ok((device.uuid()?, data.eventData, gi))
}

/// Watches Xid events on all GPUs in a thread (NVML's wait blocks) and sends
/// the critical ones. Ends when `stop` is set or the receiver is gone.
pub fn watch_xids(
    nvml: Arc<Nvml>,
    uuids: Vec<String>,
    ignored: Vec<u64>,
    tx: tokio::sync::mpsc::UnboundedSender<XidEvent>,
    stop: tokio_util::sync::CancellationToken,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("xid-watch".into())
        .spawn(move || {
            let mut set = match nvml.create_event_set() {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "NVML event set: GPU health is not watched");
                    return;
                }
            };
            for i in 0..uuids.len() {
                let Ok(d) = nvml.device_by_index(i as u32) else { continue };
                set = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::error!(gpu = i, error = %e.error, "registering Xid events: GPU health is not watched");
                        return;
                    }
                };
            }
            tracing::info!(gpus = uuids.len(), "watching Xid events");
            while !stop.is_cancelled() && !tx.is_closed() {
                match wait_event(&nvml, &set, 500) {
                    Ok((uuid, xid, gpu_instance)) => {
                        let Some(gpu) = uuids.iter().position(|u| *u == uuid) else { continue };
                        if ignored.contains(&xid) {
                            tracing::info!(gpu, xid, "Xid ignored (application error)");
                            continue;
                        }
                        tracing::warn!(gpu, xid, uuid, gpu_instance, "critical Xid");
                        let _ = tx.send(XidEvent { gpu, gpu_instance, xid });
                    }
                    Err(NvmlError::Timeout) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "waiting for NVML events");
                        std::thread::sleep(Duration::from_millis(500));
                    }
                }
            }
        })
        .expect("spawning the Xid thread")
}

/// What NVML says each process holds on a GPU, for the registry's reclaims
/// ([`crate::registry::MemoryWitness`]): a process's contexts summed; a
/// GPU or count NVML cannot give is `None` (the ledgers decide alone).
pub fn memory_witness(nvml: Arc<Nvml>) -> crate::registry::MemoryWitness {
    use nvml_wrapper::enums::device::UsedGpuMemory;
    Arc::new(move |uuid: &str| {
        let procs = nvml
            .device_by_uuid(uuid)
            .ok()?
            .running_compute_processes()
            .ok()?;
        let mut held: HashMap<i32, u64> = HashMap::new();
        for p in procs {
            if let UsedGpuMemory::Used(b) = p.used_gpu_memory {
                *held.entry(p.pid as i32).or_default() += b;
            }
        }
        Some(held)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_and_versions() {
        assert_eq!(bus_key("00000000:3B:00.0"), bus_key("0000:3b:00.0"));
        assert_eq!(driver_major_minor("550.54.15"), (550, 54));
        assert_eq!(driver_major_minor("bogus"), (0, 0));
    }
}
