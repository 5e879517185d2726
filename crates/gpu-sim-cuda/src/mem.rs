//! Device memory: counted per device per process in the shared state (so
//! every process sees it and the card can run out), and backed by real,
//! lazily committed host memory (mmap MAP_NORESERVE), so device pointers are
//! real addresses and copies really move bytes.

use crate::ctx::{Ctx, Target, current};
use crate::pool::Pool;
use crate::{Driver, R, arg, drv, lock, put, put_opt};
use cuda_abi::*;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

const PAGE: usize = 4096;
/// VMM allocation granularity the real driver reports.
const GRANULARITY: usize = 2 << 20;
const ARRAY_MAGIC: u64 = 0x5349_4d41_5252_0001;
const PHYS_MAGIC: u64 = 0x5349_4d50_4859_0001;

struct Alloc {
    gpu: usize,
    /// Bytes asked for (and counted).
    size: usize,
    /// Bytes mapped (size rounded up to pages).
    len: usize,
    /// Context it belongs to (freed with it); address only.
    ctx: usize,
    /// The pool it came from: its bytes go back there, not to the device.
    pool: Option<&'static Pool>,
}

#[derive(Default)]
pub(crate) struct Memory {
    /// Device and managed allocations by base address.
    allocs: Mutex<BTreeMap<u64, Alloc>>,
    /// Pinned host allocations: base -> mapped length.
    host: Mutex<BTreeMap<u64, usize>>,
    /// VMM reservations: aligned base -> (raw mapping base, raw length).
    reserved: Mutex<BTreeMap<u64, (usize, usize)>>,
    /// VMM mappings: address -> (length, handle mapped there).
    mapped: Mutex<BTreeMap<u64, (usize, u64)>>,
    /// Contexts' overhead, heaps and module images.
    pub charges: crate::charge::Charges,
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

unsafe fn map_anon(len: usize, prot: i32) -> R<*mut c_void> {
    // SAFETY: a fresh private anonymous mapping (NULL hint, no MAP_FIXED) replaces nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(p)
}

impl Memory {
    /// Allocates `size` bytes on `ctx`'s device.
    pub fn alloc(&self, d: &Driver, ctx: &Ctx, size: usize) -> R<u64> {
        self.alloc_in(d, ctx, size, None)
    }

    /// Allocates `size` bytes on `ctx`'s device, from `pool` when given (the
    /// pool, not the allocation, holds device memory).
    pub fn alloc_in(
        &self,
        d: &Driver,
        ctx: &Ctx,
        size: usize,
        pool: Option<&'static Pool>,
    ) -> R<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match pool {
            Some(p) => p.take(d, size as u64)?,
            None => d
                .state
                .try_alloc(d.me, ctx.gpu, size as u64)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?,
        }
        let len = round_up(size, PAGE);
        // SAFETY: plain anonymous mapping of `len` bytes; see map_anon.
        let p = match unsafe { map_anon(len, libc::PROT_READ | libc::PROT_WRITE) } {
            Ok(p) => p,
            Err(e) => {
                match pool {
                    Some(p) => p.put_back(d, size as u64),
                    None => d.state.free(d.me, ctx.gpu, size as u64),
                }
                return Err(e);
            }
        };
        let addr = p as u64;
        lock(&self.allocs).insert(
            addr,
            Alloc {
                gpu: ctx.gpu,
                size,
                len,
                ctx: ctx as *const Ctx as usize,
                pool,
            },
        );
        Ok(addr)
    }

