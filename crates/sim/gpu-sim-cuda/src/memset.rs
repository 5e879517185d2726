//! Memory sets: `cuMemsetD8/16/32` and their 2D forms, synchronous and
//! async.

use crate::ctx::current;
use crate::memcpy::on;
use crate::{R, drv};
use cuda_abi::*;
use std::ffi::c_void;

unsafe fn set<T: Copy>(dst: u64, v: T, n: usize) -> R {
    let d = drv()?;
    current()?;
    d.mem.check(dst, n * size_of::<T>())?;
    if dst as usize & (align_of::<T>() - 1) != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = dst as *mut T;
    for i in 0..n {
        // SAFETY: `dst`..+n*size_of::<T>() was checked as device memory of ours and `dst` is
        // T-aligned (both checked above).
        unsafe { p.add(i).write(v) };
    }
    Ok(())
}

unsafe fn set2d<T: Copy>(dst: u64, pitch: usize, v: T, w: usize, h: usize) -> R {
    for row in 0..h {
        // SAFETY: each row starts inside the caller's pitched 2D range; `set` checks every row
        // against our allocations.
        unsafe { set(dst + (row * pitch) as u64, v, w)? };
    }
    Ok(())
}

cuda_fn! {
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD8_v2(dst: u64, v: u8, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD8_v2_ptds(dst: u64, v: u8, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD16_v2(dst: u64, v: u16, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD16_v2_ptds(dst: u64, v: u16, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD32_v2(dst: u64, v: u32, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD32_v2_ptds(dst: u64, v: u32, n: usize) { crate::capture_mode::unsafe_call()?; unsafe { set(dst, v, n) } }
    // SAFETY: `on`, `set` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemsetD8Async(dst: u64, v: u8, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { set(dst, v, n) } }
    // SAFETY: `on`, `set` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemsetD8Async_ptsz(dst: u64, v: u8, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { set(dst, v, n) } }
    // SAFETY: `on`, `set` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemsetD16Async(dst: u64, v: u16, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { set(dst, v, n) } }
    // SAFETY: `on`, `set` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemsetD16Async_ptsz(dst: u64, v: u16, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { set(dst, v, n) } }
    // SAFETY: `on`, `set` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemsetD32Async(dst: u64, v: u32, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { set(dst, v, n) } }
    // SAFETY: `on`, `set` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemsetD32Async_ptsz(dst: u64, v: u32, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { set(dst, v, n) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D8_v2(dst: u64, pitch: usize, v: u8, w: usize, h: usize) { crate::capture_mode::unsafe_call()?; unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D8_v2_ptds(dst: u64, pitch: usize, v: u8, w: usize, h: usize) { crate::capture_mode::unsafe_call()?; unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D16_v2(dst: u64, pitch: usize, v: u16, w: usize, h: usize) { crate::capture_mode::unsafe_call()?; unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D16_v2_ptds(dst: u64, pitch: usize, v: u16, w: usize, h: usize) { crate::capture_mode::unsafe_call()?; unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D32_v2(dst: u64, pitch: usize, v: u32, w: usize, h: usize) { crate::capture_mode::unsafe_call()?; unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D32_v2_ptds(dst: u64, pitch: usize, v: u32, w: usize, h: usize) { crate::capture_mode::unsafe_call()?; unsafe { set2d(dst, pitch, v, w, h) } }
}
