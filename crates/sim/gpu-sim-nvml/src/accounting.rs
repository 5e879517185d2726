//! Per-process queries beyond the running-process lists: the versioned
//! utilization and detail lists (`nvmlDeviceGetProcessesUtilizationInfo`,
//! `nvmlDeviceGetRunningProcessDetailList`) and accounting (mode on, running
//! processes only). Like the real driver they list every tenant of the GPU:
//! what an interposer must filter.

use crate::procs::{NO_INSTANCE, samples};
use crate::*;
use gpu_sim_core::state::now_ns;
use std::ffi::{c_uint, c_ulonglong};

/// `nvmlProcessUtilizationInfo_v1_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessUtilizationInfo_v1_t {
    timeStamp: c_ulonglong,
    pid: c_uint,
    smUtil: c_uint,
    memUtil: c_uint,
    encUtil: c_uint,
    decUtil: c_uint,
    jpgUtil: c_uint,
    ofaUtil: c_uint,
}

/// `nvmlProcessesUtilizationInfo_v1_t`.
#[repr(C)]
pub struct nvmlProcessesUtilizationInfo_t {
    version: c_uint,
    processSamplesCount: c_uint,
    lastSeenTimeStamp: c_ulonglong,
    procUtilArray: *mut nvmlProcessUtilizationInfo_v1_t,
}

/// `nvmlProcessDetail_v1_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessDetail_v1_t {
    pid: c_uint,
    usedGpuMemory: c_ulonglong,
    gpuInstanceId: c_uint,
    computeInstanceId: c_uint,
    usedGpuCcProtectedMemory: c_ulonglong,
}

/// `nvmlProcessDetailList_v1_t`.
#[repr(C)]
pub struct nvmlProcessDetailList_t {
    version: c_uint,
    mode: c_uint,
    numProcArrayEntries: c_uint,
    procArray: *mut nvmlProcessDetail_v1_t,
}

/// `nvmlAccountingStats_t`.
#[repr(C)]
pub struct nvmlAccountingStats_t {
    gpuUtilization: c_uint,
    memoryUtilization: c_uint,
    maxMemoryUsage: c_ulonglong,
    time: c_ulonglong,
    startTime: c_ulonglong,
    isRunning: c_uint,
    reserved: [c_uint; 5],
}

const _: () = assert!(std::mem::size_of::<nvmlProcessUtilizationInfo_v1_t>() == 40);
const _: () = assert!(std::mem::size_of::<nvmlProcessesUtilizationInfo_t>() == 24);
const _: () = assert!(std::mem::size_of::<nvmlProcessDetail_v1_t>() == 32);
const _: () = assert!(std::mem::size_of::<nvmlProcessDetailList_t>() == 24);
const _: () = assert!(std::mem::size_of::<nvmlAccountingStats_t>() == 56);

/// `NVML_STRUCT_VERSION(data, 1)`: size | 1 << 24.
const fn v1<T>() -> c_uint {
    std::mem::size_of::<T>() as c_uint | (1 << 24)
}
pub const PROCESSES_UTILIZATION_INFO_V1: c_uint = v1::<nvmlProcessesUtilizationInfo_t>();
pub const PROCESS_DETAIL_LIST_V1: c_uint = v1::<nvmlProcessDetailList_t>();

const NVML_FEATURE_ENABLED: c_uint = 1;
/// Entries the driver's accounting buffer holds.
const ACCOUNTING_BUFFER: c_uint = 4000;

