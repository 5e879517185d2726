//! NVML queries that name processes, beyond the running-process lists:
//! utilization samples, the versioned detail and utilization lists,
//! accounting, process names. Each answers only for the container's host
//! PIDs ([`crate::registration::container_pids`]); other tenants' entries
//! are dropped and NVML's size protocol is kept on what remains.
//!
//! Only our exports are wrapped: the compute controller reads the real
//! library's `nvmlDeviceGetProcessUtilization` directly (it needs everyone's
//! samples to split ours from the others').

use super::{
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH, NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_NOT_FOUND,
    NVML_SUCCESS, filtering,
};
use crate::nvml::NVML_ERROR_INVALID_ARGUMENT;
use crate::real::real_nvml;
use crate::registration::container_pids;
use crate::{arg, arg_mut};
use std::ffi::{c_char, c_void};
use std::sync::Mutex;

type Device = *mut c_void;

/// `nvmlProcessUtilizationSample_t`: pid at 0, 32 bytes.
const SAMPLE: usize = 32;
/// `nvmlProcessUtilizationInfo_v1_t`: timeStamp, then pid at 8; 40 bytes.
const UTIL_INFO: usize = 40;
/// `nvmlProcessDetail_v1_t`: pid at 0, 32 bytes.
const DETAIL: usize = 32;
/// `NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1)` (24-byte struct).
pub const PROCESSES_UTILIZATION_INFO_V1: u32 = 24 | (1 << 24);
/// `NVML_STRUCT_VERSION(ProcessDetailList, 1)` (24-byte struct).
pub const PROCESS_DETAIL_LIST_V1: u32 = 24 | (1 << 24);

/// `nvmlProcessesUtilizationInfo_v1_t`.
#[repr(C)]
pub struct ProcessesUtilizationInfo {
    pub version: u32,
    pub count: u32,
    pub last_seen: u64,
    pub array: *mut u8,
}

/// `nvmlProcessDetailList_v1_t`.
#[repr(C)]
pub struct ProcessDetailList {
    pub version: u32,
    pub mode: u32,
    pub count: u32,
    pub array: *mut u8,
}

/// Every entry of a list query of the real library, in NVML's two-call
/// protocol: `call(buf, &mut n)` with a null buffer asks for the count.
/// `Ok` with the entries (possibly none); `Err` with the real status.
fn fetch_all(
    stride: usize,
    mut call: impl FnMut(*mut u8, &mut u32) -> i32,
) -> Result<Vec<u8>, i32> {
    let mut n = 0u32;
    match call(std::ptr::null_mut(), &mut n) {
        NVML_SUCCESS => return Ok(Vec::new()),
        NVML_ERROR_INSUFFICIENT_SIZE => {}
        e => return Err(e),
    }
    // Entries may appear between the calls: retry a few times.
    for _ in 0..4 {
        let cap = n + 8;
        let mut buf = vec![0u8; cap as usize * stride];
        let mut m = cap;
        match call(buf.as_mut_ptr(), &mut m) {
            NVML_SUCCESS => {
                buf.truncate(m.min(cap) as usize * stride);
                return Ok(buf);
            }
            NVML_ERROR_INSUFFICIENT_SIZE => n = m,
            e => return Err(e),
        }
    }
    Err(NVML_ERROR_INSUFFICIENT_SIZE)
}

/// The entries of `all` whose `u32` at `pid_at` is one of the container's.
fn keep_ours(all: &[u8], stride: usize, pid_at: usize) -> Vec<u8> {
    let pids = container_pids();
    all.chunks_exact(stride)
        .filter(|e| {
            let pid = i32::from_ne_bytes(e[pid_at..pid_at + 4].try_into().unwrap());
            pids.contains(&pid)
        })
        .flatten()
        .copied()
        .collect()
}

