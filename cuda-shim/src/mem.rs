//! Memory quota on every allocation path.
//!
//! Reserve in the container ledger (atomic against the quota, across every
//! process of the container) -> call the driver -> on failure give the
//! reservation back; on success remember the size, which the matching free
//! returns. Over quota is `CUDA_ERROR_OUT_OF_MEMORY` without calling the
//! driver, counted in the ledger (`refused_allocations`) once per refused
//! call, here in [`alloc_sized`] where every allocation path passes.

use crate::config;
use crate::log::log;
use crate::real::real_cuda;
use crate::registration::{REFUSED, proc};
use crate::table::Kind;
use cuda_abi::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

type Stream = *mut c_void;

/// Runs `call` under a reservation of `bytes`; `key` names the new
/// allocation (read only after success).
#[inline]
fn alloc(
    bytes: u64,
    kind: Kind,
    call: impl FnOnce() -> CUresult,
    key: impl FnOnce() -> u64,
) -> CUresult {
    alloc_sized(bytes, kind, call, || (key(), bytes), |_| {})
}

/// [`alloc`] for calls whose final size is known only afterwards:
/// `result` returns (key, actual bytes); if more than reserved and the
/// difference does not fit, `undo` frees the allocation and the call fails
/// with OUT_OF_MEMORY.
fn alloc_sized(
    estimate: u64,
    kind: Kind,
    call: impl FnOnce() -> CUresult,
    result: impl FnOnce() -> (u64, u64),
    undo: impl FnOnce(u64),
) -> CUresult {
    if config::enforce().is_none() {
        return call();
    }
    let p = proc();
    if let Err(e) = p.ensure_registered() {
        return e;
    }
    let guard = p.attach();
    let Some(a) = guard.as_ref() else {
        return REFUSED;
    };
    if estimate == 0 {
        // The driver rejects empty allocations; nothing to reserve.
        return call();
    }
    if let Err(over) = a.ledger.try_reserve(a.slot, estimate) {
        log!(Info, "allocation refused: {over}");
        a.ledger.count_refused_allocation();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let r = call();
    if r != CUDA_SUCCESS {
        a.ledger.release(a.slot, estimate);
        return r;
    }
    let (key, actual) = result();
    if actual > estimate {
        if let Err(over) = a.ledger.try_reserve(a.slot, actual - estimate) {
            log!(Info, "allocation refused after padding: {over}");
            undo(key);
            a.ledger.release(a.slot, estimate);
            a.ledger.count_refused_allocation();
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if actual < estimate {
        a.ledger.release(a.slot, estimate - actual);
    }
    p.table.insert(kind, key, actual);
    p.local_used.fetch_add(actual, Ordering::AcqRel);
    r
}

/// Reserves `bytes` the driver allocates outside an allocation call (graph
/// memory, see graph.rs): `call` runs only if they fit (else
/// OUT_OF_MEMORY, counted as a refusal), and they are given back if it
/// fails. Not in the allocation table: the caller keeps track and returns
/// them with [`release_reserved`].
pub(crate) fn reserve_for(bytes: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if config::enforce().is_none() || bytes == 0 {
        return call();
    }
    let p = proc();
    if let Err(e) = p.ensure_registered() {
        return e;
    }
    let guard = p.attach();
    let Some(a) = guard.as_ref() else {
        return REFUSED;
    };
    if let Err(over) = a.ledger.try_reserve(a.slot, bytes) {
        log!(Info, "graph memory refused: {over}");
        a.ledger.count_refused_allocation();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let r = call();
    if r == CUDA_SUCCESS {
        p.local_used.fetch_add(bytes, Ordering::AcqRel);
    } else {
        a.ledger.release(a.slot, bytes);
    }
    r
}

/// Gives back bytes taken with [`reserve_for`].
pub(crate) fn release_reserved(bytes: u64) {
    if config::enforce().is_none() || bytes == 0 {
        return;
    }
    let p = proc();
    if let Some(a) = p.attach().as_ref() {
        a.ledger.release(a.slot, bytes);
    }
    p.local_used.fetch_sub(bytes, Ordering::AcqRel);
}

/// Runs the free `call` and gives the allocation's bytes back on success.
#[inline]
fn free(kind: Kind, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if config::enforce().is_none() {
        return call();
    }
    let p = proc();
    // Taken out first: the same address may be handed out again the moment
    // the driver frees it.
    let Some(bytes) = p.table.remove(kind, key) else {
        return call();
    };
    let guard = p.attach();
    let r = call();
    if r != CUDA_SUCCESS {
        p.table.insert(kind, key, bytes);
        return r;
    }
    if let Some(a) = guard.as_ref() {
        a.ledger.release(a.slot, bytes);
    }
    p.local_used.fetch_sub(bytes, Ordering::AcqRel);
    r
}

/// `CUDA_ARRAY_DESCRIPTOR` (`_v2`: size_t extents).
#[repr(C)]
pub struct ArrayDesc {
    pub width: usize,
    pub height: usize,
    pub format: u32,
    pub num_channels: u32,
}

/// The legacy `CUDA_ARRAY_DESCRIPTOR_v1` (unsigned int extents).
#[repr(C)]
pub struct ArrayDescV1 {
    pub width: u32,
    pub height: u32,
    pub format: u32,
    pub num_channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`_v2`).
#[repr(C)]
pub struct Array3dDesc {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

/// The legacy `CUDA_ARRAY3D_DESCRIPTOR_v1`.
#[repr(C)]
pub struct Array3dDescV1 {
    pub width: u32,
    pub height: u32,
    pub depth: u32,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

const CUDA_ARRAY3D_LAYERED: u32 = 0x01;
const CUDA_ARRAY3D_CUBEMAP: u32 = 0x04;

/// Bytes per element of one channel of a `CUarray_format`. Block-compressed
/// and video formats are charged one byte per pixel or more (over, never
/// under, the real size); unknown formats 16 bytes.
pub fn format_bytes(format: u32) -> u64 {
    match format {
        0x01 | 0x08 => 1,               // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2,        // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4,        // (UN)SIGNED_INT32, FLOAT
        0xc0 | 0xc6 => 1,               // UNORM/SNORM_INT8X1
        0xc1 | 0xc7 | 0xc3 | 0xc9 => 2, // INT8X2, INT16X1
        0xc2 | 0xc8 | 0xc4 | 0xca => 4, // INT8X4, INT16X2
        0xc5 | 0xcb => 8,               // INT16X4
        0x91..=0x9e => 1,               // BC1..BC7 (<= 1 byte per pixel)
        0xb0 => 2,                      // NV12 (1.5 bytes per pixel)
        _ => 16,
    }
}

/// Bytes of an array of `w` x `h` x `d` elements (0 extents count as 1).
pub fn array_bytes(w: u64, h: u64, d: u64, format: u32, channels: u32) -> u64 {
    w.max(1)
        .saturating_mul(h.max(1))
        .saturating_mul(d.max(1))
        .saturating_mul(format_bytes(format))
        .saturating_mul(u64::from(channels.max(1)))
}

/// Bytes of a mipmapped array: every level halves each extent (but not the
/// layer count of layered or cubemap arrays).
pub fn mipmapped_bytes(desc: &Array3dDesc, levels: u32) -> u64 {
    let keep_depth = desc.flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
    let (w, h, d) = (desc.width as u64, desc.height as u64, desc.depth as u64);
    (0..levels.clamp(1, 64)).fold(0u64, |acc, l| {
        let half = |x: u64| if x == 0 { 0 } else { (x >> l).max(1) };
        let dd = if keep_depth { d } else { half(d) };
        acc.saturating_add(array_bytes(
            half(w),
            half(h),
            dd,
            desc.format,
            desc.num_channels,
        ))
    })
}

/// Pitch the driver will most likely choose: rows padded to 512 bytes.
fn pitch_estimate(width: u64, height: u64) -> u64 {
    width
        .div_ceil(512)
        .saturating_mul(512)
        .saturating_mul(height.max(1))
}

type AllocV2 = unsafe extern "C" fn(*mut u64, usize) -> CUresult;
type FreeV2 = unsafe extern "C" fn(u64) -> CUresult;
type AllocAsync = unsafe extern "C" fn(*mut u64, usize, Stream) -> CUresult;
type AllocPool = unsafe extern "C" fn(*mut u64, usize, *mut c_void, Stream) -> CUresult;
type FreeAsync = unsafe extern "C" fn(u64, Stream) -> CUresult;

cuda_exports! {
    fn cuMemAlloc_v2(dptr: *mut u64, bytesize: usize) {
        let f = real_cuda!(cuMemAlloc_v2: AllocV2);
        alloc(bytesize as u64, Kind::Ptr, || f(dptr, bytesize), || *dptr)
    }

    fn cuMemAlloc(dptr: *mut u32, bytesize: u32) {
        let f = real_cuda!(cuMemAlloc: unsafe extern "C" fn(*mut u32, u32) -> CUresult);
        alloc(bytesize as u64, Kind::Ptr, || f(dptr, bytesize), || *dptr as u64)
    }

    fn cuMemAllocManaged(dptr: *mut u64, bytesize: usize, flags: u32) {
        let f = real_cuda!(cuMemAllocManaged: unsafe extern "C" fn(*mut u64, usize, u32) -> CUresult);
        alloc(bytesize as u64, Kind::Ptr, || f(dptr, bytesize, flags), || *dptr)
    }

    fn cuMemAllocPitch_v2(dptr: *mut u64, pitch: *mut usize, width: usize, height: usize, elem: u32) {
        let f = real_cuda!(cuMemAllocPitch_v2: unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, u32) -> CUresult);
        let free_fn = real_cuda!(cuMemFree_v2: FreeV2);
        alloc_sized(
            pitch_estimate(width as u64, height as u64),
            Kind::Ptr,
            || f(dptr, pitch, width, height, elem),
            || (*dptr, (*pitch as u64).saturating_mul(height as u64)),
            |k| {
                free_fn(k);
            },
        )
    }

    fn cuMemAllocPitch(dptr: *mut u32, pitch: *mut u32, width: u32, height: u32, elem: u32) {
        let f = real_cuda!(cuMemAllocPitch: unsafe extern "C" fn(*mut u32, *mut u32, u32, u32, u32) -> CUresult);
        let free_fn = real_cuda!(cuMemFree: unsafe extern "C" fn(u32) -> CUresult);
        alloc_sized(
            pitch_estimate(width as u64, height as u64),
            Kind::Ptr,
            || f(dptr, pitch, width, height, elem),
            || (*dptr as u64, (*pitch as u64).saturating_mul(height as u64)),
            |k| {
                free_fn(k as u32);
            },
        )
    }

    fn cuMemFree_v2(dptr: u64) {
        let f = real_cuda!(cuMemFree_v2: FreeV2);
        free(Kind::Ptr, dptr, || f(dptr))
    }

    fn cuMemFree(dptr: u32) {
        let f = real_cuda!(cuMemFree: unsafe extern "C" fn(u32) -> CUresult);
        free(Kind::Ptr, dptr as u64, || f(dptr))
    }

    fn cuArrayCreate_v2(handle: *mut *mut c_void, desc: *const ArrayDesc) {
        let f = real_cuda!(cuArrayCreate_v2: unsafe extern "C" fn(*mut *mut c_void, *const ArrayDesc) -> CUresult);
        let Some(d) = desc.as_ref() else { return f(handle, desc) };
        let bytes = array_bytes(d.width as u64, d.height as u64, 1, d.format, d.num_channels);
        alloc(bytes, Kind::Array, || f(handle, desc), || *handle as u64)
    }

    fn cuArrayCreate(handle: *mut *mut c_void, desc: *const ArrayDescV1) {
        let f = real_cuda!(cuArrayCreate: unsafe extern "C" fn(*mut *mut c_void, *const ArrayDescV1) -> CUresult);
        let Some(d) = desc.as_ref() else { return f(handle, desc) };
        let bytes = array_bytes(d.width as u64, d.height as u64, 1, d.format, d.num_channels);
        alloc(bytes, Kind::Array, || f(handle, desc), || *handle as u64)
    }

    fn cuArray3DCreate_v2(handle: *mut *mut c_void, desc: *const Array3dDesc) {
        let f = real_cuda!(cuArray3DCreate_v2: unsafe extern "C" fn(*mut *mut c_void, *const Array3dDesc) -> CUresult);
        let Some(d) = desc.as_ref() else { return f(handle, desc) };
        let bytes = array_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.num_channels);
        alloc(bytes, Kind::Array, || f(handle, desc), || *handle as u64)
    }

    fn cuArray3DCreate(handle: *mut *mut c_void, desc: *const Array3dDescV1) {
        let f = real_cuda!(cuArray3DCreate: unsafe extern "C" fn(*mut *mut c_void, *const Array3dDescV1) -> CUresult);
        let Some(d) = desc.as_ref() else { return f(handle, desc) };
        let bytes = array_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.num_channels);
        alloc(bytes, Kind::Array, || f(handle, desc), || *handle as u64)
    }

    fn cuArrayDestroy(handle: *mut c_void) {
        let f = real_cuda!(cuArrayDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult);
        free(Kind::Array, handle as u64, || f(handle))
    }

    fn cuMipmappedArrayCreate(handle: *mut *mut c_void, desc: *const Array3dDesc, levels: u32) {
        let f = real_cuda!(cuMipmappedArrayCreate: unsafe extern "C" fn(*mut *mut c_void, *const Array3dDesc, u32) -> CUresult);
        let Some(d) = desc.as_ref() else { return f(handle, desc, levels) };
        alloc(mipmapped_bytes(d, levels), Kind::Mipmapped, || f(handle, desc, levels), || *handle as u64)
    }

    fn cuMipmappedArrayDestroy(handle: *mut c_void) {
        let f = real_cuda!(cuMipmappedArrayDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult);
        free(Kind::Mipmapped, handle as u64, || f(handle))
    }

    fn cuMemCreate(handle: *mut u64, size: usize, prop: *const c_void, flags: u64) {
        let f = real_cuda!(cuMemCreate: unsafe extern "C" fn(*mut u64, usize, *const c_void, u64) -> CUresult);
        alloc(size as u64, Kind::Generic, || f(handle, size, prop, flags), || *handle)
    }

    fn cuMemRelease(handle: u64) {
        let f = real_cuda!(cuMemRelease: unsafe extern "C" fn(u64) -> CUresult);
        free(Kind::Generic, handle, || f(handle))
    }

    fn cuMemAllocAsync(dptr: *mut u64, bytesize: usize, stream: Stream) {
        let f = real_cuda!(cuMemAllocAsync: AllocAsync);
        if crate::graph::captured(stream, false) {
            return f(dptr, bytesize, stream); // a graph alloc node: reserved at instantiation
        }
        alloc(bytesize as u64, Kind::Ptr, || f(dptr, bytesize, stream), || *dptr)
    }

    fn cuMemAllocAsync_ptsz(dptr: *mut u64, bytesize: usize, stream: Stream) {
        let f = real_cuda!(cuMemAllocAsync_ptsz: AllocAsync);
        if crate::graph::captured(stream, true) {
            return f(dptr, bytesize, stream); // a graph alloc node: reserved at instantiation
        }
        alloc(bytesize as u64, Kind::Ptr, || f(dptr, bytesize, stream), || *dptr)
    }

    fn cuMemAllocFromPoolAsync(dptr: *mut u64, bytesize: usize, pool: *mut c_void, stream: Stream) {
        let f = real_cuda!(cuMemAllocFromPoolAsync: AllocPool);
        if crate::graph::captured(stream, false) {
            return f(dptr, bytesize, pool, stream); // a graph alloc node: reserved at instantiation
        }
        alloc(bytesize as u64, Kind::Ptr, || f(dptr, bytesize, pool, stream), || *dptr)
    }

    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut u64, bytesize: usize, pool: *mut c_void, stream: Stream) {
        let f = real_cuda!(cuMemAllocFromPoolAsync_ptsz: AllocPool);
        if crate::graph::captured(stream, true) {
            return f(dptr, bytesize, pool, stream); // a graph alloc node: reserved at instantiation
        }
        alloc(bytesize as u64, Kind::Ptr, || f(dptr, bytesize, pool, stream), || *dptr)
    }

    fn cuMemFreeAsync(dptr: u64, stream: Stream) {
        let f = real_cuda!(cuMemFreeAsync: FreeAsync);
        free(Kind::Ptr, dptr, || f(dptr, stream))
    }

    fn cuMemFreeAsync_ptsz(dptr: u64, stream: Stream) {
        let f = real_cuda!(cuMemFreeAsync_ptsz: FreeAsync);
        free(Kind::Ptr, dptr, || f(dptr, stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 4), 16 * 1024);
        assert_eq!(array_bytes(64, 64, 4, 0x01, 1), 64 * 64 * 4);
        assert_eq!(format_bytes(0x10), 2);
        assert_eq!(format_bytes(0x7f), 16, "unknown formats are charged high");
        let d = Array3dDesc {
            width: 256,
            height: 256,
            depth: 0,
            format: 0x01,
            num_channels: 1,
            flags: 0,
        };
        assert_eq!(mipmapped_bytes(&d, 1), 65536);
        assert_eq!(mipmapped_bytes(&d, 3), 65536 + 16384 + 4096);
        let layered = Array3dDesc {
            depth: 6,
            flags: CUDA_ARRAY3D_LAYERED,
            ..d
        };
        assert_eq!(mipmapped_bytes(&layered, 2), 6 * 65536 + 6 * 16384);
        assert_eq!(pitch_estimate(100, 10), 5120);
    }
}
