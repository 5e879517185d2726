//! Stream-ordered memory pools, as the real driver keeps them: a pool
//! reserves device memory in 2 MiB steps as its allocations need it, and a
//! free returns the bytes to the pool, not to the device. At synchronisation
//! points (stream, event, context synchronize) a pool holding more than its
//! release threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, default 0) gives
//! the excess back; `cuMemPoolTrimTo` does it on demand. What a pool
//! reserves is what the device, `cuMemGetInfo` and NVML's per-process used
//! memory count.

use crate::stream::Target;
use crate::{Driver, R, arg, drv, get, lock, put};
use cuda_abi::*;
use gpu_sim_core::node::MAX_GPUS;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::{Mutex, OnceLock};

const POOL_MAGIC: u64 = 0x5349_4d50_4f4f_0001;
/// Steps in which a pool reserves device memory.
const STEP: u64 = 2 << 20;

#[derive(Default)]
struct Usage {
    threshold: u64,
    reserved: u64,
    reserved_high: u64,
    used: u64,
    used_high: u64,
    /// CU_MEMPOOL_ATTR_REUSE_* (1..=3), stored and answered back.
    reuse: [i32; 3],
    /// cuMemPoolDestroy was called: gone as a handle, kept until its
    /// allocations are freed.
    destroyed: bool,
}

pub(crate) struct Pool {
    magic: u64,
    pub gpu: usize,
    usage: Mutex<Usage>,
}

impl Pool {
    fn leak(gpu: usize) -> &'static Pool {
        let p: &'static Pool = Box::leak(Box::new(Pool {
            magic: POOL_MAGIC,
            gpu,
            usage: Mutex::new(Usage {
                reuse: [1, 1, 1],
                ..Usage::default()
            }),
        }));
        lock(all()).push(p);
        p
    }

    fn handle(&'static self) -> *mut c_void {
        self as *const Pool as *mut c_void
    }

    /// Takes `size` bytes of the pool, reserving more device memory when
    /// what it holds free is not enough.
    pub fn take(&self, d: &Driver, size: u64) -> R {
        let mut u = lock(&self.usage);
        let free = u.reserved - u.used;
        if size > free {
            let grow = (size - free).div_ceil(STEP) * STEP;
            d.state
                .try_alloc(d.me, self.gpu, grow)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
            u.reserved += grow;
            u.reserved_high = u.reserved_high.max(u.reserved);
        }
        u.used += size;
        u.used_high = u.used_high.max(u.used);
        Ok(())
    }

    /// A freed allocation's bytes return to the pool (to the device only
    /// when the pool is already destroyed).
    pub fn put_back(&self, d: &Driver, size: u64) {
        let mut u = lock(&self.usage);
        u.used = u.used.saturating_sub(size);
        if u.destroyed {
            Self::trim(d, self.gpu, &mut u, 0);
        }
    }

    fn trim(d: &Driver, gpu: usize, u: &mut Usage, keep: u64) {
        let keep = keep.max(u.used.div_ceil(STEP) * STEP).min(u.reserved);
        if u.reserved > keep {
            d.state.free(d.me, gpu, u.reserved - keep);
            u.reserved = keep;
        }
    }
}

/// Every pool of the process (pools are never freed: a destroyed one
/// stays until its allocations are freed, then holds nothing).
fn all() -> &'static Mutex<Vec<&'static Pool>> {
    static ALL: OnceLock<Mutex<Vec<&'static Pool>>> = OnceLock::new();
    ALL.get_or_init(|| Mutex::new(Vec::new()))
}

/// A synchronisation point: pools give back what they hold above their
/// release threshold.
pub(crate) fn at_sync(d: &Driver) {
    for p in lock(all()).iter() {
        let mut u = lock(&p.usage);
        let keep = u.threshold;
        Pool::trim(d, p.gpu, &mut u, keep);
    }
}