/// Hands `mine` to the caller's array of `*count` entries: too small (or
/// null) gives INSUFFICIENT_SIZE with the count needed; none gives
/// `empty` (SUCCESS for lists, NOT_FOUND for samples).
unsafe fn hand_out(mine: &[u8], stride: usize, count: &mut u32, array: *mut u8, empty: i32) -> i32 {
    let n = mine.len() / stride;
    let cap = if array.is_null() { 0 } else { *count as usize };
    *count = n as u32;
    if n == 0 {
        return empty;
    }
    if cap < n {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: `array` is non-NULL with room for `cap` >= n entries of `stride` bytes (the
    // caller's contract), and does not overlap `mine` (ours).
    unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr(), array, mine.len()) };
    NVML_SUCCESS
}

/// Samples handed out by a size query, so the follow-up call gets the same
/// set even when a sample period ends in between (as the real driver keeps
/// them; without this a client's second call could come back too small).
struct Pending {
    key: (usize, u64, &'static str),
    at: std::time::Instant,
    mine: Vec<u8>,
}

static PENDING: Mutex<Option<Pending>> = Mutex::new(None);

/// Filtered samples for `key`, reusing what a recent size query saw.
fn samples_for(
    key: (usize, u64, &'static str),
    follow_up: bool,
    fetch: impl FnOnce() -> Result<Vec<u8>, i32>,
) -> Result<Vec<u8>, i32> {
    let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    if follow_up
        && let Some(kept) = p.take()
        && kept.key == key
        && kept.at.elapsed() < std::time::Duration::from_secs(1)
    {
        return Ok(kept.mine);
    }
    drop(p);
    fetch()
}

fn remember(key: (usize, u64, &'static str), mine: &[u8]) {
    *PENDING.lock().unwrap_or_else(|e| e.into_inner()) = Some(Pending {
        key,
        at: std::time::Instant::now(),
        mine: mine.to_vec(),
    });
}

type ProcUtil = unsafe extern "C" fn(Device, *mut u8, *mut u32, u64) -> i32;
type ProcsUtilInfo = unsafe extern "C" fn(Device, *mut ProcessesUtilizationInfo) -> i32;
type DetailList = unsafe extern "C" fn(Device, *mut ProcessDetailList) -> i32;
type AccountingPids = unsafe extern "C" fn(Device, *mut u32, *mut u32) -> i32;
type AccountingStats = unsafe extern "C" fn(Device, u32, *mut c_void) -> i32;
type AccountingStatsV2 = unsafe extern "C" fn(Device, *mut c_void) -> i32;
type ProcessName = unsafe extern "C" fn(u32, *mut c_char, u32) -> i32;

fn ours(pid: u32) -> bool {
    container_pids().contains(&(pid as i32))
}

/// The answer about another tenant's PID, from the real NVML's status on a
/// private buffer: its errors as they are, its success as NOT_FOUND.
fn foreign(real: i32) -> i32 {
    if real == NVML_SUCCESS {
        NVML_ERROR_NOT_FOUND
    } else {
        real
    }
}

nvml_exports! {
    fn nvmlDeviceGetProcessUtilization(dev: Device, samples: *mut u8, count: *mut u32, last_seen: u64) {
        let f = real_nvml!(nvmlDeviceGetProcessUtilization: ProcUtil);
        if !filtering() || count.is_null() {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dev, samples, count, last_seen) };
        }
        let key = (dev as usize, last_seen, "samples");
        let mine = match samples_for(key, !samples.is_null(), || {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            fetch_all(SAMPLE, |b, n| unsafe { f(dev, b, n, last_seen) }).map(|all| keep_ours(&all, SAMPLE, 0))
        }) {
            Ok(m) => m,
            // No samples at all: the same answer, for us too.
            Err(e) => return e,
        };
        let Some(count) = arg_mut(count) else { return NVML_ERROR_INVALID_ARGUMENT };
        // SAFETY: `samples` is our caller's array of `*count` entries or NULL
        // (NVML ABI), as `hand_out` requires.
        let r = unsafe { hand_out(&mine, SAMPLE, count, samples, NVML_ERROR_NOT_FOUND) };
        if r == NVML_ERROR_INSUFFICIENT_SIZE {
            remember(key, &mine);
        }
        r
    }

    fn nvmlDeviceGetProcessesUtilizationInfo(dev: Device, info: *mut ProcessesUtilizationInfo) {
        let f = real_nvml!(nvmlDeviceGetProcessesUtilizationInfo: ProcsUtilInfo);
        if !filtering() || info.is_null() {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dev, info) };
        }
        let Some(info) = arg_mut(info) else { return NVML_ERROR_INVALID_ARGUMENT };
        if info.version != PROCESSES_UTILIZATION_INFO_V1 {
            // A layout we cannot filter: never hand it out.
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        let key = (dev as usize, info.last_seen, "info");
        let mine = match samples_for(key, !info.array.is_null(), || {
            fetch_all(UTIL_INFO, |b, n| {
                let mut q = ProcessesUtilizationInfo { version: info.version, count: *n, last_seen: info.last_seen, array: b };
                // SAFETY: the real driver's function of this exact signature, resolved by
                // name; pointers are our caller's (passed on unchanged) or our own locals.
                let r = unsafe { f(dev, &mut q) };
                *n = q.count;
                r
            })
            .map(|all| keep_ours(&all, UTIL_INFO, 8))
        }) {
            Ok(m) => m,
            Err(e) => return e,
        };
        // SAFETY: `info.array` is our caller's array of `info.count` entries or
        // NULL (NVML ABI), as `hand_out` requires.
        let r = unsafe { hand_out(&mine, UTIL_INFO, &mut info.count, info.array, NVML_ERROR_NOT_FOUND) };
        if r == NVML_ERROR_INSUFFICIENT_SIZE {
            remember(key, &mine);
        }
        r
    }

