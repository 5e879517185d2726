//! Stream-ordered pools: the quota pays for what a pool reserves on the
//! device (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), not for each
//! allocation. A free into a pool that keeps the memory (release threshold)
//! gives nothing back until the pool releases it: at a synchronisation
//! point, a trim, or when the watcher's tick sees it shrink.
//!
//! An allocation reserves what the pool lacks (its size minus the pool's
//! free bytes, in 2 MiB steps) before the driver is called, then settles
//! on what the pool really grew by. One lock serialises the pool paths of
//! the process, so before/after readings belong to one allocation.

use super::local::local;
use super::quota::{InFlight, force_take, give_back, try_take};
use crate::config;
use crate::real::real_cuda;
use crate::registration::{REFUSED, proc};
use cuda_abi::{CUDA_SUCCESS, CUresult};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicBool, Ordering};

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
const RESERVED: i32 = 5;
const USED: i32 = 7;
/// Reservations ahead of the driver are rounded to this (the sim's and a
/// typical pool's growth step); the difference is settled afterwards.
const STEP: u64 = 2 << 20;

pub(crate) type Pool = u64;

#[derive(Default)]
pub(crate) struct Pools {
    /// Bytes of the ledger each pool holds (its last seen reservation).
    charged: HashMap<Pool, u64>,
    /// Stream-ordered allocations: pointer -> (pool, bytes).
    ptrs: HashMap<u64, (Pool, u64)>,
    /// The GPU of the share (ledger position) each charged pool lives on:
    /// the current context's device when it was first charged.
    gpu: HashMap<Pool, usize>,
}

/// Whether any pool is charged (sync points skip everything otherwise).
static ANY: AtomicBool = AtomicBool::new(false);

