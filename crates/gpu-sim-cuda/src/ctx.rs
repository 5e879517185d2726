//! Contexts, streams, events and kernel launches: the simulated timeline.
//!
//! Each launch takes its duration from the launch shape, queues on the
//! device's shared timeline (behind every process's kernels) and records the
//! simulated end as its stream's tail. Synchronising sleeps until the tail.
//! The launch path is atomics, thread-locals and a vDSO clock read: no lock,
//! no allocation, no syscall.

use crate::{R, arg, drv, put, put_opt};
use cuda_abi::*;
use gpu_sim_core::state::now_ns;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};

const CTX_MAGIC: u64 = 0x5349_4d43_5458_0001;
const STREAM_MAGIC: u64 = 0x5349_4d53_5452_0001;
const EVENT_MAGIC: u64 = 0x5349_4d45_5654_0001;
pub(crate) const FUNC_MAGIC: u64 = 0x5349_4d46_554e_0001;

/// `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD` handles.
const STREAM_LEGACY: usize = 1;
const STREAM_PER_THREAD: usize = 2;

pub(crate) struct Ctx {
    magic: u64,
    pub ordinal: i32,
    pub gpu: usize,
    pub primary: bool,
    pub alive: AtomicBool,
    pub flags: AtomicU32,
    /// Primary context retain count.
    pub retained: AtomicU32,
    /// Tail of the legacy default stream.
    null_tail: AtomicU64,
    /// Latest simulated end of any work in this context (ctx synchronize).
    tail: AtomicU64,
}

impl Ctx {
    /// Contexts are never freed: a destroyed one stays as a tombstone so a
    /// stale handle is an error, not a use-after-free.
    pub fn leak(ordinal: i32, gpu: usize, primary: bool, flags: u32) -> &'static Ctx {
        Box::leak(Box::new(Ctx {
            magic: CTX_MAGIC,
            ordinal,
            gpu,
            primary,
            alive: AtomicBool::new(true),
            flags: AtomicU32::new(flags),
            retained: AtomicU32::new(0),
            null_tail: AtomicU64::new(0),
            tail: AtomicU64::new(0),
        }))
    }

    pub fn handle(&'static self) -> *mut c_void {
        self as *const Ctx as *mut c_void
    }

    pub unsafe fn from_handle(h: *mut c_void) -> R<&'static Ctx> {
        let c = h as *const Ctx;
        // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed
        // out (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so
        // a stale handle fails here.
        if c.is_null() || unsafe { (*c).magic } != CTX_MAGIC {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        // SAFETY: checked just above: the live object this driver leaked for the handle; it
        // stays until its destroy call (use after that is the caller's bug, as with the real
        // driver).
        let c = unsafe { &*c };
        if !c.alive.load(Acquire) {
            return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        Ok(c)
    }

    fn synchronize(&self) {
        wait_until(self.tail.load(Acquire));
    }
}

thread_local! {
    /// Top of this thread's context stack (a Cell: no TLS destructor, so the
    /// launch path never registers one).
    static CURRENT: Cell<*const Ctx> = const { Cell::new(std::ptr::null()) };
    static BELOW: RefCell<Vec<*const Ctx>> = const { RefCell::new(Vec::new()) };
    /// Tail of this thread's per-thread default stream.
    static PER_THREAD_TAIL: Cell<u64> = const { Cell::new(0) };
}

/// The calling thread's current context.
#[inline]
pub(crate) fn current() -> R<&'static Ctx> {
    let c = CURRENT.with(Cell::get);
    if c.is_null() {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    // SAFETY: only ever set from a &'static Ctx.
    let c = unsafe { &*c };
    if !c.alive.load(Relaxed) {
        return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
    }
    Ok(c)
}

fn set_current(c: *const Ctx) {
    CURRENT.with(|cur| cur.set(c));
}

/// Sleeps until the simulated time `t` (CLOCK_MONOTONIC ns).
pub(crate) fn wait_until(t: u64) {
    loop {
        let now = now_ns();
        if now >= t {
            return;
        }
        std::thread::sleep(std::time::Duration::from_nanos(t - now));
    }
}