    fn nvmlDeviceGetRunningProcessDetailList(dev: Device, list: *mut ProcessDetailList) {
        let f = real_nvml!(nvmlDeviceGetRunningProcessDetailList: DetailList);
        if !filtering() || list.is_null() {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dev, list) };
        }
        let Some(list) = arg_mut(list) else { return NVML_ERROR_INVALID_ARGUMENT };
        if list.version != PROCESS_DETAIL_LIST_V1 {
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        let all = fetch_all(DETAIL, |b, n| {
            let mut q = ProcessDetailList { version: list.version, mode: list.mode, count: *n, array: b };
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            let r = unsafe { f(dev, &mut q) };
            *n = q.count;
            r
        });
        match all {
            // SAFETY: `list.array` is our caller's array of `list.count` entries
            // or NULL (NVML ABI), as `hand_out` requires.
            Ok(all) => unsafe { hand_out(&keep_ours(&all, DETAIL, 0), DETAIL, &mut list.count, list.array, NVML_SUCCESS) },
            Err(e) => e,
        }
    }

    fn nvmlDeviceGetAccountingPids(dev: Device, count: *mut u32, pids: *mut u32) {
        let f = real_nvml!(nvmlDeviceGetAccountingPids: AccountingPids);
        if !filtering() || count.is_null() {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dev, count, pids) };
        }
        let Some(count) = arg_mut(count) else { return NVML_ERROR_INVALID_ARGUMENT };
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        match fetch_all(4, |b, n| unsafe { f(dev, n, b.cast()) }) {
            // SAFETY: `pids` is our caller's array of `*count` entries or NULL
            // (NVML ABI), as `hand_out` requires.
            Ok(all) => unsafe { hand_out(&keep_ours(&all, 4, 0), 4, count, pids.cast(), NVML_SUCCESS) },
            Err(e) => e,
        }
    }

    fn nvmlDeviceGetAccountingStats(dev: Device, pid: u32, stats: *mut c_void) {
        let f = real_nvml!(nvmlDeviceGetAccountingStats: AccountingStats);
        if filtering() && !stats.is_null() && !ours(pid) {
            // Another tenant's PID: the real answer into a private buffer
            // (`nvmlAccountingStats_t` is 56 bytes), so that its failures
            // (UNINITIALIZED, a bad handle) pass through unchanged, as the
            // real NVML gives them; only its success is hidden.
            let mut private = [0u64; 16];
            // SAFETY: the real driver's function of this exact signature; `private` has room
            // for the struct.
            return foreign(unsafe { f(dev, pid, private.as_mut_ptr().cast()) });
        }
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        unsafe { f(dev, pid, stats) }
    }

    fn nvmlDeviceGetAccountingStats_v2(dev: Device, stats: *mut c_void) {
        // `nvmlAccountingStats_v2_t` starts with the pid asked about.
        let f = real_nvml!(nvmlDeviceGetAccountingStats_v2: AccountingStatsV2);
        if filtering() && arg(stats.cast::<u32>()).is_some_and(|&pid| !ours(pid)) {
            return NVML_ERROR_NOT_FOUND;
        }
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        unsafe { f(dev, stats) }
    }

    fn nvmlSystemGetProcessName(pid: u32, name: *mut c_char, len: u32) {
        let f = real_nvml!(nvmlSystemGetProcessName: ProcessName);
        if filtering() && !ours(pid) {
            // As for the accounting stats: the real status, never the name.
            let len = len.min(4096);
            let mut private = vec![0 as c_char; len.max(1) as usize];
            let buf = if name.is_null() { std::ptr::null_mut() } else { private.as_mut_ptr() };
            // SAFETY: the real driver's function of this exact signature; `buf` is NULL as the
            // caller's was, or `private` with room for `len` bytes.
            return foreign(unsafe { f(pid, buf, len) });
        }
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        unsafe { f(pid, name, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::NVML_ERROR_INVALID_ARGUMENT;

    #[test]
    fn hand_out_keeps_the_size_protocol() {
        let mine = vec![1u8; 3 * 8];
        let mut n = 0;
        // SAFETY: a NULL array: hand_out only sets the count.
        let r = unsafe { hand_out(&mine, 8, &mut n, std::ptr::null_mut(), NVML_SUCCESS) };
        assert_eq!((r, n), (NVML_ERROR_INSUFFICIENT_SIZE, 3));
        let mut buf = vec![0u8; 2 * 8];
        let mut n = 2;
        // SAFETY: `buf` holds `n` entries of 8 bytes.
        let r = unsafe { hand_out(&mine, 8, &mut n, buf.as_mut_ptr(), NVML_SUCCESS) };
        assert_eq!((r, n), (NVML_ERROR_INSUFFICIENT_SIZE, 3));
        let mut buf = vec![0u8; 4 * 8];
        let mut n = 4;
        // SAFETY: `buf` holds `n` entries of 8 bytes.
        let r = unsafe { hand_out(&mine, 8, &mut n, buf.as_mut_ptr(), NVML_SUCCESS) };
        assert_eq!((r, n), (NVML_SUCCESS, 3));
        assert_eq!(&buf[..24], &mine[..]);
        let mut n = 4;
        // SAFETY: `buf` holds `n` entries of 8 bytes.
        let r = unsafe { hand_out(&[], 8, &mut n, buf.as_mut_ptr(), NVML_ERROR_NOT_FOUND) };
        assert_eq!((r, n), (NVML_ERROR_NOT_FOUND, 0));
    }

    #[test]
    fn fetch_all_follows_the_two_call_protocol() {
        // A list of 5 u32 entries that grows by 2 after the size query.
        let mut calls = 0;
        let got = fetch_all(4, |b, n| {
            calls += 1;
            let len = if calls == 1 { 5 } else { 7 };
            if b.is_null() || (*n as usize) < len {
                *n = len as u32;
                return NVML_ERROR_INSUFFICIENT_SIZE;
            }
            for i in 0..len {
                // SAFETY: `b` is non-NULL with room for `*n` >= len u32 entries (checked
                // above).
                unsafe { (b as *mut u32).add(i).write(i as u32) };
            }
            *n = len as u32;
            NVML_SUCCESS
        })
        .unwrap();
        assert_eq!(got.len(), 7 * 4);
        assert_eq!(fetch_all(4, |_, _| NVML_SUCCESS).unwrap(), Vec::<u8>::new());
        assert_eq!(
            fetch_all(4, |_, _| NVML_ERROR_INVALID_ARGUMENT),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }
}
