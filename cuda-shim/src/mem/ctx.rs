//! Contexts: destroying one (or resetting a primary context, or releasing
//! it to zero) frees every allocation made in it, so its bytes go back to
//! the quota. Creating one, loading a module or growing the device heap
//! takes device memory nobody asked for by size: those calls reconcile
//! with NVML at once and are undone when that puts the container over
//! its quota.

use super::quota::{InFlight, give_back};
use super::reconcile;
use crate::config;
use crate::real::real_cuda;
use crate::registration::proc;
use cuda_abi::{CUDA_SUCCESS, CUresult};
use std::collections::HashMap;
use std::ffi::c_void;

/// Primary context handles by device ordinal, learnt from retains (a reset
/// names the device only).
pub(crate) type Primary = HashMap<i32, u64>;

fn primary_map<T>(f: impl FnOnce(&mut Primary) -> T) -> T {
    f(&mut super::local::lock(&super::local::local().primary))
}

/// Gives back every allocation the process made in `ctx`.
pub(crate) fn drop_ctx(ctx: u64) {
    if config::enforce().is_none() || ctx == 0 {
        return;
    }
    let p = proc();
    let _f = InFlight::begin();
    let gone = p.table.take_ctx(ctx);
    let bytes: u64 = gone.iter().map(|(_, _, e)| e.bytes).sum();
    if !gone.is_empty() {
        crate::log::log!(
            Debug,
            "context {ctx:#x} gone: {} allocations, {bytes} bytes given back",
            gone.len()
        );
    }
    let guard = p.attach();
    for (_, _, e) in gone {
        give_back(guard.as_ref(), e.gpu, e.bytes);
    }
}

/// After a successful `cuDevicePrimaryCtxRetain`.
pub(crate) fn retained(dev: i32, ctx: u64) {
    if config::enforce().is_some() {
        primary_map(|m| m.insert(dev, ctx));
    }
}

fn primary_active(dev: i32) -> bool {
    fn state(dev: i32, flags: &mut u32, active: &mut i32) -> CUresult {
        let f = real_cuda!(cuDevicePrimaryCtxGetState: unsafe extern "C" fn(i32, *mut u32, *mut i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by name; its
        // pointer arguments are to our own live locals.
        unsafe { f(dev, flags, active) }
    }
    let (mut flags, mut active) = (0, 1);
    state(dev, &mut flags, &mut active);
    active != 0
}

/// After a successful primary release: at zero the context is gone.
pub(crate) fn primary_released(dev: i32) {
    if config::enforce().is_none() || primary_active(dev) {
        return;
    }
    primary_reset(dev);
}

/// After a successful primary reset: its allocations are gone.
pub(crate) fn primary_reset(dev: i32) {
    if config::enforce().is_none() {
        return;
    }
    if let Some(ctx) = primary_map(|m| m.get(&dev).copied()) {
        drop_ctx(ctx);
    }
    reconcile::now();
}

/// Runs a call that may take hidden device memory (context, module, heap),
/// then reconciles with NVML; if that took the container over its quota,
/// `undo` (given the call's result) reverts it and the call fails with
/// OUT_OF_MEMORY.
pub(crate) fn hidden(call: impl FnOnce() -> CUresult, undo: impl FnOnce()) -> CUresult {
    if config::enforce().is_none() {
        return call();
    }
    let before = reconcile::extra();
    let r = call();
    if r != CUDA_SUCCESS {
        return r;
    }
    if reconcile::grew_over_quota(before) {
        undo();
        reconcile::now();
        return cuda_abi::CUDA_ERROR_OUT_OF_MEMORY;
    }
    r
}

/// `cuCtxDestroy` for [`hidden`]'s undo.
pub(crate) fn destroy(ctx: *mut c_void) {
    fn d(ctx: *mut c_void) -> CUresult {
        let f = real_cuda!(cuCtxDestroy_v2: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real cuCtxDestroy_v2, resolved by name, given a context handle the driver
        // handed out; no memory of ours is passed.
        unsafe { f(ctx) }
    }
    d(ctx);
    drop_ctx(ctx as u64);
}

/// After a call that gives hidden memory back (a context destroyed, a
/// module unloaded): measure now so the quota sees it at once.
pub(crate) fn after_hidden_change() {
    if config::enforce().is_some() {
        reconcile::now();
    }
}