pub(crate) struct Stream {
    magic: u64,
    ctx: &'static Ctx,
    tail: AtomicU64,
    flags: u32,
    priority: i32,
}

/// Where work submitted to a stream handle lands.
#[derive(Clone, Copy)]
pub(crate) enum Target {
    Legacy(&'static Ctx),
    PerThread(&'static Ctx),
    Stream(&'static Stream),
}

impl Target {
    /// Resolves a `CUstream`. `ptsz`: called through a per-thread variant,
    /// where stream 0 means the per-thread default stream.
    #[inline]
    pub unsafe fn of(h: *mut c_void, ptsz: bool) -> R<Target> {
        match h as usize {
            0 if ptsz => Ok(Target::PerThread(current()?)),
            0 | STREAM_LEGACY => Ok(Target::Legacy(current()?)),
            STREAM_PER_THREAD => Ok(Target::PerThread(current()?)),
            _ => {
                let s = h as *const Stream;
                // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver
                // handed out (a Box it leaked); the magic word tells the types apart, and
                // destroy zeroes it so a stale handle fails here.
                if unsafe { (*s).magic } != STREAM_MAGIC {
                    return Err(CUDA_ERROR_INVALID_HANDLE);
                }
                // SAFETY: streams live until cuStreamDestroy; using one after
                // that is the caller's bug, as with the real driver.
                Ok(Target::Stream(unsafe { &*s }))
            }
        }
    }

    #[inline]
    pub fn ctx(self) -> &'static Ctx {
        match self {
            Target::Legacy(c) | Target::PerThread(c) => c,
            Target::Stream(s) => s.ctx,
        }
    }

    #[inline]
    pub fn tail(self) -> u64 {
        match self {
            Target::Legacy(c) => c.null_tail.load(Acquire),
            Target::PerThread(_) => PER_THREAD_TAIL.with(Cell::get),
            Target::Stream(s) => s.tail.load(Acquire),
        }
    }

    #[inline]
    pub(crate) fn set_tail(self, end: u64) {
        match self {
            Target::Legacy(c) => {
                c.null_tail.fetch_max(end, AcqRel);
            }
            Target::PerThread(_) => PER_THREAD_TAIL.with(|t| t.set(t.get().max(end))),
            Target::Stream(s) => {
                s.tail.fetch_max(end, AcqRel);
            }
        }
        self.ctx().tail.fetch_max(end, AcqRel);
    }
}

/// A kernel launch: the hot path.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch(
    f: *mut c_void,
    grid: [u32; 3],
    block: [u32; 3],
    stream: *mut c_void,
    ptsz: bool,
) -> R {
    let d = drv()?;
    let func = f as *const u64;
    // SAFETY: `f` is non-NULL here and, per the CUDA ABI, a CUfunction this driver handed out,
    // whose first word is its magic (checked).
    if func.is_null() || unsafe { *func } != FUNC_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if block[0] > 1024 || block[1] > 1024 || block[2] > 64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if block[0] as u64 * block[1] as u64 * block[2] as u64 > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if grid[1] > 65535 || grid[2] > 65535 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    if crate::capture::kernel(t, f, grid, block)? {
        return Ok(());
    }
    let ctx = t.ctx();
    let dur = d.node().kernel_duration_ns(ctx.gpu, grid, block);
    let (_, end) = d.state.launch(d.me, ctx.gpu, dur, t.tail());
    t.set_tail(end);
    Ok(())
}

unsafe fn stream_sync(h: *mut c_void, ptsz: bool) -> R {
    let d = drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    wait_until(unsafe { Target::of(h, ptsz)? }.tail());
    crate::pool::at_sync(d);
    Ok(())
}

unsafe fn stream_query(h: *mut c_void, ptsz: bool) -> R {
    drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    if unsafe { Target::of(h, ptsz)? }.tail() > now_ns() {
        return Err(CUDA_ERROR_NOT_READY);
    }
    Ok(())
}

unsafe fn stream_create(out: *mut *mut c_void, flags: u32, priority: i32) -> R {
    drv()?;
    if out.is_null() || flags > 1 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = current()?;
    let s = Box::new(Stream {
        magic: STREAM_MAGIC,
        ctx,
        tail: AtomicU64::new(0),
        flags,
        priority: priority.clamp(-5, 0),
    });
    put(out, Box::into_raw(s).cast())?;
    Ok(())
}

unsafe fn stream_destroy(h: *mut c_void) -> R {
    drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    match unsafe { Target::of(h, false)? } {
        t @ Target::Stream(s) => {
            crate::capture::stream_destroyed(t);
            // Work still queued completes on the simulated device anyway.
            let s = s as *const Stream as *mut Stream;
            // SAFETY: the handle passed its magic check, so it is a Box this driver leaked; the
            // magic is zeroed and the Box freed once, here, under the destroy call.
            unsafe {
                (*s).magic = 0;
                drop(Box::from_raw(s));
            }
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    }
}

pub(crate) struct Event {
    magic: u64,
    flags: u32,
    /// Simulated completion time of the recorded work; 0 = never recorded.
    time: AtomicU64,
}

unsafe fn event<'a>(h: *mut c_void) -> R<&'a Event> {
    let e = h as *const Event;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if e.is_null() || unsafe { (*e).magic } != EVENT_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: checked just above: the live object this driver leaked for the handle; it stays
    // until its destroy call (use after that is the caller's bug, as with the real driver).
    Ok(unsafe { &*e })
}

unsafe fn event_record(ev: *mut c_void, stream: *mut c_void, ptsz: bool) -> R {
    drv()?;
    // SAFETY: `ev`/`start`/`end` are our caller's event handles, passed on under this
    // function's own contract; `event` checks their magic.
    let e = unsafe { event(ev)? };
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    if crate::capture::event_record(ev, t) {
        return Ok(());
    }
    e.time.store(t.tail().max(now_ns()).max(1), Release);
    Ok(())
}

unsafe fn ctx_create(out: *mut *mut c_void, flags: u32, dev: i32) -> R {
    let d = drv()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = d.device(dev)?;
    let c = Ctx::leak(dev.ordinal, dev.gpu, false, flags);
    // A context takes device memory while it lives; none left, no context.
    if let Err(e) = crate::charge::activate(d, c) {
        c.alive.store(false, Release);
        return Err(e);
    }
    d.state.set_active(d.me, dev.gpu);
    // cuCtxCreate pushes the new context onto the thread's stack.
    push(c);
    put(out, c.handle())?;
    Ok(())
}

fn push(c: &'static Ctx) {
    let old = CURRENT.with(Cell::get);
    if !old.is_null() {
        BELOW.with(|b| b.borrow_mut().push(old));
    }
    set_current(c);
}

fn pop() -> *const Ctx {
    let old = CURRENT.with(Cell::get);
    let next = BELOW
        .with(|b| b.borrow_mut().pop())
        .unwrap_or(std::ptr::null());
    set_current(next);
    old
}

unsafe fn ctx_destroy(h: *mut c_void) -> R {
    let d = drv()?;
    // SAFETY: `h` is our caller's context handle, passed on under this function's own contract;
    // `from_handle` checks its magic.
    let c = unsafe { Ctx::from_handle(h)? };
    if c.primary {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    c.synchronize();
    c.alive.store(false, Release);
    crate::charge::deactivate(d, c);
    // Drop it from this thread's stack; other threads see it destroyed.
    if std::ptr::eq(CURRENT.with(Cell::get), c) {
        pop();
    }
    BELOW.with(|b| b.borrow_mut().retain(|&x| !std::ptr::eq(x, c)));
    Ok(())
}

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
    fn cuCtxCreate_v2(out: *mut *mut c_void, flags: u32, dev: i32) {
        // SAFETY: `ctx_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { ctx_create(out, flags, dev) }
    }

    fn cuCtxCreate_v3(out: *mut *mut c_void, _params: *mut c_void, _n: i32, flags: u32, dev: i32) {
        // SAFETY: `ctx_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { ctx_create(out, flags, dev) }
    }

    fn cuCtxCreate_v4(out: *mut *mut c_void, _params: *mut c_void, flags: u32, dev: i32) {
        // SAFETY: `ctx_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { ctx_create(out, flags, dev) }
    }

    fn cuCtxDestroy(ctx: *mut c_void) {
        // SAFETY: `ctx_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { ctx_destroy(ctx) }
    }

    fn cuCtxDestroy_v2(ctx: *mut c_void) {
        // SAFETY: `ctx_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { ctx_destroy(ctx) }
    }

    fn cuCtxSetCurrent(ctx: *mut c_void) {
        drv()?;
        if ctx.is_null() {
            pop();
            return Ok(());
        }
        // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        let c = unsafe { Ctx::from_handle(ctx) }?;
        set_current(c);
        Ok(())
    }

    fn cuCtxGetCurrent(out: *mut *mut c_void) {
        drv()?;
        put(out, CURRENT.with(Cell::get) as *mut c_void)
    }

    fn cuCtxPushCurrent(ctx: *mut c_void) {
        drv()?;
        // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        push(unsafe { Ctx::from_handle(ctx) }?);
        Ok(())
    }

    fn cuCtxPushCurrent_v2(ctx: *mut c_void) {
        drv()?;
        // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        push(unsafe { Ctx::from_handle(ctx) }?);
        Ok(())
    }

    fn cuCtxPopCurrent(out: *mut *mut c_void) {
        drv()?;
        current()?;
        let c = pop();
        put_opt(out, c as *mut c_void);
        Ok(())
    }

    fn cuCtxPopCurrent_v2(out: *mut *mut c_void) {
        drv()?;
        current()?;
        let c = pop();
        put_opt(out, c as *mut c_void);
        Ok(())
    }

    fn cuCtxGetDevice(dev: *mut i32) {
        drv()?;
        put(dev, current()?.ordinal)
    }

    fn cuCtxGetDevice_v2(dev: *mut i32, ctx: *mut c_void) {
        drv()?;
        // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        let c = if ctx.is_null() { current()? } else { unsafe { Ctx::from_handle(ctx) }? };
        put(dev, c.ordinal)
    }

    fn cuCtxSynchronize() {
        let d = drv()?;
        current()?.synchronize();
        crate::pool::at_sync(d);
        Ok(())
    }

    fn cuCtxSynchronize_v2(ctx: *mut c_void) {
        drv()?;
        // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        let c = if ctx.is_null() { current()? } else { unsafe { Ctx::from_handle(ctx) }? };
        c.synchronize();
        crate::pool::at_sync(drv()?);
        Ok(())
    }

    fn cuCtxGetFlags(flags: *mut u32) {
        drv()?;
        put(flags, current()?.flags.load(Acquire))
    }

    fn cuCtxSetFlags(flags: u32) {
        drv()?;
        current()?.flags.store(flags, Release);
        Ok(())
    }

    fn cuCtxGetApiVersion(ctx: *mut c_void, version: *mut u32) {
        drv()?;
        if !ctx.is_null() {
            // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed
            // in, which the CUDA ABI makes valid for this call (or NULL, checked there);
            // handles are ones this driver handed out or are rejected by their magic.
            unsafe { Ctx::from_handle(ctx) }?;
        }
        put(version, 3020)
    }

    fn cuCtxGetStreamPriorityRange(least: *mut i32, greatest: *mut i32) {
        drv()?;
        put_opt(least, 0);
        put_opt(greatest, -5);
        Ok(())
    }

    fn cuCtxEnablePeerAccess(peer: *mut c_void, _flags: u32) {
        drv()?;
        // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { Ctx::from_handle(peer) }?;
        current()?;
        Ok(())
    }

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

    // ---- launches ----

    fn cuLaunchKernel(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        _shared: u32, stream: *mut c_void, _params: *mut *mut c_void, _extra: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], stream, false) }
    }

    fn cuLaunchKernel_ptsz(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        _shared: u32, stream: *mut c_void, _params: *mut *mut c_void, _extra: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], stream, true) }
    }

    fn cuLaunchCooperativeKernel(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        _shared: u32, stream: *mut c_void, _params: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], stream, false) }
    }

    fn cuLaunchCooperativeKernel_ptsz(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        _shared: u32, stream: *mut c_void, _params: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], stream, true) }
    }

    fn cuLaunchKernelEx(config: *const LaunchConfig, f: *mut c_void, _params: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = arg(config).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, c.grid, c.block, c.stream, false) }
    }

    fn cuLaunchKernelEx_ptsz(config: *const LaunchConfig, f: *mut c_void, _params: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = arg(config).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, c.grid, c.block, c.stream, true) }
    }

    // ---- streams ----

    fn cuStreamCreate(out: *mut *mut c_void, flags: u32) {
        // SAFETY: `stream_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { stream_create(out, flags, 0) }
    }

    fn cuStreamCreateWithPriority(out: *mut *mut c_void, flags: u32, priority: i32) {
        // SAFETY: `stream_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { stream_create(out, flags, priority) }
    }

    fn cuStreamDestroy(h: *mut c_void) {
        // SAFETY: `stream_destroy` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { stream_destroy(h) }
    }

    fn cuStreamDestroy_v2(h: *mut c_void) {
        // SAFETY: `stream_destroy` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { stream_destroy(h) }
    }

    fn cuStreamSynchronize(h: *mut c_void) {
        // SAFETY: `stream_sync` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { stream_sync(h, false) }
    }

    fn cuStreamSynchronize_ptsz(h: *mut c_void) {
        // SAFETY: `stream_sync` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { stream_sync(h, true) }
    }

    fn cuStreamQuery(h: *mut c_void) {
        // SAFETY: `stream_query` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { stream_query(h, false) }
    }

    fn cuStreamQuery_ptsz(h: *mut c_void) {
        // SAFETY: `stream_query` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { stream_query(h, true) }
    }

    fn cuStreamGetFlags(h: *mut c_void, flags: *mut u32) {
        drv()?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let f = match unsafe { Target::of(h, false) }? { Target::Stream(s) => s.flags, _ => 0 };
        put(flags, f)
    }

    fn cuStreamGetFlags_ptsz(h: *mut c_void, flags: *mut u32) {
        drv()?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let f = match unsafe { Target::of(h, true) }? { Target::Stream(s) => s.flags, _ => 0 };
        put(flags, f)
    }

    fn cuStreamGetPriority(h: *mut c_void, priority: *mut i32) {
        drv()?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let p = match unsafe { Target::of(h, false) }? { Target::Stream(s) => s.priority, _ => 0 };
        put(priority, p)
    }

    fn cuStreamGetPriority_ptsz(h: *mut c_void, priority: *mut i32) {
        drv()?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let p = match unsafe { Target::of(h, true) }? { Target::Stream(s) => s.priority, _ => 0 };
        put(priority, p)
    }

    fn cuStreamGetCtx(h: *mut c_void, ctx: *mut *mut c_void) {
        drv()?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        put(ctx, unsafe { Target::of(h, false) }?.ctx().handle())
    }

    fn cuStreamGetCtx_ptsz(h: *mut c_void, ctx: *mut *mut c_void) {
        drv()?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        put(ctx, unsafe { Target::of(h, true) }?.ctx().handle())
    }

    fn cuStreamWaitEvent(h: *mut c_void, ev: *mut c_void, _flags: u32) {
        drv()?;
        // SAFETY: `event` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let e = unsafe { event(ev) }?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let t = unsafe { Target::of(h, false) }?;
        if crate::capture::wait_event(t, ev)? {
            return Ok(());
        }
        t.set_tail(e.time.load(Acquire));
        Ok(())
    }

    fn cuStreamWaitEvent_ptsz(h: *mut c_void, ev: *mut c_void, _flags: u32) {
        drv()?;
        // SAFETY: `event` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let e = unsafe { event(ev) }?;
        // SAFETY: `Target::of` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let t = unsafe { Target::of(h, true) }?;
        if crate::capture::wait_event(t, ev)? {
            return Ok(());
        }
        t.set_tail(e.time.load(Acquire));
        Ok(())
    }

    // ---- events ----

    fn cuEventCreate(out: *mut *mut c_void, flags: u32) {
        drv()?;
        current()?;
        if out.is_null() || flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let e = Box::new(Event { magic: EVENT_MAGIC, flags, time: AtomicU64::new(0) });
        put(out, Box::into_raw(e).cast())?;
        Ok(())
    }

    fn cuEventRecord(ev: *mut c_void, stream: *mut c_void) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, false) }
    }

    fn cuEventRecord_ptsz(ev: *mut c_void, stream: *mut c_void) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, true) }
    }

    fn cuEventRecordWithFlags(ev: *mut c_void, stream: *mut c_void, _flags: u32) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, false) }
    }

    fn cuEventRecordWithFlags_ptsz(ev: *mut c_void, stream: *mut c_void, _flags: u32) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, true) }
    }

    fn cuEventQuery(ev: *mut c_void) {
        drv()?;
        // SAFETY: `event` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        if unsafe { event(ev) }?.time.load(Acquire) > now_ns() {
            return Err(CUDA_ERROR_NOT_READY);
        }
        Ok(())
    }

    fn cuEventSynchronize(ev: *mut c_void) {
        let d = drv()?;
        // SAFETY: `event` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        wait_until(unsafe { event(ev) }?.time.load(Acquire));
        crate::pool::at_sync(d);
        Ok(())
    }

    fn cuEventElapsedTime(ms: *mut f32, start: *mut c_void, end: *mut c_void) {
        // SAFETY: `elapsed` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { elapsed(ms, start, end) }
    }

    fn cuEventElapsedTime_v2(ms: *mut f32, start: *mut c_void, end: *mut c_void) {
        // SAFETY: `elapsed` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { elapsed(ms, start, end) }
    }

    fn cuEventDestroy(ev: *mut c_void) {
        // SAFETY: `event_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_destroy(ev) }
    }

    fn cuEventDestroy_v2(ev: *mut c_void) {
        // SAFETY: `event_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_destroy(ev) }
    }
}

