//! Virtual memory management: `cuMemCreate` counts device locations only
//! (host and host-NUMA handles take no device memory), and a handle
//! released while still mapped keeps its bytes until its last mapping is
//! unmapped, as the driver keeps the memory until then. A reference taken
//! with `cuMemRetainAllocationHandle` is one more `cuMemRelease` before the
//! bytes go (NCCL's ncclCuMemFree: retain, release, unmap, release).
//! Handles imported from another process are not in the table: their
//! memory is the creator's, never counted here.

use super::quota::{InFlight, give_back};
use crate::config;
use crate::registration::proc;
use crate::table::Kind;
use cuda_abi::{CUDA_SUCCESS, CUresult};
use std::collections::{BTreeMap, HashMap};

#[derive(Default)]
pub(crate) struct Maps {
    /// Mapped address -> (handle, size).
    at: BTreeMap<u64, (u64, u64)>,
    /// Handle -> (live mappings, released by the program, references
    /// retained since and not yet released).
    handles: HashMap<u64, (u32, bool, u32)>,
}

fn with<T>(f: impl FnOnce(&mut Maps) -> T) -> T {
    f(&mut super::local::lock(&super::local::local().maps))
}

/// `CUmemAllocationProp.location.type` is a host location
/// (`CU_MEM_LOCATION_TYPE_HOST`, `_HOST_NUMA`, `_HOST_NUMA_CURRENT`).
///
/// # Safety
/// `prop` is NULL or points to a `CUmemAllocationProp`.
pub(crate) unsafe fn host_location(prop: *const std::ffi::c_void) -> bool {
    if prop.is_null() {
        return false;
    }
    // SAFETY: the caller guarantees a `CUmemAllocationProp`, NULL excluded above;
    // `location.type` is its third u32 word, read unaligned.
    let t = unsafe { (prop as *const u32).add(2).read_unaligned() };
    (2..=4).contains(&t)
}

/// The device a device-located `CUmemAllocationProp` names
/// (`location.id`, its fourth u32 word); `None` for a NULL prop.
///
/// # Safety
/// `prop` is NULL or points to a `CUmemAllocationProp`.
pub(crate) unsafe fn location_device(prop: *const std::ffi::c_void) -> Option<i32> {
    if prop.is_null() {
        return None;
    }
    // SAFETY: the caller guarantees a `CUmemAllocationProp`, NULL excluded above;
    // `location.id` is its fourth u32 word (an int), read unaligned.
    Some(unsafe { (prop as *const i32).add(3).read_unaligned() })
}

/// After a successful `cuMemMap` of a counted handle.
pub(crate) fn mapped(ptr: u64, size: u64, handle: u64) {
    if config::enforce().is_none() || proc().table.get(Kind::Generic, handle).is_none() {
        return;
    }
    with(|m| {
        m.handles.entry(handle).or_default().0 += 1;
        m.at.insert(ptr, (handle, size));
    });
}

/// After a successful `cuMemUnmap` of [ptr, ptr+size): handles released
/// earlier whose last mapping this was give their bytes back.
pub(crate) fn unmapped(ptr: u64, size: u64) {
    if config::enforce().is_none() {
        return;
    }
    let done: Vec<u64> = with(|m| {
        let end = ptr.saturating_add(size.max(1));
        let gone: Vec<u64> = m.at.range(ptr..end).map(|(&a, _)| a).collect();
        let mut done = Vec::new();
        for a in gone {
            let (h, _) = m.at.remove(&a).unwrap();
            if let Some(e) = m.handles.get_mut(&h) {
                e.0 = e.0.saturating_sub(1);
                // Unmapped with references still out: the bytes stay
                // until the last release (the table keeps them).
                if e.0 == 0 && e.2 == 0 {
                    if e.1 {
                        done.push(h);
                    }
                    m.handles.remove(&h);
                }
            }
        }
        done
    });
    let p = proc();
    let _f = InFlight::begin();
    for h in done {
        if let Some(e) = p.table.remove(Kind::Generic, h) {
            give_back(p.attach().as_ref(), e.gpu, e.bytes);
        }
    }
}

/// `cuMemRelease`: a mapped handle keeps its bytes (and its table entry)
/// until unmapped; an unmapped one is freed as usual.
pub(crate) fn release(handle: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if config::enforce().is_none() {
        return call();
    }
    // A retained reference going: the handle's bytes stay.
    let retained = with(|m| m.handles.get(&handle).is_some_and(|e| e.2 > 0));
    if retained {
        let r = call();
        if r == CUDA_SUCCESS {
            with(|m| {
                if let Some(e) = m.handles.get_mut(&handle) {
                    e.2 -= 1;
                }
            });
        }
        return r;
    }
    let mapped = with(|m| m.handles.get(&handle).is_some_and(|e| e.0 > 0));
    if !mapped {
        with(|m| m.handles.remove(&handle));
        return super::quota::free(Kind::Generic, handle, call);
    }
    let r = call();
    if r == CUDA_SUCCESS {
        with(|m| {
            if let Some(e) = m.handles.get_mut(&handle) {
                e.1 = true;
            }
        });
    }
    r
}

/// After a successful `cuMemRetainAllocationHandle` of a counted handle.
pub(crate) fn retained(handle: u64) {
    if config::enforce().is_none() || proc().table.get(Kind::Generic, handle).is_none() {
        return;
    }
    with(|m| m.handles.entry(handle).or_default().2 += 1);
}

/// A handle or address the table held was handed out again: whatever we
/// knew about its mappings is stale.
pub(crate) fn forget(kind: Kind, key: u64) {
    if kind != Kind::Generic {
        return;
    }
    with(|m| {
        m.handles.remove(&key);
        m.at.retain(|_, (h, _)| *h != key);
    });
}
