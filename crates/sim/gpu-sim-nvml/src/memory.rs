//! Memory (framebuffer, BAR1) and utilization (compute, encoder, decoder).

use crate::*;
use std::ffi::c_uint;

/// (total, used) of a whole GPU or a MIG device. A MIG device's memory is
/// its GPU instance's; what its processes use is not tracked per instance
/// (the CUDA side does not place processes in instances): used is 0.
fn totals(device: nvmlDevice_t, f: impl FnOnce(u64, u64) -> R) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let (total, used) = match c.mig_dev(device) {
            Some(m) => {
                let (sim, g, ci) = m?;
                let total = crate::mig_device::memory_bytes((sim, g, ci));
                // What the processes using its GPU instance hold.
                (total, c.state.gi_memory_used(sim, g.id).min(total))
            }
            None => {
                let s = c.dev(device)?;
                let total = c.state.memory_total(s);
                (total, c.state.memory_used(s).min(total))
            }
        };
        f(total, used)
    })
}

/// nvmlMemory_v2 = NVML_STRUCT_VERSION(Memory, 2).
const NVML_MEMORY_V2: c_uint = 40 | (2 << 24);

#[repr(C)]
pub struct nvmlMemory_t {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct nvmlMemory_v2_t {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct nvmlBAR1Memory_t {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct nvmlUtilization_t {
    gpu: c_uint,
    memory: c_uint,
}

const _: () = assert!(std::mem::size_of::<nvmlMemory_v2_t>() == 40);
const _: () = assert!(std::mem::offset_of!(nvmlMemory_v2_t, version) == 0);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    totals(device, |total, used| {
        put(
            memory,
            nvmlMemory_t {
                total,
                free: total - used,
                used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    totals(device, |total, used| {
        check_version(memory, NVML_MEMORY_V2)?;
        put(
            memory,
            nvmlMemory_v2_t {
                version: NVML_MEMORY_V2,
                total,
                // No driver reservation: used is exactly what processes hold.
                reserved: 0,
                free: total - used,
                used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBAR1MemoryInfo(
    device: nvmlDevice_t,
    bar1: *mut nvmlBAR1Memory_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let total = c.state.memory_total(s).next_power_of_two();
        let used = 2 << 20;
        put(
            bar1,
            nvmlBAR1Memory_t {
                total,
                free: total - used,
                used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    util: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        // nvml.h: "On MIG-enabled GPUs, querying device utilization rates
        // is not currently supported" (nvidia-smi shows N/A).
        if c.state.mig_mode(s).is_ok_and(|(current, _)| current) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let gpu = recent_util(c, s);
        // No memory-traffic model: report it proportional to compute.
        put(
            util,
            nvmlUtilization_t {
                gpu,
                memory: gpu / 2,
            },
        )
    })
}

/// No video engine model: the encoder and the decoder are always idle.
fn codec_utilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| {
        put(util, 0)?;
        put(period_us, 167_000)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderUtilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    codec_utilization(device, util, period_us)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDecoderUtilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    codec_utilization(device, util, period_us)
}
