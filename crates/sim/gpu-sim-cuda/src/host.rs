//! Pinned host memory: page-locked allocations (plain anonymous mappings in
//! the simulator) and host registration.

use crate::ctx::current;
use crate::mem::{PAGE, map_anon, round_up};
use crate::{R, drv, lock, put};
use cuda_abi::*;
use std::ffi::c_void;

unsafe fn host_alloc(out: *mut *mut c_void, size: usize) -> R {
    let d = drv()?;
    current()?;
    crate::capture_mode::unsafe_call()?;
    if out.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let len = round_up(size, PAGE);
    // SAFETY: plain anonymous mapping of `len` bytes; see map_anon.
    let p = unsafe { map_anon(len, libc::PROT_READ | libc::PROT_WRITE)? };
    lock(&d.mem.host).insert(p as u64, len);
    put(out, p)?;
    Ok(())
}

cuda_fn! {
    fn cuMemAllocHost_v2(out: *mut *mut c_void, size: usize) {
        // SAFETY: `host_alloc` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { host_alloc(out, size) }
    }

    fn cuMemHostAlloc(out: *mut *mut c_void, size: usize, _flags: u32) {
        // SAFETY: `host_alloc` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { host_alloc(out, size) }
    }

    fn cuMemFreeHost(p: *mut c_void) {
        let d = drv()?;
        crate::capture_mode::unsafe_call()?;
        if p.is_null() {
            return Ok(()); // free(NULL) semantics, as NVIDIA's driver
        }
        let len = lock(&d.mem.host).remove(&(p as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `p`/`len` is a mapping `host_alloc` made and recorded in
        // `host`; removing the record above makes this its only unmap.
        unsafe { libc::munmap(p, len) };
        Ok(())
    }

    fn cuMemHostGetDevicePointer_v2(out: *mut u64, p: *mut c_void, flags: u32) {
        drv()?;
        if flags != 0 || p.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, p as u64)
    }

    fn cuMemHostRegister_v2(p: *mut c_void, size: usize, _flags: u32) {
        drv()?;
        if p.is_null() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }

    fn cuMemHostUnregister(p: *mut c_void) {
        drv()?;
        if p.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
}
