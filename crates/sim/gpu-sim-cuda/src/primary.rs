//! Primary contexts: one per device, retained and released by count,
//! reset in place.

use crate::{R, drv, put};
use cuda_abi::*;
use std::ffi::c_void;
use std::sync::atomic::Ordering::*;

unsafe fn primary_release(dev: i32) -> R {
    let d = drv()?;
    let p = d.device(dev)?.primary;
    let before = p
        .retained
        .fetch_update(AcqRel, Acquire, |n| n.checked_sub(1))
        .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
    if before == 1 {
        // The last release destroys the primary context's state and memory.
        p.synchronize();
        crate::charge::deactivate(d, p);
    }
    Ok(())
}

/// cuDevicePrimaryCtxReset: everything the primary context holds is freed;
/// still retained, it starts afresh (and costs its overhead again).
unsafe fn primary_reset(dev: i32) -> R {
    let d = drv()?;
    let p = d.device(dev)?.primary;
    p.synchronize();
    crate::charge::deactivate(d, p);
    if p.retained.load(Acquire) > 0 {
        crate::charge::activate(d, p)?;
    }
    Ok(())
}

cuda_fn! {
    fn cuDevicePrimaryCtxRetain(out: *mut *mut c_void, dev: i32) {
        let d = drv()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d.device(dev)?;
        crate::charge::activate(d, dev.primary)?;
        dev.primary.retained.fetch_add(1, AcqRel);
        d.state.set_active(d.me, dev.gpu);
        put(out, dev.primary.handle())?;
        Ok(())
    }

    fn cuDevicePrimaryCtxRelease(dev: i32) {
        // SAFETY: `primary_release` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { primary_release(dev) }
    }

    fn cuDevicePrimaryCtxRelease_v2(dev: i32) {
        // SAFETY: `primary_release` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { primary_release(dev) }
    }

    fn cuDevicePrimaryCtxReset(dev: i32) {
        // SAFETY: `primary_reset` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { primary_reset(dev) }
    }

    fn cuDevicePrimaryCtxReset_v2(dev: i32) {
        // SAFETY: `primary_reset` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { primary_reset(dev) }
    }

    fn cuDevicePrimaryCtxSetFlags(dev: i32, flags: u32) {
        drv()?.device(dev)?.primary.flags.store(flags, Release);
        Ok(())
    }

    fn cuDevicePrimaryCtxSetFlags_v2(dev: i32, flags: u32) {
        drv()?.device(dev)?.primary.flags.store(flags, Release);
        Ok(())
    }

    fn cuDevicePrimaryCtxGetState(dev: i32, flags: *mut u32, active: *mut i32) {
        let p = drv()?.device(dev)?.primary;
        put(flags, p.flags.load(Acquire))?;
        put(active, (p.retained.load(Acquire) > 0) as i32)
    }
}