    pub fn free(&self, d: &Driver, ptr: u64) -> R {
        let a = lock(&self.allocs)
            .remove(&ptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Self::release(d, ptr, a);
        Ok(())
    }

    fn release(d: &Driver, ptr: u64, a: Alloc) {
        // SAFETY: `ptr`/`a.len` is an allocation `alloc_in` mapped; its record was removed from
        // `allocs` by the caller, so this is its only unmap.
        unsafe { libc::munmap(ptr as *mut c_void, a.len) };
        match a.pool {
            Some(p) => p.put_back(d, a.size as u64),
            None => d.state.free(d.me, a.gpu, a.size as u64),
        }
    }

    /// Frees what a destroyed context allocated.
    pub fn free_context(&self, d: &Driver, c: &Ctx) {
        let key = c as *const Ctx as usize;
        let gone: Vec<(u64, Alloc)> = {
            let mut m = lock(&self.allocs);
            let keys: Vec<u64> = m
                .iter()
                .filter(|(_, a)| a.ctx == key)
                .map(|(k, _)| *k)
                .collect();
            keys.into_iter()
                .filter_map(|k| m.remove(&k).map(|a| (k, a)))
                .collect()
        };
        for (p, a) in gone {
            Self::release(d, p, a);
        }
    }

    /// The allocation containing `ptr`: (base, size).
    fn containing(&self, ptr: u64) -> Option<(u64, usize)> {
        let m = lock(&self.allocs);
        let (&base, a) = m.range(..=ptr).next_back()?;
        (ptr < base + a.size as u64).then_some((base, a.size))
    }

    /// Checks that [ptr, ptr+n) is device memory of this process.
    fn check(&self, ptr: u64, n: usize) -> R {
        if ptr == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let end = ptr.checked_add(n as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((base, size)) = self.containing(ptr)
            && end <= base + size as u64
        {
            return Ok(());
        }
        let m = lock(&self.mapped);
        if let Some((&base, &(len, _))) = m.range(..=ptr).next_back()
            && end <= base + len as u64
        {
            return Ok(());
        }
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

fn ctx_and_driver() -> R<(&'static Driver, &'static Ctx)> {
    Ok((drv()?, current()?))
}

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

/// Async copies and sets complete at once: the simulator charges time only to
/// kernels. The stream handle is still checked.
unsafe fn on(stream: *mut c_void, ptsz: bool) -> R {
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    unsafe { Target::of(stream, ptsz) }.map(|_| ())
}

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

/// `CUmemLocation` inside CUmemAllocationProp / CUmemPoolProps (offset 8).
#[repr(C)]
pub struct AllocProp {
    kind: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: u32 = 1;

/// `CU_MEM_LOCATION_TYPE_HOST`, `_HOST_NUMA`, `_HOST_NUMA_CURRENT`.
const LOCATION_HOST: std::ops::RangeInclusive<u32> = 2..=4;

/// The GPU a VMM allocation lives on; `None` for host memory.
fn prop_location(d: &Driver, p: *const AllocProp) -> R<Option<usize>> {
    let pr = arg(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if LOCATION_HOST.contains(&pr.location_type) {
        return Ok(None);
    }
    prop_device(d, p).map(Some)
}

fn prop_device(d: &Driver, p: *const AllocProp) -> R<usize> {
    let p = arg(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if p.location_type != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(d.device(p.location_id)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?
        .gpu)
}

// ---- arrays ----

struct ArrayObj {
    magic: u64,
    gpu: usize,
    bytes: u64,
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct ArrayDesc {
    width: usize,
    height: usize,
    format: u32,
    channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct Array3dDesc {
    width: usize,
    height: usize,
    depth: usize,
    format: u32,
    channels: u32,
    flags: u32,
}

/// Bytes per element of a `CUarray_format`, times 2 (NV12 is 1.5 bytes).
fn format_bytes_x2(format: u32) -> R<u64> {
    Ok(match format {
        0x01 | 0x08 | 0xc0 | 0xc6 => 2,                      // 8-bit
        0x02 | 0x09 | 0x10 | 0xc1 | 0xc3 | 0xc7 | 0xc9 => 4, // 16-bit
        0x03 | 0x0a | 0x20 | 0xc2 | 0xc4 | 0xc8 | 0xca => 8, // 32-bit
        0xc5 | 0xcb => 16,
        0xb0 => 3, // NV12
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

fn array_bytes(w: usize, h: usize, depth: usize, format: u32, channels: u32) -> R<u64> {
    if w == 0 || !matches!(channels, 1 | 2 | 4) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let elems = w as u64 * h.max(1) as u64 * depth.max(1) as u64 * channels as u64;
    Ok((elems * format_bytes_x2(format)?).div_ceil(2))
}

unsafe fn array_create(out: *mut *mut c_void, bytes: R<u64>) -> R {
    let (d, c) = ctx_and_driver()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = bytes?;
    d.state
        .try_alloc(d.me, c.gpu, bytes)
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    let a = Box::new(ArrayObj {
        magic: ARRAY_MAGIC,
        gpu: c.gpu,
        bytes,
    });
    put(out, Box::into_raw(a).cast())?;
    Ok(())
}

unsafe fn array_destroy(h: *mut c_void) -> R {
    let d = drv()?;
    let a = h as *mut ArrayObj;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if a.is_null() || unsafe { (*a).magic } != ARRAY_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: the handle passed its magic check, so it is a Box this driver leaked; freed once,
    // here, under cuArrayDestroy.
    let a = unsafe { Box::from_raw(a) };
    d.state.free(d.me, a.gpu, a.bytes);
    Ok(())
}

// ---- VMM ----

struct Phys {
    magic: u64,
    /// Device it is counted on; `None` for host memory (not counted).
    gpu: Option<usize>,
    size: usize,
    fd: i32,
    /// (live mappings, released): the memory stays until both say so, as
    /// the driver defers a release until the last unmap.
    life: Mutex<(u32, bool)>,
}

/// Frees a handle once it is released and no longer mapped.
unsafe fn phys_settle(d: &Driver, h: u64) {
    let done = {
        // SAFETY: `h` is a VMM handle this driver handed out (the callers looked it up in
        // `mapped` or checked it with `phys`), still alive: only this function frees it.
        let p = unsafe { &*(h as *const Phys) };
        let l = lock(&p.life);
        l.0 == 0 && l.1
    };
    if done {
        // SAFETY: released and no longer mapped: no one else can reach the Box any more; freed
        // once, here.
        let mut p = unsafe { Box::from_raw(h as *mut Phys) };
        p.magic = 0;
        // SAFETY: the handle's own memfd, closed once, with it.
        unsafe { libc::close(p.fd) };
        if let Some(gpu) = p.gpu {
            d.state.free(d.me, gpu, p.size as u64);
        }
    }
}

/// A mapping of `h` went away.
unsafe fn phys_unmapped(d: &Driver, h: u64) {
    {
        // SAFETY: as in phys_settle: a live VMM handle of ours, still mapped.
        let p = unsafe { &*(h as *const Phys) };
        let mut l = lock(&p.life);
        l.0 = l.0.saturating_sub(1);
    }
    // SAFETY: `h` is a live VMM handle of ours (see above).
    unsafe { phys_settle(d, h) };
}

unsafe fn phys<'a>(h: u64) -> R<&'a Phys> {
    let p = h as *const Phys;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if p.is_null() || unsafe { (*p).magic } != PHYS_MAGIC {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: checked just above: the live object this driver leaked for the handle; it stays
    // until its destroy call (use after that is the caller's bug, as with the real driver).
    Ok(unsafe { &*p })
}

cuda_fn! {
    fn cuMemAlloc_v2(out: *mut u64, size: usize) {
        let (d, c) = ctx_and_driver()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, d.mem.alloc(d, c, size)?)
    }

    fn cuMemAllocManaged(out: *mut u64, size: usize, flags: u32) {
        let (d, c) = ctx_and_driver()?;
        if out.is_null() || !matches!(flags, 1 | 2) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, d.mem.alloc(d, c, size)?)
    }

    fn cuMemAllocPitch_v2(out: *mut u64, pitch: *mut usize, width: usize, height: usize, elem: u32) {
        let (d, c) = ctx_and_driver()?;
        if out.is_null() || pitch.is_null() || !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = round_up(width, 512);
        let ptr = d.mem.alloc(d, c, p * height)?;
        put(pitch, p)?;
        put(out, ptr)
    }

    fn cuMemFree_v2(ptr: u64) {
        let d = drv()?;
        d.mem.free(d, ptr)
    }

    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let (d, c) = ctx_and_driver()?;
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let t = d.state.memory_total(c.gpu);
        put(total, t as usize)?;
        put(free, t.saturating_sub(d.state.memory_used(c.gpu)) as usize)?;
        Ok(())
    }

    fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, ptr: u64) {
        let d = drv()?;
        let (b, s) = d.mem.containing(ptr).ok_or(CUDA_ERROR_NOT_FOUND)?;
        put_opt(base, b);
        put_opt(size, s);
        Ok(())
    }

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

    // ---- copies ----

    // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpy(dst: u64, src: u64, n: usize) { unsafe { any(dst, src, n) } }
    // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpy_ptds(dst: u64, src: u64, n: usize) { unsafe { any(dst, src, n) } }
    // SAFETY: `on`, `any` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyAsync(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { any(dst, src, n) } }
    // SAFETY: `on`, `any` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyAsync_ptsz(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { any(dst, src, n) } }
    // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyPeer(dst: u64, _dc: *mut c_void, src: u64, _sc: *mut c_void, n: usize) { unsafe { any(dst, src, n) } }
    // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyPeer_ptds(dst: u64, _dc: *mut c_void, src: u64, _sc: *mut c_void, n: usize) { unsafe { any(dst, src, n) } }
    fn cuMemcpyPeerAsync(dst: u64, _dc: *mut c_void, src: u64, _sc: *mut c_void, n: usize, s: *mut c_void) {
        // SAFETY: `on` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { on(s, false) }?;
        // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { any(dst, src, n) }
    }
    fn cuMemcpyPeerAsync_ptsz(dst: u64, _dc: *mut c_void, src: u64, _sc: *mut c_void, n: usize, s: *mut c_void) {
        // SAFETY: `on` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { on(s, true) }?;
        // SAFETY: `any` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { any(dst, src, n) }
    }
    // SAFETY: `htod` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) { unsafe { htod(dst, src, n) } }
    // SAFETY: `htod` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyHtoD_v2_ptds(dst: u64, src: *const c_void, n: usize) { unsafe { htod(dst, src, n) } }
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
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) { unsafe { dtoh(dst, src, n) } }
    // SAFETY: `dtoh` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: u64, n: usize) { unsafe { dtoh(dst, src, n) } }
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
    fn cuMemcpyDtoD_v2(dst: u64, src: u64, n: usize) { unsafe { dtod(dst, src, n) } }
    // SAFETY: `dtod` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemcpyDtoD_v2_ptds(dst: u64, src: u64, n: usize) { unsafe { dtod(dst, src, n) } }
    // SAFETY: `on`, `dtod` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, false) }?; unsafe { dtod(dst, src, n) } }
    // SAFETY: `on`, `dtod` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemcpyDtoDAsync_v2_ptsz(dst: u64, src: u64, n: usize, s: *mut c_void) { unsafe { on(s, true) }?; unsafe { dtod(dst, src, n) } }

    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD8_v2(dst: u64, v: u8, n: usize) { unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD8_v2_ptds(dst: u64, v: u8, n: usize) { unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD16_v2(dst: u64, v: u16, n: usize) { unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD16_v2_ptds(dst: u64, v: u16, n: usize) { unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD32_v2(dst: u64, v: u32, n: usize) { unsafe { set(dst, v, n) } }
    // SAFETY: `set` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD32_v2_ptds(dst: u64, v: u32, n: usize) { unsafe { set(dst, v, n) } }
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
    fn cuMemsetD2D8_v2(dst: u64, pitch: usize, v: u8, w: usize, h: usize) { unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D8_v2_ptds(dst: u64, pitch: usize, v: u8, w: usize, h: usize) { unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D16_v2(dst: u64, pitch: usize, v: u16, w: usize, h: usize) { unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D16_v2_ptds(dst: u64, pitch: usize, v: u16, w: usize, h: usize) { unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D32_v2(dst: u64, pitch: usize, v: u32, w: usize, h: usize) { unsafe { set2d(dst, pitch, v, w, h) } }
    // SAFETY: `set2d` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuMemsetD2D32_v2_ptds(dst: u64, pitch: usize, v: u32, w: usize, h: usize) { unsafe { set2d(dst, pitch, v, w, h) } }

    // ---- arrays ----

    fn cuArrayCreate_v2(out: *mut *mut c_void, desc: *const ArrayDesc) {
        let d = arg(desc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `array_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_create(out, array_bytes(d.width, d.height, 1, d.format, d.channels)) }
    }

    fn cuArray3DCreate_v2(out: *mut *mut c_void, desc: *const Array3dDesc) {
        let d = arg(desc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `array_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_create(out, array_bytes(d.width, d.height, d.depth, d.format, d.channels)) }
    }

    fn cuArrayDestroy(a: *mut c_void) {
        // SAFETY: `array_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_destroy(a) }
    }

    fn cuMipmappedArrayCreate(out: *mut *mut c_void, desc: *const Array3dDesc, levels: u32) {
        let d = arg(desc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if levels == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut total = 0u64;
        let (mut w, mut h, mut z) = (d.width, d.height, d.depth);
        for _ in 0..levels {
            total += array_bytes(w, h, z, d.format, d.channels)?;
            (w, h, z) = ((w / 2).max(1), h / 2, z / 2);
            if d.height > 0 {
                h = h.max(1);
            }
            if d.depth > 0 {
                z = z.max(1);
            }
        }
        // SAFETY: `array_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_create(out, Ok(total)) }
    }

    fn cuMipmappedArrayDestroy(a: *mut c_void) {
        // SAFETY: `array_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_destroy(a) }
    }

    // ---- virtual memory management ----

    fn cuMemGetAllocationGranularity(out: *mut usize, prop: *const AllocProp, _option: u32) {
        let d = drv()?;
        prop_device(d, prop)?;
        put(out, GRANULARITY)
    }

    fn cuMemCreate(out: *mut u64, size: usize, prop: *const AllocProp, flags: u64) {
        let d = drv()?;
        let gpu = prop_location(d, prop)?;
        if out.is_null() || flags != 0 || size == 0 || size & (GRANULARITY - 1) != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(gpu) = gpu {
            d.state.try_alloc(d.me, gpu, size as u64).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        }
        // SAFETY: a NUL-terminated literal name; plain syscall, no memory handed over.
        let fd = unsafe { libc::memfd_create(c"gpu-sim-vmm".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: `fd` is the memfd just created (checked >= 0 first).
        if fd < 0 || unsafe { libc::ftruncate(fd, size as i64) } != 0 {
            if fd >= 0 {
                // SAFETY: our own memfd, closed once, on this failure path only.
                unsafe { libc::close(fd) };
            }
            if let Some(gpu) = gpu {
                d.state.free(d.me, gpu, size as u64);
            }
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let p = Box::new(Phys { magic: PHYS_MAGIC, gpu, size, fd, life: Mutex::new((0, false)) });
        put(out, Box::into_raw(p) as u64)?;
        Ok(())
    }

    fn cuMemRelease(h: u64) {
        let d = drv()?;
        // SAFETY: `phys` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let p = unsafe { phys(h) }?;
        {
            let mut l = lock(&p.life);
            if l.1 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            l.1 = true;
        }
        // Mapped: the memory stays (and counts) until the last unmap.
        // SAFETY: `phys_settle` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { phys_settle(d, h) };
        Ok(())
    }

    fn cuMemAddressReserve(out: *mut u64, size: usize, align: usize, _addr: u64, _flags: u64) {
        let d = drv()?;
        if out.is_null() || size == 0 || size & (GRANULARITY - 1) != 0 || (align != 0 && !align.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let align = align.max(GRANULARITY);
        let raw_len = size + align;
        // SAFETY: `map_anon` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let raw = unsafe { map_anon(raw_len, libc::PROT_NONE) }? as usize;
        let base = round_up(raw, align) as u64;
        lock(&d.mem.reserved).insert(base, (raw, raw_len));
        put(out, base)
    }

    fn cuMemAddressFree(ptr: u64, _size: usize) {
        let d = drv()?;
        let (raw, len) = lock(&d.mem.reserved).remove(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `raw`/`len` is the reservation `cuMemAddressReserve` mapped
        // and recorded; removing the record above makes this its only unmap.
        unsafe { libc::munmap(raw as *mut c_void, len) };
        let mut gone = Vec::new();
        lock(&d.mem.mapped).retain(|&a, &mut (_, h)| {
            let inside = a >= ptr && a < ptr + len as u64;
            if inside {
                gone.push(h);
            }
            !inside
        });
        for h in gone {
            // SAFETY: `phys_unmapped` gets the pointers and handles our caller passed in,
            // which the CUDA ABI makes valid for this call (or NULL, checked there);
            // handles are ones this driver handed out or are rejected by their magic.
            unsafe { phys_unmapped(d, h) };
        }
        Ok(())
    }

    fn cuMemMap(ptr: u64, size: usize, offset: usize, h: u64, flags: u64) {
        let d = drv()?;
        // SAFETY: `phys` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let p = unsafe { phys(h) }?;
        if lock(&p.life).1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if flags != 0 || size == 0 || offset.checked_add(size).is_none_or(|e| e > p.size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        {
            let r = lock(&d.mem.reserved);
            let (&base, &(raw, len)) = r.range(..=ptr).next_back().ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if ptr + size as u64 > raw as u64 + len as u64 || ptr < base {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        // SAFETY: MAP_FIXED only inside a reservation of ours (range checked
        // against `reserved` above), so no other mapping is replaced; `p.fd` is
        // the handle's memfd and `offset + size <= p.size` is checked above.
        let m = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                p.fd,
                offset as i64,
            )
        };
        if m == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        lock(&p.life).0 += 1;
        if let Some((_, old)) = lock(&d.mem.mapped).insert(ptr, (size, h)) {
            // SAFETY: `phys_unmapped` gets the pointers and handles our caller passed in,
            // which the CUDA ABI makes valid for this call (or NULL, checked there);
            // handles are ones this driver handed out or are rejected by their magic.
            unsafe { phys_unmapped(d, old) };
        }
        Ok(())
    }

    fn cuMemUnmap(ptr: u64, size: usize) {
        let d = drv()?;
        let (_, h) = lock(&d.mem.mapped).remove(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `ptr` was mapped by our `cuMemMap` inside a reservation of
        // ours (recorded in `mapped`, removed above); putting PROT_NONE
        // anonymous memory back over it returns it to the reservation.
        unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        // SAFETY: `phys_unmapped` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { phys_unmapped(d, h) };
        Ok(())
    }

    fn cuMemSetAccess(ptr: u64, size: usize, desc: *const c_void, count: usize) {
        let d = drv()?;
        if desc.is_null() || count == 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.mem.check(ptr, size)
    }
}

unsafe fn host_alloc(out: *mut *mut c_void, size: usize) -> R {
    let d = drv()?;
    current()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_sizes_follow_the_descriptor() {
        // 1024 x 768 RGBA float
        assert_eq!(array_bytes(1024, 768, 0, 0x20, 4), Ok(1024 * 768 * 16));
        // 1D of u8
        assert_eq!(array_bytes(100, 0, 0, 0x01, 1), Ok(100));
        // NV12: 1.5 bytes per pixel
        assert_eq!(array_bytes(64, 64, 0, 0xb0, 1), Ok(64 * 64 * 3 / 2));
        assert_eq!(array_bytes(0, 1, 1, 0x01, 1), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(array_bytes(1, 1, 1, 0x01, 3), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(array_bytes(1, 1, 1, 0x77, 1), Err(CUDA_ERROR_INVALID_VALUE));
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(1, PAGE), PAGE);
        assert_eq!(round_up(PAGE, PAGE), PAGE);
        assert_eq!(round_up(0, PAGE), 0);
    }
}
