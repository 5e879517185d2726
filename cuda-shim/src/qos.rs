//! Compute tiers (docs/qos.md): a batch-tier process holds its launches
//! while a latency-tier process on its GPU has work in flight; a
//! latency-tier process says when it has. Both through the GPU's QoS page
//! (`qos_page`), which the manager hands over at registration.
//!
//! Launch path ([`before_launch`]): one load of [`ROLE`] for a process of
//! neither tier; a batch process also loads the page's count of latency
//! processes (0: nothing more to do). Everything else is out of line.
//!
//! While a latency process is registered on the GPU, a batch process keeps
//! about [`window::QUEUE_NS`] of device time queued per stream, one launch
//! at least ([`window`]; not while the stream is being captured): its queue
//! is what a latency request arriving at any moment waits behind, and the
//! driver's time-slicing lets it in only at the end of a timeslice or of
//! that queue. While a latency process has work in flight, batch launches
//! are held altogether.
//!
//! A latency process marks itself busy at each launch, until a
//! synchronize returns or a query says done ([`after_sync`]: context,
//! stream or event) or [`LATENCY_HOLD_NS`] after its last launch,
//! whichever is first: a
//! process that never synchronises (it polls) cannot hold batch work for
//! longer than that after it stopped launching. A batch launch waits at
//! most [`MAX_HOLD_NS`] in one go, so a latency tenant that keeps the GPU
//! busy still leaves batch work a little progress (its own quota bounds
//! how busy that is).

mod window;

use crate::real::real_cuda;
use crate::throttle::bucket::now_ns;
use qos_page::{Holder, QosPage, Tier};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

/// How long a latency launch counts as in flight without a synchronize.
pub const LATENCY_HOLD_NS: u64 = 20_000_000;
type Stream = *mut std::ffi::c_void;

/// The longest one batch launch waits.
pub const MAX_HOLD_NS: u64 = 100_000_000;
/// A held launch looks again this often (the latency work may end sooner
/// than its deadline says).
const HOLD_STEP_NS: u64 = 50_000;

const NONE: u8 = 0;
const BATCH: u8 = 1;
const LATENCY: u8 = 2;

/// This process's role on the launch path.
static ROLE: AtomicU8 = AtomicU8::new(NONE);
/// Batch: the page's count of registered latency processes.
static LIVE: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());
/// A GPU's QoS page as the manager handed it, with a latency process's slot.
pub type Grant = (QosPage, Option<Holder>);

/// The page and (latency) the slot, for the out-of-line paths.
static PAGE: Mutex<Option<Grant>> = Mutex::new(None);

/// The registration's answer: this process's tier and its GPU's page (with
/// a slot for a latency process). A re-registration may hand a new page (a
/// restarted manager): the old mapping stays (never unmapped).
pub fn on_register(tier: Tier, page: Option<Grant>) {
    let role = match (tier, &page) {
        (Tier::Batch, Some(_)) => BATCH,
        (Tier::Latency, Some((_, Some(_)))) => LATENCY,
        _ => NONE,
    };
    if let Some((p, _)) = &page {
        LIVE.store(
            p.live_word() as *const AtomicU64 as *mut AtomicU64,
            Ordering::Release,
        );
    }
    *PAGE.lock().unwrap_or_else(|e| e.into_inner()) = page;
    ROLE.store(role, Ordering::Release);
}

/// Before each launch onto `stream` (`ptsz`: a per-thread variant; see the
/// module header). `captured`: is the stream being recorded into a graph?
#[inline(always)]
pub(crate) fn before_launch(stream: Stream, ptsz: bool, captured: impl FnOnce() -> bool) {
    match ROLE.load(Ordering::Relaxed) {
        NONE => {}
        BATCH => {
            // SAFETY: set (before ROLE) to a word of a mapping never unmapped.
            let live = unsafe { &*LIVE.load(Ordering::Acquire) };
            if live.load(Ordering::Relaxed) != 0 && !captured() {
                batch_beside_latency(stream, ptsz);
            }
        }
        _ => latency_launch(),
    }
}

fn page() -> Option<Grant> {
    *PAGE.lock().unwrap_or_else(|e| e.into_inner())
}

#[cold]
#[inline(never)]
fn batch_beside_latency(stream: Stream, ptsz: bool) {
    let Some((page, _)) = page() else { return };
    hold(page);
    if !window::before_launch(stream, ptsz) {
        // A bound of one launch: what is queued now must end first.
        let _ = sync_stream(stream, ptsz);
    }
}

fn sync_stream(stream: Stream, ptsz: bool) -> cuda_abi::CUresult {
    type Sync = unsafe extern "C" fn(Stream) -> cuda_abi::CUresult;
    let f = if ptsz {
        real_cuda!(cuStreamSynchronize_ptsz: Sync)
    } else {
        real_cuda!(cuStreamSynchronize: Sync)
    };
    // SAFETY: the real driver's function of this signature; the stream is
    // the one our caller is about to launch onto.
    unsafe { f(stream) }
}

fn hold(page: QosPage) {
    let t0 = now_ns();
    let mut now = t0;
    while let Some(until) = page.held_until(now) {
        if now - t0 >= MAX_HOLD_NS {
            break;
        }
        let nap = (until - now).min(HOLD_STEP_NS);
        std::thread::sleep(Duration::from_nanos(nap));
        now = now_ns();
    }
    if now > t0 {
        page.add_held(now - t0);
    }
}

#[cold]
#[inline(never)]
fn latency_launch() {
    if let Some((page, Some(h))) = page() {
        page.busy(h, now_ns() + LATENCY_HOLD_NS);
    }
}

/// After a context, stream or event synchronize, or a stream or event
/// query: a latency process that synchronised successfully, or learnt its
/// work is done, has nothing in flight.
#[inline(always)]
pub(crate) fn after_sync(r: cuda_abi::CUresult) {
    if r == cuda_abi::CUDA_SUCCESS && ROLE.load(Ordering::Relaxed) == LATENCY {
        latency_idle();
    }
}

#[cold]
#[inline(never)]
fn latency_idle() {
    if let Some((page, Some(h))) = page() {
        page.idle(h);
    }
}
