//! MIG devices: the `nvmlDevice_t` of each compute instance (by index under
//! its GPU, in GPU-instance then compute-instance id order), its parent,
//! ids and attributes. Name, UUID and memory of a MIG device are answered
//! by the whole-GPU calls (`device.rs`, `memory.rs`) through
//! `with_dev_or_mig`.

use crate::mig_handles::*;
use crate::*;
use std::ffi::c_uint;

#[repr(C)]
pub struct nvmlDeviceAttributes_t {
    multiprocessorCount: c_uint,
    sharedCopyEngineCount: c_uint,
    sharedDecoderCount: c_uint,
    sharedEncoderCount: c_uint,
    sharedJpegCount: c_uint,
    sharedOfaCount: c_uint,
    gpuInstanceSliceCount: c_uint,
    computeInstanceSliceCount: c_uint,
    memorySizeMB: u64,
}

const _: () = assert!(std::mem::size_of::<nvmlDeviceAttributes_t>() == 40);

/// Most MIG devices under a GPU: 0 unless MIG is enabled.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let n = match (c.gpu(s).mig_model(), c.state.mig_mode(s)) {
            (Some(m), Ok((true, _))) => m.max_instances(),
            _ => 0,
        };
        put(count, n)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    migDevice: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let model = c.gpu(s).mig_model().ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        if !c.state.mig_mode(s).is_ok_and(|(cur, _)| cur) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        if index >= model.max_instances() || migDevice.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let devs = c.state.mig_devices(s);
        let (g, ci) = devs.get(index as usize).ok_or(NVML_ERROR_NOT_FOUND)?;
        put(migDevice, mig_handle(s, g.id, ci.id))
    })
}

/// Runs `f` on a MIG device handle; a whole-GPU handle is `other`.
fn with_mig(device: nvmlDevice_t, other: nvmlReturn_t, f: impl FnOnce(Mig) -> R) -> nvmlReturn_t {
    with_dev_or_mig(device, |_, _| Err(other), |_, m| f(m))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    migDevice: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_mig(migDevice, NVML_ERROR_INVALID_ARGUMENT, |(sim, _, _)| {
        put(device, handle_of(sim))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    isMigDevice: *mut c_uint,
) -> nvmlReturn_t {
    with_dev_or_mig(
        device,
        |_, _| put(isMigDevice, 0),
        |_, _| put(isMigDevice, 1),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_mig(device, NVML_ERROR_NOT_SUPPORTED, |(_, g, _)| put(id, g.id))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_mig(device, NVML_ERROR_NOT_SUPPORTED, |(_, _, ci)| {
        put(id, ci.id)
    })
}

fn attributes((_, g, ci): Mig) -> nvmlDeviceAttributes_t {
    let p = g.profile;
    nvmlDeviceAttributes_t {
        multiprocessorCount: ci.profile.sms(),
        sharedCopyEngineCount: p.copy_engines,
        sharedDecoderCount: p.decoders,
        sharedEncoderCount: p.encoders,
        sharedJpegCount: p.jpegs,
        sharedOfaCount: p.ofas,
        gpuInstanceSliceCount: p.slices,
        computeInstanceSliceCount: ci.profile.slices,
        memorySizeMB: p.memory_mib,
    }
}

/// MIG device handles only, as nvml.h says; a whole GPU is NOT_SUPPORTED.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes_: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    with_mig(device, NVML_ERROR_NOT_SUPPORTED, |m| {
        put(attributes_, attributes(m))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes(
    device: nvmlDevice_t,
    attributes_: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    with_mig(device, NVML_ERROR_NOT_SUPPORTED, |m| {
        put(attributes_, attributes(m))
    })
}

/// A MIG device's name: the GPU's, then "MIG" and the profile.
pub fn name((sim, _, ci): Mig, c: &Ctx) -> String {
    format!("{} MIG {}", c.gpu(sim).name, ci.profile.device_name())
}

/// A MIG device's memory: its GPU instance's (MiB as the profile says).
pub fn memory_bytes((_, g, _): Mig) -> u64 {
    g.profile.memory_mib << 20
}

/// The MIG device handle of a "MIG-…" UUID (as `nvmlDeviceGetHandleByUUID`
/// takes them), among the visible GPUs' MIG devices.
pub fn by_uuid(c: &Ctx, want: &str) -> Result<nvmlDevice_t, nvmlReturn_t> {
    for &sim in &c.visible {
        for (g, ci) in c.state.mig_devices(sim) {
            if mig_uuid(&c.gpu(sim).uuid, g.id, ci.id).eq_ignore_ascii_case(want) {
                return Ok(mig_handle(sim, g.id, ci.id));
            }
        }
    }
    Err(NVML_ERROR_NOT_FOUND)
}
