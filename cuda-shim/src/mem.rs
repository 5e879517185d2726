//! Memory quota on every allocation path (the exports; the work is in
//! `mem/`).
//!
//! - `quota.rs`: reserve in the container ledger -> call the driver -> give
//!   back on failure; frees return what the process-local table says.
//! - `arrays.rs`: what arrays and pitched allocations are charged.
//! - `pool.rs`: stream-ordered pools are charged what they reserve.
//! - `vmm.rs`: `cuMemCreate` on the host is free; a handle released while
//!   mapped keeps its bytes until unmapped, a retained one until its last
//!   release.
//! - `ctx.rs`: a context that goes away gives its allocations back; calls
//!   that take hidden memory (contexts, modules, heap) reconcile at once.
//! - `reconcile.rs`: the reservation is max(counted, NVML's measured).

mod arrays;
mod ctx;
mod local;
mod pool;
mod quota;
mod reconcile;

pub(crate) use reconcile::{Procs, compute_processes, procs_fn};
mod vmm;

pub use arrays::{
    Array3dDesc, Array3dDescV1, ArrayDesc, ArrayDescV1, array_bytes, format_bytes, mipmapped_bytes,
};
pub(crate) use quota::{InFlight, release_reserved, reserve_for};
pub use reconcile::extra as reconciled_extra;
pub(crate) use reconcile::{fresh as measure_if_stale, launched};

use crate::qos::Synced;
use crate::real::real_cuda;
use crate::table::Kind;
use crate::{arg, written};
use arrays::pitch_estimate;
use cuda_abi::CUresult;
use quota::{alloc, alloc_on, alloc_sized, free};
use std::ffi::{c_char, c_void};

type Stream = *mut c_void;

/// The watcher thread's periodic work: pools and the NVML reconcile.
pub fn reconcile_tick() {
    reconcile::tick();
}

type AllocV2 = unsafe extern "C" fn(*mut u64, usize) -> CUresult;
type FreeV2 = unsafe extern "C" fn(u64) -> CUresult;
type AllocAsync = unsafe extern "C" fn(*mut u64, usize, Stream) -> CUresult;
type AllocPool = unsafe extern "C" fn(*mut u64, usize, *mut c_void, Stream) -> CUresult;
type FreeAsync = unsafe extern "C" fn(u64, Stream) -> CUresult;

