//! Stream capture modes, enforced as NVIDIA's driver documents them.
//!
//! A thread's mode (`cuThreadExchangeStreamCaptureMode`, default GLOBAL)
//! decides whether it may make *potentially unsafe* calls while captures
//! are open (cuThreadExchangeStreamCaptureMode's documentation):
//!
//! * GLOBAL: prohibited if this thread has an open capture not begun in
//!   RELAXED mode, or any thread has one begun in GLOBAL mode;
//! * THREAD_LOCAL: prohibited only by this thread's own non-RELAXED capture;
//! * RELAXED: never prohibited.
//!
//! A prohibited call fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900)
//! without doing anything and invalidates the captures that prohibited it:
//! their further captured work fails with
//! CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901), and so does
//! `cuStreamEndCapture`, which returns a NULL graph (CUDA Programming Guide,
//! "Prohibited and Unhandled Operations" / "Invalidation").
//!
//! Potentially unsafe here: synchronous allocation and free (`cuMemAlloc*`,
//! `cuMemFree`, pinned host memory; the documentation's own example is
//! cudaMalloc), synchronous copies and sets (they use and synchronise the
//! legacy stream), `cuCtxSynchronize`, stream and event synchronisation
//! and queries (PyTorch's NCCL watchdog invalidated GLOBAL captures with
//! cudaEventQuery on events recorded before the capture, pytorch#104555,
//! fixed by running the watchdog in THREAD_LOCAL mode, pytorch#148594),
//! and memory pool attributes (refused while capturing, NVIDIA/cccl#11360).
//! Module load and unload are too on real drivers (NVIDIA/warp reports 900
//! from cuModuleUnload during capture); not enforced here.
//!
//! Independent of the mode ("necessarily conflict with stream capture"):
//! synchronising or querying a capturing stream or an event recorded in a
//! capture, and any use of the legacy stream while a blocking stream of
//! its context captures.

use crate::capture::CAPTURING;
use crate::graph::{self, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED};
use crate::stream::Target;
use crate::{R, ctx::Ctx};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

pub(crate) const GLOBAL: u32 = 0;
pub(crate) const RELAXED: u32 = 2;

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's `CUstreamCaptureMode`.
    static MODE: Cell<u32> = const { Cell::new(GLOBAL) };
    /// A process-unique id of this thread (capture ownership).
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Relaxed);
}

/// Sets this thread's mode; the previous one.
pub(crate) fn exchange(mode: u32) -> u32 {
    MODE.with(|m| m.replace(mode))
}

pub(crate) fn thread_id() -> u64 {
    THREAD.with(|t| *t)
}

/// A potentially unsafe call: Err(900) and invalidation when this thread's
/// mode and the open captures prohibit it. One relaxed load while nothing
/// captures.
#[inline]
pub(crate) fn unsafe_call() -> R {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(());
    }
    let mode = MODE.with(Cell::get);
    if mode == RELAXED {
        return Ok(());
    }
    let me = thread_id();
    let hit = graph::state().capture.invalidate(|s| {
        s.mode != RELAXED && (s.thread == me || (mode == GLOBAL && s.mode == GLOBAL))
    });
    if hit {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

/// Synchronising or querying `t`: refused (and its capture invalidated) when
/// `t` captures, or is the legacy stream while a blocking stream of its
/// context captures; otherwise a potentially unsafe call.
pub(crate) fn sync_point(t: Target) -> R {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(());
    }
    conflict(t)?;
    unsafe_call()
}

/// Work enqueued on `t`, or a sync of it, that necessarily conflicts with an
/// open capture (whatever the mode): `t` is the legacy stream and a blocking
/// stream of its context captures, or `t` itself captures.
fn conflict(t: Target) -> R {
    let mut st = graph::state();
    let hit = match t {
        Target::Legacy(c) => st
            .capture
            .invalidate_streams(|s| s.blocking && s.ctx == ctx_key(c)),
        _ => st.capture.invalidate_stream(t),
    };
    if hit {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

/// Work enqueued on the legacy stream (a launch, an event record).
#[inline]
pub(crate) fn legacy_use(t: Target) -> R {
    if CAPTURING.load(Relaxed) == 0 || !matches!(t, Target::Legacy(_)) {
        return Ok(());
    }
    conflict(t)
}

/// Synchronising or querying event `ev`: refused when it was recorded in an
/// open capture; otherwise a potentially unsafe call.
pub(crate) fn event_sync_point(ev: *mut std::ffi::c_void) -> R {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(());
    }
    if graph::state().capture.invalidate_event(ev as usize) {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    unsafe_call()
}

pub(crate) fn ctx_key(c: &Ctx) -> usize {
    c as *const Ctx as usize
}

/// `cuCtxSynchronize`: refused when a stream of `c` captures (the context
/// encompasses it); otherwise a potentially unsafe call.
pub(crate) fn ctx_sync(c: &Ctx) -> R {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(());
    }
    let key = ctx_key(c);
    if graph::state().capture.invalidate_streams(|s| s.ctx == key) {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    unsafe_call()
}
