//! Contexts: creation and destruction, the calling thread's context stack
//! (current / push / pop) and context-wide queries and synchronisation.
//! Primary contexts are in `primary.rs`, streams in `stream.rs`, events in
//! `event.rs`, kernel launches in `launch.rs`.

use crate::{R, drv, put, put_opt};
use cuda_abi::*;
use gpu_sim_core::state::now_ns;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};

const CTX_MAGIC: u64 = 0x5349_4d43_5458_0001;

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
    pub null_tail: AtomicU64,
    /// Latest simulated end of any work in this context (ctx synchronize).
    pub tail: AtomicU64,
    /// Launches pending on the device (bounded, as a real GPU's queue).
    pub queue: crate::queue::LaunchQueue,
    /// Bit i: peer access to GPU i's memory enabled from this context.
    pub peers: AtomicU64,
    /// Latest simulated end of the work of each raised stream priority
    /// (index k: priority -k; 0 unused): a kernel goes ahead of work of
    /// lower priority only.
    pub raised_tails: [AtomicU64; 6],
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
            queue: crate::queue::LaunchQueue::new(),
            peers: AtomicU64::new(0),
            raised_tails: [const { AtomicU64::new(0) }; 6],
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

    pub fn synchronize(&self) {
        wait_done(self.gpu, self.tail.load(Acquire));
    }
}

thread_local! {
    /// Top of this thread's context stack (a Cell: no TLS destructor, so the
    /// launch path never registers one).
    static CURRENT: Cell<*const Ctx> = const { Cell::new(std::ptr::null()) };
    static BELOW: RefCell<Vec<*const Ctx>> = const { RefCell::new(Vec::new()) };
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

/// The real driver waits for the device by spinning or yielding (its
/// default schedule), so a synchronize returns within microseconds of the
/// work's end; a sleeping thread oversleeps by the kernel's timer slack
/// (50 us by default), which would leave the simulated device idle after
/// every short wait. So the waiting thread asks for 1 us of slack, once.
fn precise_sleeps() {
    thread_local! {
        static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    SET.with(|set| {
        if !set.replace(true) {
            // SAFETY: PR_SET_TIMERSLACK takes an integer and changes only
            // this thread's timer slack.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
        }
    });
}

/// When this process's work on `gpu` that was to end at `t` ends now:
/// later than `t` when other processes' kernels preempted it.
pub(crate) fn end_of(gpu: usize, t: u64) -> u64 {
    match crate::drv() {
        Ok(d) => d.state.resolve(d.me, gpu, t),
        Err(_) => t,
    }
}

/// Whether this process's work on `gpu` that was to end at `t` is done.
pub(crate) fn done(gpu: usize, t: u64) -> bool {
    end_of(gpu, t) <= now_ns()
}

/// Sleeps until this process's work on `gpu` that was to end at the
/// simulated time `t` (CLOCK_MONOTONIC ns) is done, however often other
/// processes' kernels preempt it meanwhile.
pub(crate) fn wait_done(gpu: usize, t: u64) {
    precise_sleeps();
    loop {
        let end = end_of(gpu, t);
        let now = now_ns();
        if now >= end {
            return;
        }
        std::thread::sleep(std::time::Duration::from_nanos(end - now));
    }
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

/// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`.
const PEER_ACCESS_UNSUPPORTED: CUresult = 217;

/// The current context and the bit of `peer`'s GPU, for enabling or
/// disabling peer access: a GPU the topology lets the current one reach
/// (`cuDeviceCanAccessPeer`), never its own.
unsafe fn peer_of(peer: *mut c_void) -> R<(&'static Ctx, u64)> {
    let d = drv()?;
    let me = current()?;
    // SAFETY: our caller's context handle, passed on under this function's contract;
    // `from_handle` checks its magic.
    let p = unsafe { Ctx::from_handle(peer) }?;
    if p.gpu == me.gpu {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    if !d.node().peer_capable(me.gpu, p.gpu) {
        return Err(PEER_ACCESS_UNSUPPORTED);
    }
    Ok((me, 1 << p.gpu))
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
        let c = current()?;
        crate::capture_mode::ctx_sync(c)?;
        c.synchronize();
        crate::pool::at_sync(d);
        Ok(())
    }

    fn cuCtxSynchronize_v2(ctx: *mut c_void) {
        drv()?;
        // SAFETY: `Ctx::from_handle` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        let c = if ctx.is_null() { current()? } else { unsafe { Ctx::from_handle(ctx) }? };
        crate::capture_mode::ctx_sync(c)?;
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

    fn cuCtxEnablePeerAccess(peer: *mut c_void, flags: u32) {
        // SAFETY: `peer_of` gets the context handle our caller passed in; `from_handle`
        // checks its magic.
        let (me, bit) = unsafe { peer_of(peer) }?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if me.peers.fetch_or(bit, AcqRel) & bit != 0 {
            return Err(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    }

    fn cuCtxDisablePeerAccess(peer: *mut c_void) {
        // SAFETY: as in cuCtxEnablePeerAccess.
        let (me, bit) = unsafe { peer_of(peer) }?;
        if me.peers.fetch_and(!bit, AcqRel) & bit == 0 {
            return Err(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
        }
        Ok(())
    }

}