/// `CUlaunchConfig` (x86_64 layout).
#[repr(C)]
pub struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: *mut c_void,
    attrs: *mut c_void,
    num_attrs: u32,
}

/// `CU_EVENT_DISABLE_TIMING`.
const EVENT_DISABLE_TIMING: u32 = 2;

unsafe fn elapsed(ms: *mut f32, start: *mut c_void, end: *mut c_void) -> R {
    drv()?;
    // SAFETY: `ev`/`start`/`end` are our caller's event handles, passed on under this
    // function's own contract; `event` checks their magic.
    let (a, b) = unsafe { (event(start)?, event(end)?) };
    if ms.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if (a.flags | b.flags) & EVENT_DISABLE_TIMING != 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let (ta, tb) = (a.time.load(Acquire), b.time.load(Acquire));
    if ta == 0 || tb == 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if ta.max(tb) > now_ns() {
        return Err(CUDA_ERROR_NOT_READY);
    }
    put(ms, ((tb as f64 - ta as f64) / 1e6) as f32)?;
    Ok(())
}

unsafe fn event_destroy(ev: *mut c_void) -> R {
    drv()?;
    // SAFETY: `ev`/`start`/`end` are our caller's event handles, passed on under this
    // function's own contract; `event` checks their magic.
    unsafe { event(ev)? };
    let e = ev as *mut Event;
    // SAFETY: the handle passed its magic check, so it is a Box this driver leaked; the magic
    // is zeroed and the Box freed once, here, under the destroy call.
    unsafe {
        (*e).magic = 0;
        drop(Box::from_raw(e));
    }
    Ok(())
}
