//! The container's NVML view: memory info shows the quota as the card's
//! total and the container's use (from the ledger) as used; process lists
//! and every other per-process query ([`tenants`]) show only the
//! container's own processes (host PIDs from the manager's `pids.config`,
//! plus this process). Everything else is forwarded.
//!
//! NVML never registers with the manager: NVML-only tools (nvidia-smi,
//! pynvml, gpustat) take no ledger slot and never wait for the manager.

pub mod tenants;

use crate::arg_mut;
use crate::config::{self, Mode};
use crate::real::real_nvml;
use crate::registration::{container_pids, proc};
use std::ffi::{c_char, c_void};

pub const NVML_SUCCESS: i32 = 0;
pub const NVML_ERROR_INVALID_ARGUMENT: i32 = 2;
pub const NVML_ERROR_NOT_FOUND: i32 = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: i32 = 7;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: i32 = 13;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: i32 = 25;
pub const NVML_ERROR_UNKNOWN: i32 = 999;

/// Whether per-process answers are cut to the container's processes: always
/// but in pass-through. Without a usable config (fail-closed mode) the
/// container's PIDs are unknown, so nothing of anyone is shown.
pub fn filtering() -> bool {
    !matches!(config::mode(), Mode::PassThrough)
}

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

/// The GPU of the share NVML's `dev` is (its ledger's position), by bus
/// id or UUID; always the first in a one-GPU container (which sees only
/// its GPU). `None`: not one of the share's GPUs.
fn position(enf: &config::Enforce, dev: Device) -> Option<usize> {
    if enf.gpus.len() == 1 {
        return Some(0);
    }
    fn uuid_of(dev: Device, buf: &mut [c_char; 96]) -> i32 {
        let f =
            real_nvml!(nvmlDeviceGetUUID: unsafe extern "C" fn(Device, *mut c_char, u32) -> i32);
        // SAFETY: the real NVML function of this signature, resolved by name; `buf` is our
        // caller's local, one byte longer than the length passed; `dev` is passed on as is.
        unsafe { f(dev, buf.as_mut_ptr(), buf.len() as u32 - 1) }
    }
    fn pci_of(dev: Device, buf: &mut [u8; 128]) -> i32 {
        let f = real_nvml!(nvmlDeviceGetPciInfo_v3: unsafe extern "C" fn(Device, *mut u8) -> i32);
        // SAFETY: the real NVML function, resolved by name; `buf` is our caller's local,
        // larger than the nvmlPciInfo_t it writes; `dev` is passed on as is.
        unsafe { f(dev, buf.as_mut_ptr()) }
    }
    let mut uuid = [0 as c_char; 96];
    let uuid = if uuid_of(dev, &mut uuid) == NVML_SUCCESS {
        // SAFETY: NVML wrote a NUL-terminated string; the last byte of the zeroed buffer was
        // never handed out, so a terminator lies within it.
        unsafe { std::ffi::CStr::from_ptr(uuid.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        String::new()
    };
    // nvmlPciInfo_t: busIdLegacy[16], five u32, busId[32] (68 bytes); room to spare.
    let mut pci = [0u8; 128];
    let bus = if pci_of(dev, &mut pci) == NVML_SUCCESS {
        let id = &pci[36..68];
        let end = id.iter().position(|&b| b == 0).unwrap_or(id.len());
        String::from_utf8_lossy(&id[..end]).into_owned()
    } else {
        String::new()
    };
    crate::devices::record_of(&enf.gpus, &bus, &uuid)
}

/// (total, used) for the container on NVML's `dev`, from its real (total,
/// used). Never registers: a process that registered for CUDA reads its
/// mapped ledger of that GPU; any other (an NVML-only tool) reads the
/// GPU's ledger read-only (`Ledger::peek` of the memfd a registered
/// process holds, [`crate::registration::ledger_for_tools`]: root in the
/// container, or the processes' owner, can), else sums what the driver
/// says the container's processes hold. A GPU outside the share is shown
/// as it is.
fn virtual_memory(dev: Device, real_total: u64, real_used: u64) -> Option<(u64, u64)> {
    let enf = config::enforce()?;
    let gpu = position(enf, dev)?;
    crate::mem::measure_if_stale();
    if let Some(a) = proc().attach().as_ref() {
        let h = a.gpu(gpu);
        let total = h.quota.min(real_total);
        return Some((total, h.ledger.used().min(total)));
    }
    if let Ok((_, used)) =
        container_ledger::Ledger::peek(&crate::registration::ledger_for_tools(enf, gpu))
    {
        // The quota file's quota, not the ledger's word (any process of
        // the container can write that).
        let total = enf.gpus[gpu].gpu_memory.min(real_total);
        return Some((total, used.min(total)));
    }
    let total = enf.gpus[gpu].gpu_memory.min(real_total);
    // Without the ledger: the driver's per-process use of the container's
    // PIDs; failing that, the card's use, capped (an over-estimate, never
    // an under-estimate).
    // SAFETY: `dev` is the caller's handle, passed on to the real NVML as is.
    let used = unsafe { driver_use_of_container(dev) }.unwrap_or(real_used);
    Some((total, used.min(total)))
}

/// Bytes the driver says the container's processes hold on `dev`.
unsafe fn driver_use_of_container(dev: Device) -> Option<u64> {
    let sym = crate::real::sym(
        crate::real::Lib::Nvml,
        c"nvmlDeviceGetComputeRunningProcesses_v2",
    );
    if sym == 0 {
        return None;
    }
    // SAFETY: `sym` is the non-zero address of the real function of this C signature, resolved
    // by name.
    let f: ProcList = unsafe { std::mem::transmute(sym) };
    let pids = container_pids();
    let mut n = 0u32;
    let mut buf: Vec<u8> = Vec::new();
    for _ in 0..4 {
        buf = vec![0u8; n as usize * INFO_V2];
        let mut m = n;
        let ptr = if n == 0 {
            std::ptr::null_mut()
        } else {
            buf.as_mut_ptr().cast()
        };
        // SAFETY: the real NVML function; `ptr` is NULL with m == 0, or `buf` with room for `m`
        // entries of INFO_V2 bytes.
        match unsafe { f(dev, &mut m, ptr) } {
            NVML_SUCCESS => {
                buf.truncate(m.min(n) as usize * INFO_V2);
                break;
            }
            NVML_ERROR_INSUFFICIENT_SIZE => n = m + 8,
            _ => return None,
        }
    }
    Some(
        buf.chunks_exact(INFO_V2)
            .filter(|e| pids.contains(&i32::from_ne_bytes(e[..4].try_into().unwrap())))
            .map(|e| u64::from_ne_bytes(e[8..16].try_into().unwrap()))
            .sum(),
    )
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
        // SAFETY: `f` is the real NVML function; our caller's pointers are passed on unchanged.
        return unsafe { f(dev, count, infos) };
    }
    if !filtering() {
        // SAFETY: `f` is the real NVML function; our caller's pointers are passed on unchanged.
        return unsafe { f(dev, count, infos) };
    }
    let mut n: u32 = 0;
    // SAFETY: the real NVML function; a size query with our local `n` and no array.
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
                // SAFETY: the real NVML function; `buf` holds `m` entries of `stride` bytes.
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
    // SAFETY: `count` is non-NULL (checked on entry) and the caller's u32, per `filtered`'s
    // contract.
    let cap = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { *count = mine.len() as u32 };
    if mine.is_empty() {
        return NVML_SUCCESS;
    }
    if cap < mine.len() || infos.is_null() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (i, e) in mine.iter().enumerate() {
        // SAFETY: `infos` is non-NULL and holds `cap` >= mine.len() entries of `stride` bytes
        // (checked above; the caller's contract), and does not overlap our `buf`.
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
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(dev, mem) };
        if r == NVML_SUCCESS && let Some(m) = arg_mut(mem)
            && let Some((total, used)) = virtual_memory(dev, m.total, m.used)
        {
            m.total = total;
            m.used = used;
            m.free = total - used;
        }
        r
    }

    fn nvmlDeviceGetMemoryInfo_v2(dev: Device, mem: *mut MemoryV2) {
        let f = real_nvml!(nvmlDeviceGetMemoryInfo_v2: unsafe extern "C" fn(Device, *mut MemoryV2) -> i32);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(dev, mem) };
        if r == NVML_SUCCESS && let Some(m) = arg_mut(mem)
            && let Some((total, used)) = virtual_memory(dev, m.total, m.used.saturating_add(m.reserved))
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
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V1) }
    }

    fn nvmlDeviceGetComputeRunningProcesses_v2(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetComputeRunningProcesses_v2: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V2) }
    }

    fn nvmlDeviceGetComputeRunningProcesses_v3(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetComputeRunningProcesses_v3: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V2) }
    }

    fn nvmlDeviceGetGraphicsRunningProcesses(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetGraphicsRunningProcesses: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V1) }
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v2(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetGraphicsRunningProcesses_v2: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V2) }
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v3(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetGraphicsRunningProcesses_v3: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V2) }
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetMPSComputeRunningProcesses: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V1) }
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetMPSComputeRunningProcesses_v2: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V2) }
    }

    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(dev: Device, count: *mut u32, infos: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetMPSComputeRunningProcesses_v3: ProcList);
        // SAFETY: `count` and `infos` are our caller's (NVML ABI: NULL or valid for
        // `*count` entries), as `filtered` requires; `f` is the real NVML function
        // of this signature, resolved by name.
        unsafe { filtered(f, dev, count, infos, INFO_V2) }
    }
}

/// Returns a pointer, not a status, so a forwarding stub could not answer
/// safely when the real library is missing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: i32) -> *const c_char {
    std::panic::catch_unwind(|| {
        let sym = crate::real::sym(crate::real::Lib::Nvml, c"nvmlErrorString");
        if sym != 0 {
            // SAFETY: `sym` is the non-zero address of the real nvmlErrorString, whose C
            // signature this is.
            let f: unsafe extern "C" fn(i32) -> *const c_char = unsafe { std::mem::transmute(sym) };
            // SAFETY: the real nvmlErrorString takes a plain int.
            unsafe { f(result) }
        } else {
            c"Unknown Error (the real NVML library is not loadable)".as_ptr()
        }
    })
    .unwrap_or(c"Unknown Error".as_ptr())
}
