//! Streams: created streams, the legacy and per-thread default streams, and
//! `Target`, where work submitted to a stream handle lands (its simulated
//! tail).

use crate::ctx::{Ctx, current, done, wait_done};
use crate::event::event;
use crate::{R, drv, put};
use cuda_abi::*;
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering::*};

const STREAM_MAGIC: u64 = 0x5349_4d53_5452_0001;

/// `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD` handles.
const STREAM_LEGACY: usize = 1;
const STREAM_PER_THREAD: usize = 2;

thread_local! {
    /// Tail of this thread's per-thread default stream.
    static PER_THREAD_TAIL: Cell<u64> = const { Cell::new(0) };
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

    /// A created stream without CU_STREAM_NON_BLOCKING: the legacy stream
    /// synchronises with it.
    pub fn blocking(self) -> bool {
        matches!(self, Target::Stream(s) if s.flags & 1 == 0)
    }

    #[inline]
    pub fn ctx(self) -> &'static Ctx {
        match self {
            Target::Legacy(c) | Target::PerThread(c) => c,
            Target::Stream(s) => s.ctx,
        }
    }

    /// The stream's priority (0 but for streams created with a greater
    /// one: -1 to -5).
    #[inline]
    pub fn priority(self) -> i32 {
        match self {
            Target::Stream(s) => s.priority,
            _ => 0,
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

unsafe fn stream_sync(h: *mut c_void, ptsz: bool) -> R {
    let d = drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(h, ptsz)? };
    crate::capture_mode::sync_point(t)?;
    wait_done(t.ctx().gpu, t.tail());
    crate::pool::at_sync(d);
    Ok(())
}

unsafe fn stream_query(h: *mut c_void, ptsz: bool) -> R {
    drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(h, ptsz)? };
    crate::capture_mode::sync_point(t)?;
    if !done(t.ctx().gpu, t.tail()) {
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

cuda_fn! {
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
        t.set_tail(e.time().load(Acquire));
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
        t.set_tail(e.time().load(Acquire));
        Ok(())
    }
}
