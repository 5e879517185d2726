//! Compute tiers (docs/qos.md): a batch-tier process holds its launches
//! while a latency-tier process on its GPU has work in flight; a
//! latency-tier process says when it has, in a flag only it can write.
//! The manager hands a batch process the GPU's page (read-only: how many
//! latency processes there are) at registration and the latency flags
//! (read-only) when it asks ([`flags_wanted`], the watcher's tick); a
//! latency process its flags (`qos_page`).
//!
//! Launch path ([`before_launch`]): one load of [`ROLE`] for a process of
//! neither tier; a batch process also loads the page's count of latency
//! processes and how many more pages it watches (0 and 0: nothing more to
//! do). Everything else is out of line.
//!
//! A share on several GPUs has a page per GPU: a latency process marks the
//! page of its launch's device (the current context's, as its compute
//! quota draws from that device's bucket), and a batch process, once some
//! page of its GPUs counts a latency process, holds only for its launch's
//! device's page. Both look the device up out of line.
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
//! stream or event; on several GPUs, only the page of the device it waited
//! for; a stream's, only once every stream it launched onto there is done:
//! [`flight`]) or [`LATENCY_HOLD_NS`] after its last launch,
//! whichever is first: a
//! process that never synchronises (it polls) cannot hold batch work for
//! longer than that after it stopped launching. A batch launch waits at
//! most [`MAX_HOLD_NS`] in one go, so a latency tenant that keeps the GPU
//! busy still leaves batch work a little progress (its own quota bounds
//! how busy that is).

mod flight;
mod window;

use crate::log::log;
use crate::real::real_cuda;
use crate::throttle::bucket::now_ns;
use qos_page::{Flag, FlagView, QosPage, Tier};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
/// Batch: the first page's count of registered latency processes.
static LIVE: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());
/// Batch on several GPUs: the other pages' counts (the first [`MORE_MAX`]
/// of them: the launch path reads no further), and how many are set.
const MORE_MAX: usize = 15;
static MORE: [AtomicPtr<AtomicU64>; MORE_MAX] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MORE_MAX];
static N_MORE: AtomicUsize = AtomicUsize::new(0);
/// What the manager handed for one GPU of the share: a batch process the
/// GPU's page (read-only), a latency process its own flag (writable by it
/// alone).
#[derive(Clone, Copy)]
pub enum Grant {
    Batch(QosPage),
    Latency(Flag),
}

/// The grants (one per GPU of the share), for the out-of-line paths.
static PAGES: Mutex<Vec<Grant>> = Mutex::new(Vec::new());

/// A batch process's latency flags, per page, and what it asked for.
struct Flags {
    views: Vec<Vec<FlagView>>,
    /// The pages' generations the views answer (`u64::MAX`: none yet).
    seen: Vec<u64>,
    /// The generations when it last asked, and when.
    asking: Vec<u64>,
    asked_at: Option<Instant>,
}

static FLAGS: Mutex<Flags> = Mutex::new(Flags {
    views: Vec::new(),
    seen: Vec::new(),
    asking: Vec::new(),
    asked_at: None,
});

/// Asks again at most this often while a page counts more latency
/// processes than flags came (one not sealed yet, or a manager that
/// answers late).
const ASK_EVERY: Duration = Duration::from_millis(100);

fn flags() -> std::sync::MutexGuard<'static, Flags> {
    FLAGS.lock().unwrap_or_else(|e| e.into_inner())
}

fn word(p: &QosPage) -> *mut AtomicU64 {
    p.live_word() as *const AtomicU64 as *mut AtomicU64
}

/// The registration's answer: this process's tier and its GPUs' grants. A
/// re-registration may hand new ones (a restarted manager): old mappings
/// stay (never unmapped); a batch process asks for the new flags.
pub fn on_register(tier: Tier, pages: Vec<Grant>) {
    let batch = |g: &Grant| matches!(g, Grant::Batch(_));
    let role = match tier {
        _ if pages.is_empty() => NONE,
        Tier::Batch if pages.iter().all(batch) => BATCH,
        Tier::Latency if !pages.iter().any(batch) => LATENCY,
        _ => NONE,
    };
    // Not while a launch may read them as a batch process's.
    ROLE.store(NONE, Ordering::Release);
    let live: Vec<*mut AtomicU64> = pages
        .iter()
        .map(|g| match g {
            Grant::Batch(p) => word(p),
            Grant::Latency(_) => std::ptr::null_mut(),
        })
        .collect();
    if let Some(&first) = live.first().filter(|w| !w.is_null()) {
        LIVE.store(first, Ordering::Release);
    }
    let more = live.get(1..).unwrap_or_default();
    for (slot, &w) in MORE.iter().zip(more) {
        slot.store(w, Ordering::Release);
    }
    N_MORE.store(more.len().min(MORE_MAX), Ordering::Release);
    {
        let mut f = flags();
        f.views = vec![Vec::new(); pages.len()];
        f.seen = vec![u64::MAX; pages.len()];
        f.asked_at = None;
    }
    *PAGES.lock().unwrap_or_else(|e| e.into_inner()) = pages;
    ROLE.store(role, Ordering::Release);
}

