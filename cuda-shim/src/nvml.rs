//! The container's NVML view: memory info shows the quota as the card's
//! total and the container's use (from the ledger) as used; process lists
//! show only the container's own processes (host PIDs from the manager's
//! `pids.config`, plus this process). Everything else is forwarded.

use crate::config;
use crate::real::real_nvml;
use crate::registration::{container_pids, proc};
use std::ffi::{c_char, c_void};

pub const NVML_SUCCESS: i32 = 0;
pub const NVML_ERROR_INVALID_ARGUMENT: i32 = 2;
pub const NVML_ERROR_INSUFFICIENT_SIZE: i32 = 7;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: i32 = 13;
pub const NVML_ERROR_UNKNOWN: i32 = 999;

type Device = *mut c_void;

/// `nvmlMemory_t`.
#[repr(C)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct MemoryV2 {
    pub version: u32,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// (total, used) for the container, from the real (total, used).
fn virtual_memory(real_total: u64, real_used: u64) -> Option<(u64, u64)> {
    let enf = config::enforce()?;
    let p = proc();
    let _ = p.ensure_registered();
    let g = p.attach();
    Some(match g.as_ref() {
        Some(a) => {
            let total = a.ledger.quota().min(real_total);
            (total, a.ledger.used().min(total))
        }
        // Not registered (manager down): the card's use, capped, is an
        // over-estimate of ours, never an under-estimate.
        None => {
            let total = enf.data.gpu_memory.min(real_total);
            (total, real_used.min(total))
        }
    })
}

type ProcList = unsafe extern "C" fn(Device, *mut u32, *mut c_void) -> i32;

/// Runs a process-list query into our own buffer and returns only the
/// container's processes, honouring NVML's two-call size protocol.
/// `stride`: size of one entry (`pid` is its first `u32`).
unsafe fn filtered(
    f: ProcList,
    dev: Device,
    count: *mut u32,
    infos: *mut c_void,
    stride: usize,
) -> i32 {
    if count.is_null() {
        return unsafe { f(dev, count, infos) };
    }
    if config::enforce().is_none() {
        return unsafe { f(dev, count, infos) };
    }
    let mut n: u32 = 0;
    let r = unsafe { f(dev, &mut n, std::ptr::null_mut()) };
    let mut buf: Vec<u8> = Vec::new();
    let mut got = 0u32;
    match r {
        NVML_SUCCESS => {}
        NVML_ERROR_INSUFFICIENT_SIZE => {
            // Processes may start between the calls: retry a few times.
            let mut ok = false;
            for _ in 0..4 {
                let cap = n + 8;
                buf = vec![0u8; cap as usize * stride];
                let mut m = cap;
                match unsafe { f(dev, &mut m, buf.as_mut_ptr().cast()) } {
                    NVML_SUCCESS => {
                        got = m;
                        ok = true;
                        break;
                    }
                    NVML_ERROR_INSUFFICIENT_SIZE => n = m,
                    e => return e,
                }
            }
            if !ok {
                return NVML_ERROR_INSUFFICIENT_SIZE;
            }
        }
        e => return e,
    }
    let pids = container_pids();
    let mine: Vec<&[u8]> = buf
        .chunks_exact(stride)
        .take(got as usize)
        .filter(|e| pids.contains(&i32::from_ne_bytes(e[..4].try_into().unwrap())))
        .collect();
    let cap = unsafe { *count } as usize;
    unsafe { *count = mine.len() as u32 };
    if mine.is_empty() {
        return NVML_SUCCESS;
    }
    if cap < mine.len() || infos.is_null() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (i, e) in mine.iter().enumerate() {
        unsafe {
            std::ptr::copy_nonoverlapping(e.as_ptr(), (infos as *mut u8).add(i * stride), stride)
        };
    }
    NVML_SUCCESS
}

/// `nvmlProcessInfo_v1_t` is 16 bytes; `_v2_t` (used by _v2 and _v3) 24.
const INFO_V1: usize = 16;
const INFO_V2: usize = 24;

nvml_exports! {
    fn nvmlDeviceGetMemoryInfo(dev: Device, mem: *mut Memory) {
        let f = real_nvml!(nvmlDeviceGetMemoryInfo: unsafe extern "C" fn(Device, *mut Memory) -> i32);
        let r = f(dev, mem);
        if r == NVML_SUCCESS && let Some(m) = mem.as_mut()
            && let Some((total, used)) = virtual_memory(m.total, m.used)
        {
            m.total = total;
            m.used = used;
            m.free = total - used;
        }
        r
    }

    fn nvmlDeviceGetMemoryInfo_v2(dev: Device, mem: *mut MemoryV2) {
        let f = real_nvml!(nvmlDeviceGetMemoryInfo_v2: unsafe extern "C" fn(Device, *mut MemoryV2) -> i32);
        let r = f(dev, mem);
        if r == NVML_SUCCESS && let Some(m) = mem.as_mut()
            && let Some((total, used)) = virtual_memory(m.total, m.used.saturating_add(m.reserved))
        {
            // The driver's reservation is the card's business, not ours.
            m.total = total;
            m.reserved = 0;
            m.used = used;
            m.free = total - used;
        }
        r
    }

    fn nvmlDeviceGetComputeRunningProcesses(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetComputeRunningProcesses: ProcList);
        filtered(f, dev, count, infos, INFO_V1)
    }

    fn nvmlDeviceGetComputeRunningProcesses_v2(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetComputeRunningProcesses_v2: ProcList);
        filtered(f, dev, count, infos, INFO_V2)
    }

    fn nvmlDeviceGetComputeRunningProcesses_v3(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetComputeRunningProcesses_v3: ProcList);
        filtered(f, dev, count, infos, INFO_V2)
    }

    fn nvmlDeviceGetGraphicsRunningProcesses(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetGraphicsRunningProcesses: ProcList);
        filtered(f, dev, count, infos, INFO_V1)
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v2(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetGraphicsRunningProcesses_v2: ProcList);
        filtered(f, dev, count, infos, INFO_V2)
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v3(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetGraphicsRunningProcesses_v3: ProcList);
        filtered(f, dev, count, infos, INFO_V2)
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetMPSComputeRunningProcesses: ProcList);
        filtered(f, dev, count, infos, INFO_V1)
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetMPSComputeRunningProcesses_v2: ProcList);
        filtered(f, dev, count, infos, INFO_V2)
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetMPSComputeRunningProcesses_v3: ProcList);
        filtered(f, dev, count, infos, INFO_V2)
    }
}

/// Returns a pointer, not a status, so a forwarding stub could not answer
/// safely when the real library is missing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: i32) -> *const c_char {
    std::panic::catch_unwind(|| {
        let sym = crate::real::sym(crate::real::Lib::Nvml, c"nvmlErrorString");
        if sym != 0 {
            let f: unsafe extern "C" fn(i32) -> *const c_char = unsafe { std::mem::transmute(sym) };
            unsafe { f(result) }
        } else {
            c"Unknown Error (the real NVML library is not loadable)".as_ptr()
        }
    })
    .unwrap_or(c"Unknown Error".as_ptr())
}
