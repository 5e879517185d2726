//! `--mig-dynamic` at the driver's start (issue 36): each GPU named is put
//! in MIG mode (when idle, as `--mig-geometry` does) and read for what it
//! offers ([`DynamicGpu`]): its profiles and the instances no prepared
//! claim made, which its placements must keep clear of.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use node_agent::geometry::{MigDriver, UnknownGpu};
use node_agent::nvml::Discovered;
use nvml_wrapper::error::NvmlError;

use crate::dynamic::DynamicGpu;

/// The indices of the GPUs `named` (index or UUID) among `uuids`.
pub fn resolve(named: &[String], uuids: &[String]) -> Result<BTreeSet<usize>, UnknownGpu> {
    node_agent::geometry::resolve_gpus("mig-dynamic", named, uuids)
}

/// GPU `gpu` in MIG mode and what it offers; `None` while the mode
/// waits for a GPU reset. `held`: the MIG UUIDs of prepared claims.
pub fn offer(
    driver: &dyn MigDriver,
    gpu: usize,
    held: &BTreeSet<String>,
) -> Result<Option<DynamicGpu>, NvmlError> {
    if !node_agent::geometry::ensure_mig_mode(driver, gpu)? {
        return Ok(None);
    }
    let foreign = driver
        .instances(gpu)?
        .into_iter()
        .filter(|i| !i.uuids.iter().any(|u| held.contains(u)))
        .map(|i| i.slices)
        .collect();
    Ok(Some(DynamicGpu {
        profiles: driver.profiles(gpu)?,
        foreign,
        ..DynamicGpu::default()
    }))
}

/// Every dynamic GPU of `named` that is in MIG mode, by index; a GPU
/// whose mode waits for a reset, or that NVML fails on, is logged and
/// left out (served as it is).
pub fn start(
    nvml: &Arc<nvml_wrapper::Nvml>,
    found: &Discovered,
    named: &[String],
    held: &BTreeSet<String>,
) -> anyhow::Result<BTreeMap<usize, DynamicGpu>> {
    let uuids: Vec<String> = found
        .topology
        .gpus()
        .iter()
        .map(|g| g.uuid.clone())
        .collect();
    let gpus = resolve(named, &uuids)?;
    let devices = (0..uuids.len() as u32)
        .map(|i| nvml.device_by_index(i))
        .collect::<Result<Vec<_>, _>>()?;
    let driver = node_agent::mig_nvml::NvmlMig {
        nvml,
        devices: &devices,
    };
    let mut out = BTreeMap::new();
    for gpu in gpus {
        match offer(&driver, gpu, held) {
            Ok(Some(mut d)) => {
                (d.memory_bytes, d.multiprocessors) = sizes(nvml, &devices[gpu]);
                tracing::info!(gpu, profiles = d.profiles.len(), "dynamic MIG");
                out.insert(gpu, d);
            }
            Ok(None) => tracing::warn!(
                gpu,
                "MIG mode enabled, pending a GPU reset: dynamic MIG from the next start after it"
            ),
            Err(e) => tracing::error!(gpu, error = %e, "dynamic MIG not available on this GPU"),
        }
    }
    Ok(out)
}

/// Memory and multiprocessors of each GPU-instance profile of `d`, by
/// profile id (NVML's profile info; node-agent's profile list carries
/// neither); empty where NVML cannot say.
fn sizes(
    nvml: &nvml_wrapper::Nvml,
    d: &nvml_wrapper::Device,
) -> (BTreeMap<u32, u64>, BTreeMap<u32, u32>) {
    use nvml_wrapper::error::{nvml_sym, nvml_try};
    let (mut memory, mut sms) = (BTreeMap::new(), BTreeMap::new());
    let Ok(sym) = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()) else {
        return (memory, sms);
    };
    // Indices past nvml.h's NVML_GPU_INSTANCE_PROFILE_COUNT are refused
    // as invalid, profiles a GPU lacks as not supported: both skipped.
    for index in 0..32 {
        // SAFETY: the symbol's out-struct (nvmlGpuInstanceProfileInfo_v2_t)
        // is integers and a char array, valid zeroed.
        let mut info = unsafe { zeroed_out(sym) };
        // nvml.h's NVML_STRUCT_VERSION: the size, the version in the top byte.
        info.version = std::mem::size_of_val(&info) as u32 | (2 << 24);
        // SAFETY: `d` is a live handle; `info` the versioned struct.
        if nvml_try(unsafe { sym(d.handle(), index, &mut info) }).is_ok() {
            memory.insert(info.id, info.memorySizeMB << 20);
            sms.insert(info.id, info.multiprocessorCount);
        }
    }
    (memory, sms)
}

/// A zeroed value of the out-parameter type of `f` (whose crate,
/// nvml-wrapper-sys, this one does not name).
///
/// # Safety
/// All-zero bytes must be a valid `T`.
unsafe fn zeroed_out<H, T, R>(_f: &unsafe extern "C" fn(H, u32, *mut T) -> R) -> T {
    // SAFETY: the caller's.
    unsafe { std::mem::zeroed() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_by_index_or_uuid() {
        let uuids = ["GPU-a".to_string(), "GPU-b".to_string()];
        let named = ["GPU-b".to_string(), "0".to_string()];
        assert_eq!(resolve(&named, &uuids).unwrap(), BTreeSet::from([0, 1]));
        let e = resolve(&["2".to_string()], &uuids).unwrap_err().to_string();
        assert!(e.contains("--mig-dynamic \"2\""), "{e}");
    }
}