struct Guard(MutexGuard<'static, Pools>);

impl Guard {
    fn get(&mut self) -> &mut Pools {
        &mut self.0
    }
}

fn lock() -> Guard {
    Guard(super::local::lock(&local().pools))
}

fn attr(pool: Pool, which: i32) -> Option<u64> {
    fn get(pool: Pool, which: i32, v: &mut u64) -> CUresult {
        let f = real_cuda!(cuMemPoolGetAttribute: unsafe extern "C" fn(*mut c_void, i32, *mut c_void) -> CUresult);
        // SAFETY: the real cuMemPoolGetAttribute, resolved by name; every attribute asked for
        // here is a u64 and `v` is our live u64.
        unsafe { f(pool as *mut c_void, which, (v as *mut u64).cast()) }
    }
    let mut v = 0u64;
    // Bookkeeping: never a prohibited call during the application's captures.
    (crate::graph::relaxed(|| get(pool, which, &mut v)) == CUDA_SUCCESS).then_some(v)
}

/// The pool `cuMemAllocAsync` takes from: the current device's.
fn device_pool() -> Option<Pool> {
    fn dev(d: &mut i32) -> CUresult {
        let f = real_cuda!(cuCtxGetDevice: unsafe extern "C" fn(*mut i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by name; its
        // pointer arguments are to our own live locals.
        unsafe { f(d) }
    }
    fn pool(p: &mut *mut c_void, d: i32) -> CUresult {
        let f =
            real_cuda!(cuDeviceGetMemPool: unsafe extern "C" fn(*mut *mut c_void, i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by name; its
        // pointer arguments are to our own live locals.
        unsafe { f(p, d) }
    }
    let mut d = 0;
    let mut p = std::ptr::null_mut();
    crate::graph::relaxed(|| {
        dev(&mut d) == CUDA_SUCCESS && pool(&mut p, d) == CUDA_SUCCESS && !p.is_null()
    })
    .then_some(p as Pool)
}

/// Brings the ledger in line with what `pool` reserves now.
fn settle(ps: &mut Pools, pool: Pool) {
    let now = match attr(pool, RESERVED) {
        Some(r) => r,
        // Destroyed: it holds at most its outstanding allocations.
        None => ps
            .ptrs
            .values()
            .filter(|(p, _)| *p == pool)
            .map(|(_, b)| b)
            .sum(),
    };
    let was = ps.charged.get(&pool).copied().unwrap_or(0);
    let gpu = ps.gpu.get(&pool).copied().unwrap_or(0);
    let guard = proc().attach();
    if now > was {
        if let Some(a) = guard.as_ref() {
            force_take(a, gpu, now - was);
        }
    } else {
        give_back(guard.as_ref(), gpu, was - now);
    }
    if now == 0 && !ps.ptrs.values().any(|(p, _)| *p == pool) {
        ps.charged.remove(&pool);
        ps.gpu.remove(&pool);
    } else {
        ps.charged.insert(pool, now);
    }
}

/// A stream-ordered allocation of `bytes` from `pool` (None: the current
/// device's pool). `undo` frees it if its growth does not fit after all.
pub(crate) fn alloc(
    bytes: u64,
    pool: Option<Pool>,
    mut call: impl FnMut() -> CUresult,
    key: impl FnOnce() -> u64,
    undo: impl FnOnce(u64),
) -> CUresult {
    if config::enforce().is_none() || bytes == 0 {
        return call();
    }
    let p = proc();
    if let Err(e) = p.ensure_registered() {
        return e;
    }
    let Some(pool) = pool.or_else(device_pool) else {
        // No pool to read: charged per allocation, like cuMemAlloc.
        return super::quota::alloc(bytes, crate::table::Kind::Ptr, call, key);
    };
    let mut g = lock();
    let ps = g.get();
    let _f = InFlight::begin();
    let gpu = match ps.gpu.get(&pool) {
        Some(&g) => g,
        None => match super::quota::position(super::quota::On::Current) {
            Ok(g) => *ps.gpu.entry(pool).or_insert(g),
            Err(e) => return e,
        },
    };
    settle(ps, pool);
    let guard = p.attach();
    let Some(a) = guard.as_ref() else {
        return REFUSED;
    };
    let reserved = ps.charged.get(&pool).copied().unwrap_or(0);
    let used = attr(pool, USED).unwrap_or(reserved);
    let need = bytes
        .saturating_sub(reserved.saturating_sub(used))
        .div_ceil(STEP)
        * STEP;
    if let Err(e) = try_take(a, gpu, need, "stream-ordered allocation") {
        return e;
    }
    let r = call();
    if r != CUDA_SUCCESS {
        give_back(Some(a), gpu, need);
        return r;
    }
    let ptr = key();
    let now = attr(pool, RESERVED).unwrap_or(reserved + need);
    let grew = now.saturating_sub(reserved);
    if grew > need {
        if let Err(e) = try_take(
            a,
            gpu,
            grew - need,
            "stream-ordered allocation (pool growth)",
        ) {
            give_back(Some(a), gpu, need);
            undo(ptr);
            drop(guard);
            settle(ps, pool);
            return e;
        }
    } else {
        give_back(Some(a), gpu, need - grew);
    }
    ps.charged.insert(pool, now);
    ps.gpu.insert(pool, gpu);
    ps.ptrs.insert(ptr, (pool, bytes));
    ANY.store(true, Ordering::Release);
    r
}

/// A stream-ordered free: the pool keeps the bytes (and the quota stays
/// charged) unless the driver releases them.
pub(crate) fn free(ptr: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if config::enforce().is_none() {
        return call();
    }
    let mut g = lock();
    let ps = g.get();
    let Some(&(pool, _)) = ps.ptrs.get(&ptr) else {
        drop(g);
        return super::quota::free(crate::table::Kind::Ptr, ptr, call);
    };
    let _f = InFlight::begin();
    let r = call();
    if r == CUDA_SUCCESS {
        ps.ptrs.remove(&ptr);
        settle(ps, pool);
    }
    r
}

/// Re-reads every charged pool (after a synchronisation point, a trim, a
/// threshold change, and on the watcher's tick).
pub(crate) fn settle_all() {
    if !ANY.load(Ordering::Acquire) || config::enforce().is_none() {
        return;
    }
    let mut g = lock();
    let ps = g.get();
    let _f = InFlight::begin();
    let pools: Vec<Pool> = ps.charged.keys().copied().collect();
    for pool in pools {
        settle(ps, pool);
    }
}

/// After `cuMemPoolDestroy` succeeded.
pub(crate) fn after_destroy(pool: Pool) {
    if config::enforce().is_none() {
        return;
    }
    let mut g = lock();
    let ps = g.get();
    let _f = InFlight::begin();
    if ps.charged.contains_key(&pool) {
        settle(ps, pool);
    }
}