/// The watcher's tick: whether a batch process should ask the manager for
/// its GPUs' latency flags now (a page's generation moved, or it counts
/// more latency processes than flags came, asked at most every
/// [`ASK_EVERY`]). Marks the question asked.
pub fn flags_wanted() -> bool {
    if ROLE.load(Ordering::Acquire) != BATCH {
        return false;
    }
    let pages = PAGES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut f = flags();
    let gens: Vec<u64> = pages
        .iter()
        .map(|g| match g {
            Grant::Batch(p) => p.generation(),
            Grant::Latency(_) => 0,
        })
        .collect();
    let short = pages.iter().enumerate().any(|(i, g)| match g {
        Grant::Batch(p) => p.latency_live() as usize > f.views.get(i).map_or(0, Vec::len),
        Grant::Latency(_) => false,
    });
    if gens == f.seen && !short {
        return false;
    }
    if f.asked_at.is_some_and(|t| t.elapsed() < ASK_EVERY) {
        return false;
    }
    f.asked_at = Some(Instant::now());
    f.asking = gens;
    true
}

/// The manager's answer to `QOS_FLAGS`: `fds[i]` is the flag of latency
/// slot `flags[i].1` in page `flags[i].0`, each mapped read-only (a
/// descriptor that is not a sealed flag is left out, logged).
pub fn on_flags(flags_of: &[(u32, u32)], fds: Vec<OwnedFd>) {
    let mut f = flags();
    let mut views = vec![Vec::new(); f.seen.len()];
    for (&(page, slot), fd) in flags_of.iter().zip(&fds) {
        match (views.get_mut(page as usize), FlagView::open(fd.as_fd())) {
            (Some(v), Ok(view)) => v.push(view),
            (_, Err(e)) => log!(Warn, "latency flag {slot} of QoS page {page} left out: {e}"),
            (None, _) => log!(
                Warn,
                "a latency flag for QoS page {page}, which this share lacks"
            ),
        }
    }
    f.views = views;
    f.seen = std::mem::take(&mut f.asking);
}

/// When the latency work on device `dev` still counts at `now`: the latest
/// of its flags' deadlines past `now`.
fn held_until(dev: usize, now: u64) -> Option<u64> {
    let f = flags();
    let deadlines = f.views.get(dev)?.iter().map(FlagView::deadline);
    deadlines.filter(|&d| d > now).max()
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
            if (live.load(Ordering::Relaxed) != 0 || more_live()) && !captured() {
                batch_beside_latency(stream, ptsz);
            }
        }
        _ => latency_launch(stream, ptsz, captured),
    }
}

/// Whether a latency process is registered on another GPU of the share.
#[inline(always)]
fn more_live() -> bool {
    let n = N_MORE.load(Ordering::Relaxed);
    // SAFETY: the first `n` were set (before ROLE) to words of mappings
    // never unmapped.
    n != 0
        && MORE[..n]
            .iter()
            .any(|w| unsafe { &*w.load(Ordering::Acquire) }.load(Ordering::Relaxed) != 0)
}

/// The share's index of the calling thread's current device: 0 on a
/// one-GPU share.
fn current_index() -> Option<usize> {
    if N_MORE.load(Ordering::Relaxed) == 0 {
        Some(0)
    } else {
        crate::devices::current()
    }
}

/// The grant of the share's device `dev`.
fn grant(dev: usize) -> Option<Grant> {
    PAGES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(dev)
        .copied()
}