/// Default pool of a GPU: one per device, for the life of the process.
pub(crate) fn default_pool(gpu: usize) -> *mut c_void {
    static POOLS: [OnceLock<usize>; MAX_GPUS] = [const { OnceLock::new() }; MAX_GPUS];
    *POOLS[gpu].get_or_init(|| Pool::leak(gpu).handle() as usize) as *mut c_void
}

/// The pool `cuMemAllocAsync` uses on a GPU (`cuDeviceSetMemPool`).
fn current_pool(gpu: usize) -> &'static Pool {
    let p = static_current(gpu).load(Acquire);
    let p = if p == 0 {
        default_pool(gpu) as usize
    } else {
        p
    };
    // SAFETY: CURRENT only ever holds 0 or the address of a leaked, never-freed Pool
    // (set_current_pool / default_pool take &'static Pool).
    unsafe { &*(p as *const Pool) }
}

fn set_current_pool(gpu: usize, p: &'static Pool) {
    static_current(gpu).store(p as *const Pool as usize, Release);
}

fn static_current(gpu: usize) -> &'static AtomicUsize {
    static CURRENT: [AtomicUsize; MAX_GPUS] = [const { AtomicUsize::new(0) }; MAX_GPUS];
    &CURRENT[gpu]
}

unsafe fn pool<'a>(h: *mut c_void) -> R<&'a Pool> {
    let p = h as *const Pool;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if p.is_null() || unsafe { (*p).magic } != POOL_MAGIC {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: checked just above: the live object this driver leaked for the handle; it stays
    // until its destroy call (use after that is the caller's bug, as with the real driver).
    let p = unsafe { &*p };
    if lock(&p.usage).destroyed {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(p)
}

unsafe fn alloc_async(out: *mut u64, size: usize, stream: *mut c_void, ptsz: bool) -> R {
    let d = drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if let Some(p) = crate::capture::alloc(t, size)? {
        return put(out, p);
    }
    let ctx = t.ctx();
    let p = d.mem.alloc_in(d, ctx, size, Some(current_pool(ctx.gpu)))?;
    put(out, p)
}

unsafe fn alloc_from_pool(
    out: *mut u64,
    size: usize,
    pl: *mut c_void,
    stream: *mut c_void,
    ptsz: bool,
) -> R {
    let d = drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    // SAFETY: `pl` is our caller's pool handle, passed on under this function's own contract;
    // `pool` checks its magic.
    let pl: &'static Pool = unsafe { pool(pl)? };
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Kept with the stream's context when it is on the pool's device.
    let ctx = if t.ctx().gpu == pl.gpu {
        t.ctx()
    } else {
        d.devices
            .iter()
            .find(|x| x.gpu == pl.gpu)
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?
            .primary
    };
    let p = d.mem.alloc_in(d, ctx, size, Some(pl))?;
    put(out, p)
}

unsafe fn free_async(ptr: u64, stream: *mut c_void, ptsz: bool) -> R {
    let d = drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    if crate::capture::free(t, ptr)? {
        return Ok(());
    }
    d.mem.free(d, ptr)
}

/// `CUmemPoolProps` (its location at offset 8).
#[repr(C)]
pub struct PoolProps {
    alloc_type: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
}

cuda_fn! {
    // SAFETY: `alloc_async` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemAllocAsync(out: *mut u64, size: usize, s: *mut c_void) { unsafe { alloc_async(out, size, s, false) } }
    // SAFETY: `alloc_async` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemAllocAsync_ptsz(out: *mut u64, size: usize, s: *mut c_void) { unsafe { alloc_async(out, size, s, true) } }
    // SAFETY: `free_async` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemFreeAsync(ptr: u64, s: *mut c_void) { unsafe { free_async(ptr, s, false) } }
    // SAFETY: `free_async` gets the pointers and handles our caller passed in, which the
    // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones this
    // driver handed out or are rejected by their magic.
    fn cuMemFreeAsync_ptsz(ptr: u64, s: *mut c_void) { unsafe { free_async(ptr, s, true) } }
    fn cuMemAllocFromPoolAsync(out: *mut u64, size: usize, p: *mut c_void, s: *mut c_void) {
        // SAFETY: `alloc_from_pool` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { alloc_from_pool(out, size, p, s, false) }
    }
    fn cuMemAllocFromPoolAsync_ptsz(out: *mut u64, size: usize, p: *mut c_void, s: *mut c_void) {
        // SAFETY: `alloc_from_pool` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { alloc_from_pool(out, size, p, s, true) }
    }

    fn cuMemPoolCreate(out: *mut *mut c_void, props: *const PoolProps) {
        let d = drv()?;
        let p = arg(props).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // CU_MEM_LOCATION_TYPE_DEVICE
        if p.location_type != 1 || out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let gpu = d.device(p.location_id).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?.gpu;
        put(out, Pool::leak(gpu).handle())?;
        Ok(())
    }

    fn cuMemPoolDestroy(p: *mut c_void) {
        let d = drv()?;
        // SAFETY: `pool` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let pl = unsafe { pool(p) }?;
        if default_pool(pl.gpu) == p {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if std::ptr::eq(current_pool(pl.gpu), pl) {
            static_current(pl.gpu).store(0, Release);
        }
        let mut u = lock(&pl.usage);
        u.destroyed = true;
        Pool::trim(d, pl.gpu, &mut u, 0);
        Ok(())
    }

    fn cuMemPoolTrimTo(p: *mut c_void, keep: usize) {
        let d = drv()?;
        // SAFETY: `pool` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let pl = unsafe { pool(p) }?;
        Pool::trim(d, pl.gpu, &mut lock(&pl.usage), keep as u64);
        Ok(())
    }

    fn cuMemPoolSetAttribute(p: *mut c_void, attr: i32, value: *mut c_void) {
        drv()?;
        crate::capture_mode::unsafe_call()?;
        // SAFETY: `pool` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let pl = unsafe { pool(p) }?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut u = lock(&pl.usage);
        match attr {
            1..=3 => u.reuse[attr as usize - 1] = get(value as *const i32)?,
            4 => u.threshold = get(value as *const u64)?,
            // The high-water marks can only be reset (to the current value).
            6 if get(value as *const u64)? == 0 => u.reserved_high = u.reserved,
            8 if get(value as *const u64)? == 0 => u.used_high = u.used,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    }

    fn cuMemPoolGetAttribute(p: *mut c_void, attr: i32, value: *mut c_void) {
        drv()?;
        crate::capture_mode::unsafe_call()?;
        // SAFETY: `pool` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let pl = unsafe { pool(p) }?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let u = lock(&pl.usage);
        let v = match attr {
            1..=3 => {
                put(value as *mut i32, u.reuse[attr as usize - 1])?;
                return Ok(());
            }
            4 => u.threshold,
            5 => u.reserved,
            6 => u.reserved_high,
            7 => u.used,
            8 => u.used_high,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        put(value as *mut u64, v)?;
        Ok(())
    }

    fn cuDeviceGetMemPool(out: *mut *mut c_void, dev: i32) {
        let d = drv()?;
        let gpu = d.device(dev)?.gpu;
        put(out, current_pool(gpu).handle())
    }

    fn cuDeviceSetMemPool(dev: i32, p: *mut c_void) {
        let d = drv()?;
        let gpu = d.device(dev)?.gpu;
        // SAFETY: `pool` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let pl: &'static Pool = unsafe { pool(p) }?;
        if pl.gpu != gpu {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        set_current_pool(gpu, pl);
        Ok(())
    }

    fn cuMemPoolGetAccess(flags: *mut u32, p: *mut c_void, _location: *mut c_void) {
        drv()?;
        // SAFETY: `pool` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { pool(p) }?;
        // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        put(flags, 3)
    }
}
