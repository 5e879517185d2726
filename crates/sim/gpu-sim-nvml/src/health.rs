//! Temperature, power, fan, persistence/compute/display modes, performance
//! state, ECC, clocks, NUMA node and CPU affinity.

use crate::info;
use crate::*;
use std::ffi::{c_uint, c_ulong, c_ulonglong};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: c_uint,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if sensor != 0 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put(temp, 32 + recent_util(c, s) * 2 / 5)
    })
}

fn power_mw(c: &Ctx, s: usize) -> u32 {
    let limit = limit_mw(c, s);
    let idle = limit / 7;
    idle + (limit - idle) * recent_util(c, s) / 100
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mw, power_mw(c, s)))
}

fn limit_mw(c: &Ctx, s: usize) -> u32 {
    c.gpu(s).power_limit_w * 1000
}

/// The enforced, the set and the default limit: one fixed board limit.
fn power_limit(device: nvmlDevice_t, mw: *mut c_uint) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mw, limit_mw(c, s)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    power_limit(device, mw)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementLimit(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    power_limit(device, mw)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementDefaultLimit(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    power_limit(device, mw)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementLimitConstraints(
    device: nvmlDevice_t,
    min_mw: *mut c_uint,
    max_mw: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let limit = limit_mw(c, s);
        put(min_mw, limit / 4)?;
        put(max_mw, limit)
    })
}

/// Data-centre boards have no fan (the real call fails the same way).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFanSpeed(
    device: nvmlDevice_t,
    speed: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if !info::is_consumer(c.gpu(s)) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        put(speed, 30 + recent_util(c, s) / 3)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(mode, NVML_FEATURE_ENABLED))
}

/// NVML_COMPUTEMODE_DEFAULT: vcuda shares devices between processes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(mode, 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDisplayMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(mode, NVML_FEATURE_DISABLED))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDisplayActive(
    device: nvmlDevice_t,
    active: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(active, NVML_FEATURE_DISABLED))
}

/// P0 while kernels ran in the last second, P8 when idle.
fn pstate(device: nvmlDevice_t, state: *mut c_uint) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        put(state, if recent_util(c, s) > 0 { 0 } else { 8 })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPerformanceState(
    device: nvmlDevice_t,
    state: *mut c_uint,
) -> nvmlReturn_t {
    pstate(device, state)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerState(
    device: nvmlDevice_t,
    state: *mut c_uint,
) -> nvmlReturn_t {
    pstate(device, state)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if info::is_consumer(c.gpu(s)) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        put(current, NVML_FEATURE_ENABLED)?;
        put(pending, NVML_FEATURE_ENABLED)
    })
}

/// No ECC error model: counters stay at zero where ECC exists.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    _error_type: c_uint,
    _counter_type: c_uint,
    count: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if info::is_consumer(c.gpu(s)) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        put(count, 0)
    })
}

fn clock(c: &Ctx, s: usize, kind: c_uint, current: bool) -> Result<c_uint, nvmlReturn_t> {
    let (gfx, mem, video) = info::max_clocks(c.gpu(s));
    let busy = !current || recent_util(c, s) > 0;
    Ok(match kind {
        0 | 1 if busy => gfx,
        0 | 1 => 210,
        2 => mem,
        3 if busy => video,
        3 => 795,
        _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    kind: c_uint,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mhz, clock(c, s, kind, true)?))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxClockInfo(
    device: nvmlDevice_t,
    kind: c_uint,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mhz, clock(c, s, kind, false)?))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(
    device: nvmlDevice_t,
    node: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        put(node, c.gpu(s).numa_node.max(0) as c_uint)
    })
}

/// CPUs of the GPU's NUMA node where the host has that node, else all
/// online CPUs.
fn affinity_cpus(numa: i32) -> Vec<usize> {
    let parse = |list: &str| -> Vec<usize> {
        list.trim()
            .split(',')
            .filter(|p| !p.is_empty())
            .flat_map(|p| match p.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (a.parse().unwrap_or(0), b.parse().unwrap_or(0));
                    (a..=b).collect::<Vec<usize>>()
                }
                None => p.parse().into_iter().collect(),
            })
            .collect()
    };
    std::fs::read_to_string(format!("/sys/devices/system/node/node{numa}/cpulist"))
        .or_else(|_| std::fs::read_to_string("/sys/devices/system/cpu/online"))
        .map(|s| parse(&s))
        .unwrap_or_else(|_| (0..1).collect())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinity(
    device: nvmlDevice_t,
    set_size: c_uint,
    set: *mut c_ulong,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if set.is_null() || set_size == 0 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let bits = c_ulong::BITS as usize;
        for w in 0..set_size as usize {
            // SAFETY: the caller's array holds set_size words.
            unsafe { *set.add(w) = 0 };
        }
        for cpu in affinity_cpus(c.gpu(s).numa_node) {
            if cpu / bits < set_size as usize {
                // SAFETY: index checked against set_size.
                unsafe { *set.add(cpu / bits) |= 1 << (cpu % bits) };
            }
        }
        Ok(())
    })
}