/// Copies `items` into the caller's array of `*count` entries, NVML's way:
/// a null array or too small a count gives INSUFFICIENT_SIZE with the count
/// needed.
fn fill_counted<T>(count: &mut c_uint, array: *mut T, items: Vec<T>) -> R {
    let cap = if array.is_null() { 0 } else { *count as usize };
    *count = items.len() as c_uint;
    if items.len() > cap {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (i, it) in items.into_iter().enumerate() {
        // SAFETY: the caller's array holds `cap` >= len entries.
        unsafe { array.add(i).write_unaligned(it) };
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessesUtilizationInfo(
    device: nvmlDevice_t,
    info: *mut nvmlProcessesUtilizationInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        // SAFETY: the caller passes the struct or NULL.
        let info = unsafe { info.as_mut() }.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        if info.version != PROCESSES_UTILIZATION_INFO_V1 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let list: Vec<_> = samples(&c, sim, info.lastSeenTimeStamp)
            .into_iter()
            .map(|s| nvmlProcessUtilizationInfo_v1_t {
                timeStamp: s.timeStamp,
                pid: s.pid,
                smUtil: s.smUtil,
                memUtil: s.memUtil,
                encUtil: 0,
                decUtil: 0,
                jpgUtil: 0,
                ofaUtil: 0,
            })
            .collect();
        if list.is_empty() {
            info.processSamplesCount = 0;
            return Err(NVML_ERROR_NOT_FOUND);
        }
        fill_counted(&mut info.processSamplesCount, info.procUtilArray, list)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRunningProcessDetailList(
    device: nvmlDevice_t,
    list: *mut nvmlProcessDetailList_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        // SAFETY: the caller passes the struct or NULL.
        let list = unsafe { list.as_mut() }.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        if list.version != PROCESS_DETAIL_LIST_V1 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let items = match list.mode {
            // Compute; graphics and MPS clients do not exist on the sim.
            0 => c
                .state
                .listed_processes(sim)
                .into_iter()
                .map(|p| nvmlProcessDetail_v1_t {
                    pid: p.pid(),
                    usedGpuMemory: p.used_bytes,
                    gpuInstanceId: NO_INSTANCE,
                    computeInstanceId: NO_INSTANCE,
                    usedGpuCcProtectedMemory: 0,
                })
                .collect(),
            1 | 2 => Vec::new(),
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        fill_counted(&mut list.numProcArrayEntries, list.procArray, items)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        ctx()?.dev(device)?;
        put(mode, NVML_FEATURE_ENABLED)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingBufferSize(
    device: nvmlDevice_t,
    size: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        ctx()?.dev(device)?;
        put(size, ACCOUNTING_BUFFER)
    })
}

/// Running processes only (the sim keeps no record of finished ones).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingPids(
    device: nvmlDevice_t,
    count: *mut c_uint,
    pids: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        // SAFETY: the caller passes a count or NULL.
        let count = unsafe { count.as_mut() }.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let items = c
            .state
            .listed_processes(sim)
            .iter()
            .map(|p| p.pid())
            .collect();
        fill_counted(count, pids, items)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingStats(
    device: nvmlDevice_t,
    pid: c_uint,
    stats: *mut nvmlAccountingStats_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        if stats.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let now = now_ns();
        let util = c
            .state
            .process_utilization(sim, now.saturating_sub(1_000_000_000), now);
        let (p, pct) = util
            .into_iter()
            .find(|(p, _)| p.pid() == pid)
            .or_else(|| {
                c.state
                    .processes(sim)
                    .into_iter()
                    .find(|p| p.pid() == pid)
                    .map(|p| (p, 0.0))
            })
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        put(
            stats,
            nvmlAccountingStats_t {
                gpuUtilization: pct.round() as c_uint,
                memoryUtilization: (pct / 2.0).round() as c_uint,
                maxMemoryUsage: p.used_bytes,
                time: 0,
                startTime: 0,
                isRunning: 1,
                reserved: [0; 5],
            },
        )
    })
}

/// nvidia-smi asks for private tables by UUID; the sim has none, and a real
/// driver answers an unknown table id the same way.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInternalGetExportTable(
    table: *mut *const std::ffi::c_void,
    id: *const u8,
) -> nvmlReturn_t {
    ffi(|| {
        if table.is_null() || id.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put(table, std::ptr::null())?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    })
}