#[cold]
#[inline(never)]
fn batch_beside_latency(stream: Stream, ptsz: bool) {
    let Some(dev) = current_index() else { return };
    let Some(Grant::Batch(page)) = grant(dev) else {
        return;
    };
    if page.latency_live() == 0 {
        // The latency process is on another GPU of the share.
        return;
    }
    hold(dev);
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

/// Waits while a latency flag of the share's device `dev` says its
/// process has work, up to [`MAX_HOLD_NS`]; counts the wait in the
/// container's ledger of that device.
fn hold(dev: usize) {
    let t0 = now_ns();
    let mut now = t0;
    while let Some(until) = held_until(dev, now) {
        if now - t0 >= MAX_HOLD_NS {
            break;
        }
        let nap = (until - now).min(HOLD_STEP_NS);
        std::thread::sleep(Duration::from_nanos(nap));
        now = now_ns();
    }
    if now > t0 {
        let p = crate::registration::proc();
        if let Some(a) = p.attach().as_ref().filter(|a| dev < a.gpus.len()) {
            a.gpu(dev).ledger.add_qos_held_ns(now - t0);
        }
    }
}

#[cold]
#[inline(never)]
fn latency_launch(stream: Stream, ptsz: bool, captured: impl FnOnce() -> bool) {
    if captured() {
        // Recorded into a graph: nothing runs until the graph's launch.
        return;
    }
    let Some(dev) = current_index() else { return };
    if let Some(Grant::Latency(flag)) = grant(dev) {
        flag.busy(now_ns() + LATENCY_HOLD_NS);
        flight::launched(dev, stream, ptsz);
    }
}

/// What a synchronize or query waited for: the device whose page a
/// latency process clears.
#[derive(Clone, Copy)]
pub(crate) enum Synced {
    /// The current context (a context synchronize; an event's, whose
    /// context the driver does not say: it was current when the event
    /// was recorded, as launches are attributed to the current one).
    Current,
    /// A context named by the caller (NULL: the current one).
    Ctx(*mut std::ffi::c_void),
    /// A stream (`true`: a per-thread variant): its context's device.
    Stream(Stream, bool),
    /// An event: the stream it was recorded on, up to its record; one
    /// whose record is not known, as [`Synced::Current`].
    Event(*mut std::ffi::c_void),
}

/// After `cuEventRecord` (any variant) of `event` onto `stream`: a latency
/// process remembers what the event will say done.
#[inline(always)]
pub(crate) fn after_record(
    r: cuda_abi::CUresult,
    event: *mut std::ffi::c_void,
    stream: Stream,
    ptsz: bool,
) {
    if r == cuda_abi::CUDA_SUCCESS && ROLE.load(Ordering::Relaxed) == LATENCY {
        latency_record(event, stream, ptsz);
    }
}

type Record = unsafe extern "C" fn(*mut std::ffi::c_void, Stream) -> cuda_abi::CUresult;
type RecordFlags = unsafe extern "C" fn(*mut std::ffi::c_void, Stream, u32) -> cuda_abi::CUresult;

// Wrapped only for the compute tiers: an event's synchronize or query then
// says which stream's work is done, up to where (Synced::Event).
cuda_exports! {
    fn cuEventRecord(event: *mut std::ffi::c_void, stream: Stream) {
        let f = real_cuda!(cuEventRecord: Record);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's, passed on unchanged.
        let r = unsafe { f(event, stream) };
        after_record(r, event, stream, false);
        r
    }

    fn cuEventRecord_ptsz(event: *mut std::ffi::c_void, stream: Stream) {
        let f = real_cuda!(cuEventRecord_ptsz: Record);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's, passed on unchanged.
        let r = unsafe { f(event, stream) };
        after_record(r, event, stream, true);
        r
    }

    fn cuEventRecordWithFlags(event: *mut std::ffi::c_void, stream: Stream, flags: u32) {
        let f = real_cuda!(cuEventRecordWithFlags: RecordFlags);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's, passed on unchanged.
        let r = unsafe { f(event, stream, flags) };
        after_record(r, event, stream, false);
        r
    }

    fn cuEventRecordWithFlags_ptsz(event: *mut std::ffi::c_void, stream: Stream, flags: u32) {
        let f = real_cuda!(cuEventRecordWithFlags_ptsz: RecordFlags);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's, passed on unchanged.
        let r = unsafe { f(event, stream, flags) };
        after_record(r, event, stream, true);
        r
    }
}

#[cold]
#[inline(never)]
fn latency_record(event: *mut std::ffi::c_void, stream: Stream, ptsz: bool) {
    let captured = crate::graph::captured(stream, ptsz);
    flight::recorded(event as usize, stream, ptsz, captured);
}

/// After a context, stream or event synchronize, or a stream or event
/// query: a latency process that synchronised successfully, or learnt its
/// work is done, has nothing in flight on that device.
#[inline(always)]
pub(crate) fn after_sync(r: cuda_abi::CUresult, on: Synced) {
    if r == cuda_abi::CUDA_SUCCESS && ROLE.load(Ordering::Relaxed) == LATENCY {
        latency_idle(on);
    }
}

#[cold]
#[inline(never)]
fn latency_idle(on: Synced) {
    // One GPU: whatever it waited for ran there. On several, only the
    // device it waited for: a synchronize of gpu-0's stream says nothing
    // of a request still running on gpu-1. A device not found clears
    // nothing (its mark ends LATENCY_HOLD_NS after the last launch).
    let one = N_MORE.load(Ordering::Relaxed) == 0;
    let record = match on {
        Synced::Event(e) => flight::record_of(e as usize),
        _ => None,
    };
    let dev = match (on, record) {
        _ if one => Some(0),
        (_, Some(r)) => stream_ctx(r.stream, r.ptsz).and_then(ctx_device),
        (Synced::Current | Synced::Event(_), None) => current_index(),
        (Synced::Ctx(ctx), None) => ctx_device(ctx),
        (Synced::Stream(s, ptsz), None) => stream_ctx(s, ptsz).and_then(ctx_device),
    };
    let Some(dev) = dev else { return };
    let idle = match (on, record) {
        (_, Some(r)) => flight::event_done(dev, r),
        (Synced::Stream(s, ptsz), _) => flight::stream_done(dev, s, ptsz),
        _ => flight::device_done(dev),
    };
    if let (true, Some(Grant::Latency(flag))) = (idle, grant(dev)) {
        flag.idle();
    }
}

type Ctx = *mut std::ffi::c_void;
type CtxOut = unsafe extern "C" fn(*mut Ctx) -> cuda_abi::CUresult;
const OK: cuda_abi::CUresult = cuda_abi::CUDA_SUCCESS;

fn stream_ctx(stream: Stream, ptsz: bool) -> Option<Ctx> {
    let mut ctx = std::ptr::null_mut();
    (get_stream_ctx(stream, ptsz, &mut ctx) == OK).then_some(ctx)
}

fn get_stream_ctx(stream: Stream, ptsz: bool, ctx: &mut Ctx) -> cuda_abi::CUresult {
    type Get = unsafe extern "C" fn(Stream, *mut Ctx) -> cuda_abi::CUresult;
    let f = if ptsz {
        real_cuda!(cuStreamGetCtx_ptsz: Get)
    } else {
        real_cuda!(cuStreamGetCtx: Get)
    };
    // SAFETY: the real driver's function of this signature; the stream is
    // the one our caller synchronised, `ctx` our caller's local.
    unsafe { f(stream, ctx) }
}

fn ctx_current(cur: &mut Ctx) -> cuda_abi::CUresult {
    let f = real_cuda!(cuCtxGetCurrent: CtxOut);
    // SAFETY: the real driver's function of this signature; `cur` is our
    // caller's local.
    unsafe { f(cur) }
}

fn ctx_push(ctx: Ctx) -> cuda_abi::CUresult {
    let f = real_cuda!(cuCtxPushCurrent_v2: unsafe extern "C" fn(Ctx) -> cuda_abi::CUresult);
    // SAFETY: the real driver's function of this signature, given a
    // context the driver handed out (it refuses others).
    unsafe { f(ctx) }
}

fn ctx_pop() -> cuda_abi::CUresult {
    let f = real_cuda!(cuCtxPopCurrent_v2: CtxOut);
    let mut popped = std::ptr::null_mut();
    // SAFETY: the real driver's function of this signature; `popped` is
    // our local.
    unsafe { f(&mut popped) }
}

/// The share's index of `ctx`'s device (NULL or the current context: the
/// current device), looked up with `ctx` pushed for the moment.
fn ctx_device(ctx: Ctx) -> Option<usize> {
    let mut cur = std::ptr::null_mut();
    if ctx.is_null() || (ctx_current(&mut cur) == OK && cur == ctx) {
        return crate::devices::current();
    }
    if ctx_push(ctx) != OK {
        return None;
    }
    let dev = crate::devices::current();
    let _ = ctx_pop();
    dev
}
