//! Memory copies: host to device, device to host, device to device, and
//! unified (`cuMemcpy`, either side host or device), synchronous and async.

use crate::ctx::{Ctx, current};
use crate::stream::Target;
use crate::{R, drv};
use cuda_abi::*;
use std::ffi::c_void;

unsafe fn copy(dst: u64, src: u64, n: usize) {
    if n > 0 {
        // SAFETY: the callers checked both ranges: device ranges with `mem.check`, host ranges
        // are the CUDA caller's (valid for `n` bytes per the ABI); `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
    }
}

unsafe fn htod(dst: u64, src: *const c_void, n: usize) -> R {
    let d = drv()?;
    current()?;
    if src.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.mem.check(dst, n)?;
    // SAFETY: `dst`..+n was checked as device memory of ours, and `src` is the caller's host
    // buffer of `n` bytes (non-NULL, checked above).
    unsafe { copy(dst, src as u64, n) };
    Ok(())
}

unsafe fn dtoh(dst: *mut c_void, src: u64, n: usize) -> R {
    let d = drv()?;
    current()?;
    if dst.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.mem.check(src, n)?;
    // SAFETY: `src`..+n was checked as device memory of ours, and `dst` is the caller's host
    // buffer of `n` bytes (non-NULL, checked above).
    unsafe { copy(dst as u64, src, n) };
    Ok(())
}

unsafe fn dtod(dst: u64, src: u64, n: usize) -> R {
    let d = drv()?;
    current()?;
    d.mem.check(src, n)?;
    d.mem.check(dst, n)?;
    // SAFETY: both ranges were checked as device memory of ours just above.
    unsafe { copy(dst, src, n) };
    Ok(())
}

/// cuMemcpy: unified addressing, either side may be host or device.
unsafe fn any(dst: u64, src: u64, n: usize) -> R {
    drv()?;
    current()?;
    if (dst == 0 || src == 0) && n > 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: unified addressing: either side is device memory of ours or the caller's host
    // memory, valid for `n` bytes per the CUDA ABI; NULL rejected above.
    unsafe { copy(dst, src, n) };
    Ok(())
}

/// cuMemcpyPeer: device memory in two contexts (both checked). The driver
/// copies between any two devices, staging through the host where they are
/// not peers, so peer access is not asked for (only kernels need it).
unsafe fn peer(dst: u64, dc: *mut c_void, src: u64, sc: *mut c_void, n: usize) -> R {
    let d = drv()?;
    // SAFETY: our caller's context handles, passed on; `from_handle` checks their magic.
    unsafe { (Ctx::from_handle(dc)?, Ctx::from_handle(sc)?) };
    d.mem.check(src, n)?;
    d.mem.check(dst, n)?;
    // SAFETY: both ranges were checked as device memory of ours just above.
    unsafe { copy(dst, src, n) };
    Ok(())
}

/// Async copies and sets complete at once: the simulator charges time only to
/// kernels. The stream handle is still checked.
pub(crate) unsafe fn on(stream: *mut c_void, ptsz: bool) -> R {
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    unsafe { Target::of(stream, ptsz) }.map(|_| ())
}

cuda_fn! {
    // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpy(dst: u64, src: u64, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { any(dst, src, n) } }
    // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpy_ptds(dst: u64, src: u64, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { any(dst, src, n) } }
    // SAFETY: `on`, `any` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyAsync(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { any(dst, src, n) } }
    // SAFETY: `on`, `any` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyAsync_ptsz(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { any(dst, src, n) } }
    // SAFETY: `peer` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyPeer(dst: u64, dc: *mut c_void, src: u64, sc: *mut c_void, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { peer(dst, dc, src, sc, n) } }
    // SAFETY: `peer` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyPeer_ptds(dst: u64, dc: *mut c_void, src: u64, sc: *mut c_void, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { peer(dst, dc, src, sc, n) } }
    fn cuMemcpyPeerAsync(dst: u64, dc: *mut c_void, src: u64, sc: *mut c_void, n: usize, s: *mut c_void) {
        // SAFETY: `on` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { on(s, false) }?;
        // SAFETY: `peer` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { peer(dst, dc, src, sc, n) }
    }
    fn cuMemcpyPeerAsync_ptsz(dst: u64, dc: *mut c_void, src: u64, sc: *mut c_void, n: usize, s: *mut c_void) {
        // SAFETY: `on` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { on(s, true) }?;
        // SAFETY: `peer` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { peer(dst, dc, src, sc, n) }
    }
    // SAFETY: `htod` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { htod(dst, src, n) } }
    // SAFETY: `htod` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyHtoD_v2_ptds(dst: u64, src: *const c_void, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { htod(dst, src, n) } }
    // SAFETY: `on`, `htod` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { htod(dst, src, n) } }
    // SAFETY: `on`, `htod` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyHtoDAsync_v2_ptsz(dst: u64, src: *const c_void, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { htod(dst, src, n) } }
    // SAFETY: `dtoh` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { dtoh(dst, src, n) } }
    // SAFETY: `dtoh` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: u64, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { dtoh(dst, src, n) } }
    // SAFETY: `on`, `dtoh` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { dtoh(dst, src, n) } }
    // SAFETY: `on`, `dtoh` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { dtoh(dst, src, n) } }
    // SAFETY: `dtod` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyDtoD_v2(dst: u64, src: u64, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { dtod(dst, src, n) } }
    // SAFETY: `dtod` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyDtoD_v2_ptds(dst: u64, src: u64, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { dtod(dst, src, n) } }
    // SAFETY: `on`, `dtod` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { dtod(dst, src, n) } }
    // SAFETY: `on`, `dtod` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyDtoDAsync_v2_ptsz(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { dtod(dst, src, n) } }
}