cuda_exports! {
    fn cuMemAlloc_v2(dptr: *mut u64, bytesize: usize) {
        let f = real_cuda!(cuMemAlloc_v2: AllocV2);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(bytesize as u64, Kind::Ptr, || unsafe { f(dptr, bytesize) }, || written(dptr).unwrap_or(0))
    }

    fn cuMemAlloc(dptr: *mut u32, bytesize: u32) {
        let f = real_cuda!(cuMemAlloc: unsafe extern "C" fn(*mut u32, u32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(bytesize as u64, Kind::Ptr, || unsafe { f(dptr, bytesize) }, || written(dptr).map_or(0, u64::from))
    }

    fn cuMemAllocManaged(dptr: *mut u64, bytesize: usize, flags: u32) {
        let f = real_cuda!(cuMemAllocManaged: unsafe extern "C" fn(*mut u64, usize, u32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(bytesize as u64, Kind::Ptr, || unsafe { f(dptr, bytesize, flags) }, || written(dptr).unwrap_or(0))
    }

    fn cuMemAllocPitch_v2(dptr: *mut u64, pitch: *mut usize, width: usize, height: usize, elem: u32) {
        let f = real_cuda!(cuMemAllocPitch_v2: unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, u32) -> CUresult);
        let free_fn = real_cuda!(cuMemFree_v2: FreeV2);
        alloc_sized(
            quota::On::Current,
            pitch_estimate(width as u64, height as u64),
            Kind::Ptr,
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            || unsafe { f(dptr, pitch, width, height, elem) },
            || (written(dptr).unwrap_or(0), written(pitch).map_or(0, |p| p as u64).saturating_mul(height as u64)),
            |k| {
                // SAFETY: the real driver's function of this exact signature, resolved by
                // name; pointers are our caller's (passed on unchanged) or our own locals.
                unsafe { free_fn(k) };
            },
        )
    }

    fn cuMemAllocPitch(dptr: *mut u32, pitch: *mut u32, width: u32, height: u32, elem: u32) {
        let f = real_cuda!(cuMemAllocPitch: unsafe extern "C" fn(*mut u32, *mut u32, u32, u32, u32) -> CUresult);
        let free_fn = real_cuda!(cuMemFree: unsafe extern "C" fn(u32) -> CUresult);
        alloc_sized(
            quota::On::Current,
            pitch_estimate(width as u64, height as u64),
            Kind::Ptr,
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            || unsafe { f(dptr, pitch, width, height, elem) },
            || (written(dptr).map_or(0, u64::from), written(pitch).map_or(0, u64::from).saturating_mul(height as u64)),
            |k| {
                // SAFETY: the real driver's function of this exact signature, resolved by
                // name; pointers are our caller's (passed on unchanged) or our own locals.
                unsafe { free_fn(k as u32) };
            },
        )
    }

    fn cuMemFree_v2(dptr: u64) {
        let f = real_cuda!(cuMemFree_v2: FreeV2);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        free(Kind::Ptr, dptr, || unsafe { f(dptr) })
    }

    fn cuMemFree(dptr: u32) {
        let f = real_cuda!(cuMemFree: unsafe extern "C" fn(u32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        free(Kind::Ptr, dptr as u64, || unsafe { f(dptr) })
    }

    fn cuArrayCreate_v2(handle: *mut *mut c_void, desc: *const ArrayDesc) {
        let f = real_cuda!(cuArrayCreate_v2: unsafe extern "C" fn(*mut *mut c_void, *const ArrayDesc) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let Some(d) = arg(desc) else { return unsafe { f(handle, desc) } };
        let bytes = array_bytes(d.width as u64, d.height as u64, 1, d.format, d.num_channels);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(bytes, Kind::Array, || unsafe { f(handle, desc) }, || written(handle).map_or(0, |h| h as u64))
    }

    fn cuArrayCreate(handle: *mut *mut c_void, desc: *const ArrayDescV1) {
        let f = real_cuda!(cuArrayCreate: unsafe extern "C" fn(*mut *mut c_void, *const ArrayDescV1) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let Some(d) = arg(desc) else { return unsafe { f(handle, desc) } };
        let bytes = array_bytes(d.width as u64, d.height as u64, 1, d.format, d.num_channels);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(bytes, Kind::Array, || unsafe { f(handle, desc) }, || written(handle).map_or(0, |h| h as u64))
    }

    fn cuArray3DCreate_v2(handle: *mut *mut c_void, desc: *const Array3dDesc) {
        let f = real_cuda!(cuArray3DCreate_v2: unsafe extern "C" fn(*mut *mut c_void, *const Array3dDesc) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let Some(d) = arg(desc) else { return unsafe { f(handle, desc) } };
        let bytes = array_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.num_channels);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(bytes, Kind::Array, || unsafe { f(handle, desc) }, || written(handle).map_or(0, |h| h as u64))
    }

    fn cuArray3DCreate(handle: *mut *mut c_void, desc: *const Array3dDescV1) {
        let f = real_cuda!(cuArray3DCreate: unsafe extern "C" fn(*mut *mut c_void, *const Array3dDescV1) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let Some(d) = arg(desc) else { return unsafe { f(handle, desc) } };
        let bytes = array_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.num_channels);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(bytes, Kind::Array, || unsafe { f(handle, desc) }, || written(handle).map_or(0, |h| h as u64))
    }

    fn cuArrayDestroy(handle: *mut c_void) {
        let f = real_cuda!(cuArrayDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        free(Kind::Array, handle as u64, || unsafe { f(handle) })
    }

    fn cuMipmappedArrayCreate(handle: *mut *mut c_void, desc: *const Array3dDesc, levels: u32) {
        let f = real_cuda!(cuMipmappedArrayCreate: unsafe extern "C" fn(*mut *mut c_void, *const Array3dDesc, u32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let Some(d) = arg(desc) else { return unsafe { f(handle, desc, levels) } };
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc(mipmapped_bytes(d, levels), Kind::Mipmapped, || unsafe { f(handle, desc, levels) }, || written(handle).map_or(0, |h| h as u64))
    }

    fn cuMipmappedArrayDestroy(handle: *mut c_void) {
        let f = real_cuda!(cuMipmappedArrayDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        free(Kind::Mipmapped, handle as u64, || unsafe { f(handle) })
    }

    fn cuMemCreate(handle: *mut u64, size: usize, prop: *const c_void, flags: u64) {
        let f = real_cuda!(cuMemCreate: unsafe extern "C" fn(*mut u64, usize, *const c_void, u64) -> CUresult);
        // SAFETY: `prop` is our caller's `CUmemAllocationProp` or NULL (CUDA ABI).
        if unsafe { vmm::host_location(prop) } {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(handle, size, prop, flags) }; // host memory: no device bytes
        }
        // SAFETY: `prop` is our caller's `CUmemAllocationProp` or NULL (CUDA ABI).
        let on = unsafe { vmm::location_device(prop) }.map_or(quota::On::Current, quota::On::Device);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        alloc_on(on, size as u64, Kind::Generic, || unsafe { f(handle, size, prop, flags) }, || written(handle).unwrap_or(0))
    }

    fn cuMemRelease(handle: u64) {
        let f = real_cuda!(cuMemRelease: unsafe extern "C" fn(u64) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        vmm::release(handle, || unsafe { f(handle) })
    }

    fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) {
        let f = real_cuda!(cuMemRetainAllocationHandle: unsafe extern "C" fn(*mut u64, *mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(handle, addr) };
        if r == cuda_abi::CUDA_SUCCESS {
            vmm::retained(written(handle).unwrap_or(0));
        }
        r
    }

    fn cuMemMap(ptr: u64, size: usize, offset: usize, handle: u64, flags: u64) {
        let f = real_cuda!(cuMemMap: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(ptr, size, offset, handle, flags) };
        if r == cuda_abi::CUDA_SUCCESS {
            vmm::mapped(ptr, size as u64, handle);
        }
        r
    }

    fn cuMemUnmap(ptr: u64, size: usize) {
        let f = real_cuda!(cuMemUnmap: unsafe extern "C" fn(u64, usize) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(ptr, size) };
        if r == cuda_abi::CUDA_SUCCESS {
            vmm::unmapped(ptr, size as u64);
        }
        r
    }

    fn cuMemAllocAsync(dptr: *mut u64, bytesize: usize, stream: Stream) {
        let f = real_cuda!(cuMemAllocAsync: AllocAsync);
        let undo = real_cuda!(cuMemFreeAsync: FreeAsync);
        if crate::graph::captured(stream, false) {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dptr, bytesize, stream) }; // a graph alloc node: reserved at instantiation
        }
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        pool::alloc(bytesize as u64, None, || unsafe { f(dptr, bytesize, stream) }, || written(dptr).unwrap_or(0), |p| {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { undo(p, stream) };
        })
    }

    fn cuMemAllocAsync_ptsz(dptr: *mut u64, bytesize: usize, stream: Stream) {
        let f = real_cuda!(cuMemAllocAsync_ptsz: AllocAsync);
        let undo = real_cuda!(cuMemFreeAsync_ptsz: FreeAsync);
        if crate::graph::captured(stream, true) {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dptr, bytesize, stream) }; // a graph alloc node: reserved at instantiation
        }
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        pool::alloc(bytesize as u64, None, || unsafe { f(dptr, bytesize, stream) }, || written(dptr).unwrap_or(0), |p| {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { undo(p, stream) };
        })
    }

    fn cuMemAllocFromPoolAsync(dptr: *mut u64, bytesize: usize, mpool: *mut c_void, stream: Stream) {
        let f = real_cuda!(cuMemAllocFromPoolAsync: AllocPool);
        let undo = real_cuda!(cuMemFreeAsync: FreeAsync);
        if crate::graph::captured(stream, false) {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dptr, bytesize, mpool, stream) }; // a graph alloc node: reserved at instantiation
        }
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        pool::alloc(bytesize as u64, Some(mpool as u64), || unsafe { f(dptr, bytesize, mpool, stream) }, || written(dptr).unwrap_or(0), |p| {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { undo(p, stream) };
        })
    }

    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut u64, bytesize: usize, mpool: *mut c_void, stream: Stream) {
        let f = real_cuda!(cuMemAllocFromPoolAsync_ptsz: AllocPool);
        let undo = real_cuda!(cuMemFreeAsync_ptsz: FreeAsync);
        if crate::graph::captured(stream, true) {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            return unsafe { f(dptr, bytesize, mpool, stream) }; // a graph alloc node: reserved at instantiation
        }
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        pool::alloc(bytesize as u64, Some(mpool as u64), || unsafe { f(dptr, bytesize, mpool, stream) }, || written(dptr).unwrap_or(0), |p| {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { undo(p, stream) };
        })
    }

    fn cuMemFreeAsync(dptr: u64, stream: Stream) {
        let f = real_cuda!(cuMemFreeAsync: FreeAsync);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        pool::free(dptr, || unsafe { f(dptr, stream) })
    }

    fn cuMemFreeAsync_ptsz(dptr: u64, stream: Stream) {
        let f = real_cuda!(cuMemFreeAsync_ptsz: FreeAsync);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        pool::free(dptr, || unsafe { f(dptr, stream) })
    }

    // ---- what makes pools give memory back ----

    fn cuMemPoolTrimTo(mpool: *mut c_void, keep: usize) {
        let f = real_cuda!(cuMemPoolTrimTo: unsafe extern "C" fn(*mut c_void, usize) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(mpool, keep) };
        pool::settle_all();
        r
    }

    fn cuMemPoolSetAttribute(mpool: *mut c_void, attr: i32, value: *mut c_void) {
        let f = real_cuda!(cuMemPoolSetAttribute: unsafe extern "C" fn(*mut c_void, i32, *mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(mpool, attr, value) };
        pool::settle_all();
        r
    }

    fn cuMemPoolDestroy(mpool: *mut c_void) {
        let f = real_cuda!(cuMemPoolDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(mpool) };
        if r == cuda_abi::CUDA_SUCCESS {
            pool::after_destroy(mpool as u64);
        }
        r
    }

    fn cuStreamSynchronize(stream: Stream) {
        let f = real_cuda!(cuStreamSynchronize: unsafe extern "C" fn(Stream) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(stream) };
        pool::settle_all();
        crate::qos::after_sync(r, Synced::Stream(stream, false));
        r
    }

    fn cuStreamSynchronize_ptsz(stream: Stream) {
        let f = real_cuda!(cuStreamSynchronize_ptsz: unsafe extern "C" fn(Stream) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(stream) };
        pool::settle_all();
        crate::qos::after_sync(r, Synced::Stream(stream, true));
        r
    }

    fn cuCtxSynchronize() {
        let f = real_cuda!(cuCtxSynchronize: unsafe extern "C" fn() -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f() };
        pool::settle_all();
        crate::qos::after_sync(r, Synced::Current);
        r
    }

    fn cuCtxSynchronize_v2(ctx: *mut c_void) {
        let f = real_cuda!(cuCtxSynchronize_v2: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(ctx) };
        pool::settle_all();
        crate::qos::after_sync(r, Synced::Ctx(ctx));
        r
    }

    fn cuEventSynchronize(event: *mut c_void) {
        let f = real_cuda!(cuEventSynchronize: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(event) };
        pool::settle_all();
        crate::qos::after_sync(r, Synced::Event(event));
        r
    }

    // A process that polls for its work's end (servers often do) instead of
    // synchronising: a query that says done is its synchronize for the
    // compute tiers (the pool's settling is left to the synchronizes).
    fn cuStreamQuery(stream: Stream) {
        let f = real_cuda!(cuStreamQuery: unsafe extern "C" fn(Stream) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(stream) };
        crate::qos::after_sync(r, Synced::Stream(stream, false));
        r
    }

    fn cuStreamQuery_ptsz(stream: Stream) {
        let f = real_cuda!(cuStreamQuery_ptsz: unsafe extern "C" fn(Stream) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(stream) };
        crate::qos::after_sync(r, Synced::Stream(stream, true));
        r
    }

    fn cuEventQuery(event: *mut c_void) {
        let f = real_cuda!(cuEventQuery: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(event) };
        crate::qos::after_sync(r, Synced::Event(event));
        r
    }

    // ---- contexts ----

    // The CUDA 2.0 entry (cuda.h's signature is _v2's): NVIDIA's drivers still
    // hand it out for cuGetProcAddress("cuCtxCreate", < 3020).
    fn cuCtxCreate(out: *mut *mut c_void, flags: u32, dev: i32) {
        if let Err(e) = crate::devices::allowed(dev) {
            return e; // a GPU outside the container's share
        }
        let f = real_cuda!(cuCtxCreate: unsafe extern "C" fn(*mut *mut c_void, u32, i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, flags, dev) }, || ctx::destroy(written(out).unwrap_or(std::ptr::null_mut())))
    }

    fn cuCtxCreate_v2(out: *mut *mut c_void, flags: u32, dev: i32) {
        if let Err(e) = crate::devices::allowed(dev) {
            return e; // a GPU outside the container's share
        }
        let f = real_cuda!(cuCtxCreate_v2: unsafe extern "C" fn(*mut *mut c_void, u32, i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, flags, dev) }, || ctx::destroy(written(out).unwrap_or(std::ptr::null_mut())))
    }

    fn cuCtxCreate_v3(out: *mut *mut c_void, params: *mut c_void, n: i32, flags: u32, dev: i32) {
        if let Err(e) = crate::devices::allowed(dev) {
            return e; // a GPU outside the container's share
        }
        let f = real_cuda!(cuCtxCreate_v3: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, i32, u32, i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, params, n, flags, dev) }, || ctx::destroy(written(out).unwrap_or(std::ptr::null_mut())))
    }

    fn cuCtxCreate_v4(out: *mut *mut c_void, params: *mut c_void, flags: u32, dev: i32) {
        if let Err(e) = crate::devices::allowed(dev) {
            return e; // a GPU outside the container's share
        }
        let f = real_cuda!(cuCtxCreate_v4: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u32, i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, params, flags, dev) }, || ctx::destroy(written(out).unwrap_or(std::ptr::null_mut())))
    }

    fn cuCtxDestroy(c: *mut c_void) {
        let f = real_cuda!(cuCtxDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(c) };
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::drop_ctx(c as u64);
            ctx::after_hidden_change();
        }
        r
    }

    fn cuCtxDestroy_v2(c: *mut c_void) {
        let f = real_cuda!(cuCtxDestroy_v2: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(c) };
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::drop_ctx(c as u64);
            ctx::after_hidden_change();
        }
        r
    }

    fn cuDevicePrimaryCtxRetain(out: *mut *mut c_void, dev: i32) {
        if let Err(e) = crate::devices::allowed(dev) {
            return e; // a GPU outside the container's share
        }
        let f = real_cuda!(cuDevicePrimaryCtxRetain: unsafe extern "C" fn(*mut *mut c_void, i32) -> CUresult);
        let release = real_cuda!(cuDevicePrimaryCtxRelease_v2: unsafe extern "C" fn(i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = ctx::hidden(|| unsafe { f(out, dev) }, || {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { release(dev) };
            ctx::primary_released(dev);
        });
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::retained(dev, written(out).map_or(0, |c| c as u64));
        }
        r
    }

    fn cuDevicePrimaryCtxRelease(dev: i32) {
        let f = real_cuda!(cuDevicePrimaryCtxRelease: unsafe extern "C" fn(i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(dev) };
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::primary_released(dev);
        }
        r
    }

    fn cuDevicePrimaryCtxRelease_v2(dev: i32) {
        let f = real_cuda!(cuDevicePrimaryCtxRelease_v2: unsafe extern "C" fn(i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(dev) };
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::primary_released(dev);
        }
        r
    }

    fn cuDevicePrimaryCtxReset(dev: i32) {
        let f = real_cuda!(cuDevicePrimaryCtxReset: unsafe extern "C" fn(i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(dev) };
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::primary_reset(dev);
        }
        r
    }

    fn cuDevicePrimaryCtxReset_v2(dev: i32) {
        let f = real_cuda!(cuDevicePrimaryCtxReset_v2: unsafe extern "C" fn(i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(dev) };
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::primary_reset(dev);
        }
        r
    }

    fn cuCtxSetLimit(limit: i32, value: usize) {
        let f = real_cuda!(cuCtxSetLimit: unsafe extern "C" fn(i32, usize) -> CUresult);
        let get = real_cuda!(cuCtxGetLimit: unsafe extern "C" fn(*mut usize, i32) -> CUresult);
        let mut old = 0usize;
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let had = unsafe { get(&mut old, limit) } == cuda_abi::CUDA_SUCCESS;
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(limit, value) }, || {
            if had {
                // SAFETY: the real driver's function of this exact signature, resolved by
                // name; pointers are our caller's (passed on unchanged) or our own locals.
                unsafe { f(limit, old) };
            }
        })
    }

    // ---- module images ----

    fn cuModuleLoad(out: *mut *mut c_void, fname: *const c_char) {
        let f = real_cuda!(cuModuleLoad: unsafe extern "C" fn(*mut *mut c_void, *const c_char) -> CUresult);
        let unload = real_cuda!(cuModuleUnload: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, fname) }, || {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { unload(written(out).unwrap_or(std::ptr::null_mut())) };
        })
    }

    fn cuModuleLoadData(out: *mut *mut c_void, image: *const c_void) {
        let f = real_cuda!(cuModuleLoadData: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CUresult);
        let unload = real_cuda!(cuModuleUnload: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, image) }, || {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { unload(written(out).unwrap_or(std::ptr::null_mut())) };
        })
    }

    fn cuModuleLoadDataEx(out: *mut *mut c_void, image: *const c_void, n: u32, opts: *mut c_void, vals: *mut *mut c_void) {
        let f = real_cuda!(cuModuleLoadDataEx: unsafe extern "C" fn(*mut *mut c_void, *const c_void, u32, *mut c_void, *mut *mut c_void) -> CUresult);
        let unload = real_cuda!(cuModuleUnload: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, image, n, opts, vals) }, || {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { unload(written(out).unwrap_or(std::ptr::null_mut())) };
        })
    }

    fn cuModuleLoadFatBinary(out: *mut *mut c_void, image: *const c_void) {
        let f = real_cuda!(cuModuleLoadFatBinary: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CUresult);
        let unload = real_cuda!(cuModuleUnload: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ctx::hidden(|| unsafe { f(out, image) }, || {
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            unsafe { unload(written(out).unwrap_or(std::ptr::null_mut())) };
        })
    }

    fn cuModuleUnload(m: *mut c_void) {
        let f = real_cuda!(cuModuleUnload: unsafe extern "C" fn(*mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(m) };
        if r == cuda_abi::CUDA_SUCCESS {
            ctx::after_hidden_change();
        }
        r
    }
}
