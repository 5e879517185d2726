//! The compute quota: kernel launches draw from a token bucket
//! shared by every process of the container; one process's watcher thread
//! sets the bucket's rate from NVML feedback.
//!
//! * [`before_launch`] (every launch wrapper, only when the process
//!   enforces quotas): one load when the container has no compute limit;
//!   otherwise the launch's cost in waves ([`cost::kernel_cost`]), one
//!   `fetch_add` and one load while tokens last
//!   ([`bucket::Bucket::take`]), else it sleeps until refilled, at most
//!   its own cost's worth plus live waiters ahead ([`bucket::Bucket::wait`]).
//! * blind feedback (NVML cannot attribute samples to the container) is
//!   detected by the controller ([`controller::Blind`]), logged once and
//!   flagged in the ledger; the quota then falls back, never off.
//! * [`tick`] (the watcher thread, every [`tick_interval`]): refills, and
//!   in the process holding the controller lease (a heartbeat in the
//!   ledger; a silent holder is replaced after [`LEASE_STALE_NS`]) polls
//!   NVML and sets the rate ([`controller`]).
//! * [`on_attach`]: maps the ledger's compute words privately (mremap of
//!   the shared page, never unmapped, so a launch sleeping on them survives
//!   a re-registration that replaces the ledger).
//! * [`after_fork_child`]: the child keeps drawing from the same bucket
//!   (the mapping is inherited) under a new lease identity; its first
//!   throttled launch registers it (the caller's `register`, see
//!   `crate::launch`), which starts its own watcher.
//!
//! A share on several GPUs has one bucket per GPU, in that GPU's ledger,
//! with its own controller (lease, NVML samples of that GPU): a launch
//! draws from the bucket of its context's device, the current one (the
//! driver runs a launch only on a stream of the current context).
//!
//! The watcher (`crate::watcher`) calls in here; this module knows nothing
//! of registration.
//!
//! See README.md, "Compute quota".

pub mod bucket;
pub mod controller;
pub mod cost;
pub mod gpm;
pub mod sampler;
pub(crate) mod timed;

pub(crate) use cost::kernel_cost;

use bucket::{Bucket, now_ns};
use container_ledger::Ledger;
use controller::{Blind, Controller, Decision, Period, Quota};
use quota_config::MAX_GPUS;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

/// The compute words of the container's bucket; null: no compute limit.
/// With a share on several GPUs: some GPU's bucket (a flag for the launch
/// path, which then picks its device's in [`BUCKETS`]).
static BUCKET: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());
/// Each GPU's bucket (ledger position); null: no compute limit there.
static BUCKETS: [AtomicPtr<AtomicU64>; MAX_GPUS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_GPUS];
/// Each GPU's ledger `throttled_ns` counter, in the same never-unmapped
/// page as its bucket; null: not counted (no compute limit, or no shared
/// mapping).
static THROTTLED_NS: [AtomicPtr<AtomicU64>; MAX_GPUS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_GPUS];
/// The share spans several GPUs: a launch's bucket is its device's.
static MULTI: AtomicBool = AtomicBool::new(false);

/// A controller silent this long loses its lease.
pub const LEASE_STALE_NS: u64 = 500_000_000;
/// Tick while throttling: refills keep the launch path on tokens, and NVML
/// periods (100 ms) are acted on within a tick of their end.
const TICK: Duration = Duration::from_millis(20);
const IDLE_TICK: Duration = Duration::from_millis(100);
/// Timed launches the controller's timed scale averages over: twice its
/// NVML scale's window (samples of skewed costs are noisy), short enough
/// that a changed mix is its own 2 s later.
const TIMED_WINDOW_NS: u64 = 2_000_000_000;

/// Called before each kernel launch. `cost`: the launch's
/// [`kernel_cost`] (a sum of them for a graph), 0 when unknown; asked only
/// when the container has a compute limit. `register`: called when the
/// launch first has to sleep (a process that throttles unregistered, a
/// fork child that only launches, registers then). Must stay cheap: the
/// launch path budget is a few ns over the driver.
///
/// Crate-private, as is everything the launch path touches: an item other
/// crates could inline is an exported symbol, which the cdylib then reaches
/// through the GOT (one more dependent load per static, an indirect call).
#[inline(always)]
pub(crate) fn before_launch(cost: impl FnOnce() -> u64, register: fn()) {
    let _ = charge(|| false, cost, register);
}

/// [`before_launch`] for a launch onto `stream`: `captured` (is it being
/// recorded into a graph, not run? see `crate::graph`) is asked only when
/// the container has a compute limit; a captured launch is not charged.
/// The launch is timed on the device when the watcher armed it
/// ([`timed`]): the caller passes the real launch's result to the returned
/// probe. With a compute limit: one more relaxed load.
#[inline(always)]
pub(crate) fn before_launch_on(
    stream: *mut std::ffi::c_void,
    ptsz: bool,
    captured: impl FnOnce() -> bool,
    cost: impl FnOnce() -> u64,
    register: fn(),
) -> timed::Probe {
    match charge(captured, cost, register) {
        Some((gpu, c)) if timed::ARMED.load(Ordering::Relaxed) != 0 => {
            timed::start(gpu, c, stream, ptsz)
        }
        _ => timed::Probe::NONE,
    }
}

/// Draws the launch's cost from its bucket (sleeping when there are no
/// tokens); `Some((gpu, cost))` when it was charged.
#[inline(always)]
fn charge(
    captured: impl FnOnce() -> bool,
    cost: impl FnOnce() -> u64,
    register: fn(),
) -> Option<(usize, u64)> {
    let p = BUCKET.load(Ordering::Acquire);
    if p.is_null() || captured() {
        return None;
    }
    let (p, gpu) = if MULTI.load(Ordering::Relaxed) {
        launch_bucket()?
    } else {
        (p, 0)
    };
    // SAFETY: set only to a mapping that is never unmapped.
    let b = unsafe { Bucket::at(p) };
    let c = cost();
    if let Some(ticket) = b.take(c) {
        throttled(b, gpu, ticket, register);
    }
    Some((gpu, c))
}

/// The bucket of the current context's device, with its GPU's position
/// (a share on several GPUs). `None`: no context, or no limit there.
fn launch_bucket() -> Option<(*mut AtomicU64, usize)> {
    let gpu = crate::devices::current()?;
    let p = BUCKETS.get(gpu)?.load(Ordering::Acquire);
    (!p.is_null()).then_some((p, gpu))
}

/// Out of line: the launch path keeps only the branch to it. The clock is
/// read only here.
#[cold]
#[inline(never)]
fn throttled(b: Bucket, gpu: usize, ticket: bucket::Ticket, register: fn()) {
    count_throttled(gpu, b.wait(ticket, register));
}

/// Adds the time a launch slept for tokens to its GPU's ledger.
#[cold]
fn count_throttled(gpu: usize, ns: u64) {
    let p = THROTTLED_NS[gpu].load(Ordering::Acquire);
    if ns > 0 && !p.is_null() {
        // SAFETY: set only to a word of a mapping that is never unmapped.
        unsafe { &*p }.fetch_add(ns, Ordering::Relaxed);
    }
}

/// The bucket of the GPU at `gpu`, if this process throttles there (GPU 0:
/// a one-GPU container's bucket).
pub fn bucket(gpu: usize) -> Option<Bucket> {
    let p = BUCKETS.get(gpu)?.load(Ordering::Acquire);
    // SAFETY: BUCKETS hold NULL or the compute words of a mapping never unmapped
    // (private_words' mremap copy, or a leaked local array), as Bucket::at requires.
    (!p.is_null()).then(|| unsafe { Bucket::at(p) })
}

/// The compute quota of the config; `None`: no limit (whole GPU, 0 or
/// 100+ percent).
pub fn quota_of(d: &quota_config::ResourceData) -> Option<Quota> {
    quota_from(d.utilization, d.limit, d.hard_limit)
}

/// The compute quota of one GPU of a share.
pub fn quota_of_gpu(g: &quota_config::GpuQuota, hard_limit: bool) -> Option<Quota> {
    quota_from(g.utilization, g.limit, hard_limit)
}

fn quota_from(utilization: i32, limit: i32, hard_limit: bool) -> Option<Quota> {
    if utilization <= 0 || utilization >= 100 {
        return None;
    }
    let u = utilization as f64;
    Some(Quota {
        utilization: u,
        soft_limit: (!hard_limit).then(|| {
            let l = if limit <= 0 { 100 } else { limit.min(100) };
            (l as f64).max(u)
        }),
    })
}

/// The compute quota of the GPU at `gpu` (ledger position).
fn quota(gpu: usize) -> Option<Quota> {
    let e = crate::config::enforce()?;
    quota_of_gpu(e.gpus.get(gpu)?, e.data.hard_limit)
}

/// Periodic work on the watcher thread. `pids`: the host PIDs of the
/// container's processes (whose NVML samples are the container's own).
/// Never unwinds (the watcher must survive a bug here).
pub fn tick(pids: fn() -> Vec<i32>) {
    let _ = std::panic::catch_unwind(|| tick_inner(pids));
}

/// How often [`tick`] runs.
pub fn tick_interval() -> Duration {
    if BUCKET.load(Ordering::Acquire).is_null() {
        IDLE_TICK
    } else {
        TICK
    }
}

/// The process got (or changed) its ledger and slot on the GPU at `gpu`
/// (its position in the share; 0 for a one-GPU container).
pub fn on_attach(gpu: usize, ledger: &Ledger, slot: usize) {
    let _ = slot;
    let Some(q) = quota(gpu) else {
        return;
    };
    if gpu >= MAX_GPUS {
        return;
    }
    if crate::config::enforce().is_some_and(|e| e.gpus() > 1) {
        MULTI.store(true, Ordering::Release);
    }
    let Some(p) = private_words(ledger) else {
        crate::log::log!(
            Error,
            "cannot map the compute area; this process throttles alone"
        );
        let local = Box::leak(Box::new(
            [const { AtomicU64::new(0) }; container_ledger::COMPUTE_WORDS],
        ));
        // SAFETY: leaked, never freed.
        unsafe { Bucket::at(local.as_ptr()) }.start(controller::startup_rate(q));
        THROTTLED_NS[gpu].store(std::ptr::null_mut(), Ordering::Release);
        publish(gpu, local.as_mut_ptr());
        return;
    };
    // SAFETY: `p` is the compute words of private_words' mapping, which is never unmapped.
    let b = unsafe { Bucket::at(p) };
    b.init();
    // From the first launch on, never free: launches queued before the
    // first NVML sample would run after it, whatever the rate then says.
    b.start(controller::startup_rate(q));
    THROTTLED_NS[gpu].store(throttled_word(p).cast_mut(), Ordering::Release);
    publish(gpu, p.cast_mut());
}

/// Makes GPU `gpu`'s bucket the launch path's.
fn publish(gpu: usize, p: *mut AtomicU64) {
    BUCKETS[gpu].store(p, Ordering::Release);
    if gpu == 0 || !MULTI.load(Ordering::Acquire) || BUCKET.load(Ordering::Acquire).is_null() {
        BUCKET.store(p, Ordering::Release);
    }
}

/// The ledger's `throttled_ns` counter in the mapping whose compute words
/// start at `words` (the header page holds both).
fn throttled_word(words: *const AtomicU64) -> *const AtomicU64 {
    // SAFETY: `words` is at COMPUTE_OFFSET in a mapped ledger header page (private_words keeps
    // the page's offset), so the header start is in the same mapping.
    let header = unsafe { words.cast::<u8>().sub(container_ledger::COMPUTE_OFFSET) };
    // SAFETY: THROTTLED_NS_OFFSET (8-aligned) is inside that header page.
    unsafe { header.add(container_ledger::THROTTLED_NS_OFFSET) }.cast()
}

/// Says, once per change, whether the controller can see the container's
/// use, in the log and in the ledger's flag (the manager's metrics).
fn report_blind(ctl: &mut Ctl, gpu: usize) {
    let now = ctl.ctrl.blind();
    if now == ctl.blind {
        return;
    }
    ctl.blind = now;
    match now {
        Some(Blind::OtherPids) => crate::log::log!(
            Warn,
            "compute quota: NVML's samples name none of the container's processes (an MPS \
             client, or a PID namespace): charging the container all busy time"
        ),
        Some(Blind::NoSamples) => crate::log::log!(
            Warn,
            "compute quota: NVML gives no utilisation samples while the container launches \
             (MIG?); holding the last rate (or one assuming {} us waves)",
            controller::ASSUMED_WAVE_NS / 1e3
        ),
        None => crate::log::log!(
            Info,
            "compute quota: the container's use is attributed again"
        ),
    }
    // The header is mapped (shared) exactly when the throttled counter is.
    let t = THROTTLED_NS[gpu].load(Ordering::Acquire);
    if !t.is_null() {
        // SAFETY: `t` is the throttled_ns word at THROTTLED_NS_OFFSET of a header page that is
        // never unmapped (see throttled_word).
        let header = unsafe { t.cast::<u8>().sub(container_ledger::THROTTLED_NS_OFFSET) };
        // SAFETY: COMPUTE_UNATTRIBUTED_OFFSET (8-aligned) is inside the same header page.
        let w = unsafe { header.add(container_ledger::COMPUTE_UNATTRIBUTED_OFFSET) };
        // SAFETY: a word of the never-unmapped header page.
        unsafe { &*w.cast::<AtomicU64>() }.store(now.map_or(0, |x| x as u64), Ordering::Relaxed);
    }
}

/// A second mapping of the ledger page that holds the compute words
/// (`mremap` with old size 0 duplicates a shared mapping), which we never
/// unmap: the ledger's own mapping goes away when a re-registration
/// replaces it, possibly under a sleeping launch.
fn private_words(ledger: &Ledger) -> Option<*const AtomicU64> {
    let words = ledger.compute_words().as_ptr();
    let page = 4096usize;
    let off = words as usize % page;
    let base = (words as usize - off) as *mut libc::c_void;
    // SAFETY: `base` is the page-aligned start of the ledger's live MAP_SHARED mapping page
    // holding the compute words (`ledger` borrows it for the call); old size 0 with MAYMOVE
    // creates a new mapping of that page and touches no existing one.
    let p = unsafe { libc::mremap(base, 0, page, libc::MREMAP_MAYMOVE) };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `off` < page is the words' offset in the page, so the pointer stays inside the
    // new one-page mapping, 8-aligned as in the ledger.
    Some(unsafe { (p as *const u8).add(off) } as *const AtomicU64)
}

/// In a fork child, from the atfork handler (single-threaded, keep it
/// async-signal-safe in spirit: no locks that another thread may hold).
/// The bucket mapping is inherited and stays; the lease identity is the
/// parent's, so draw a new one. The controller state lives in the parent's
/// watcher thread, which the child does not have.
pub fn after_fork_child() {
    ME.store(0, Ordering::Release);
}

static ME: AtomicU64 = AtomicU64::new(0);

/// This process's lease identity: pid and a per-process nonce (a reused
/// pid is not mistaken for a dead controller).
fn me() -> u64 {
    let v = ME.load(Ordering::Acquire);
    if v != 0 {
        return v;
    }
    let pid = std::process::id() as u64;
    let nonce = (now_ns() ^ (&ME as *const _ as u64).rotate_left(17)) & 0xffff_ffff;
    let v = (pid << 32) | nonce | 1;
    match ME.compare_exchange(0, v, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => v,
        Err(x) => x,
    }
}

/// The controller, in the watcher thread of the lease holder.
struct Ctl {
    ctrl: Controller,
    sampler: Option<sampler::Sampler>,
    sampler_error: bool,
    waits: u64,
    /// What [`report_blind`] last said.
    blind: Option<Blind>,
}

thread_local! {
    /// Per GPU of the share (ledger position).
    static CTL: RefCell<Vec<Option<Ctl>>> = const { RefCell::new(Vec::new()) };
}

fn tick_inner(pids: fn() -> Vec<i32>) {
    let n = crate::config::enforce()
        .map_or(1, |e| e.gpus())
        .min(MAX_GPUS);
    for gpu in 0..n {
        tick_gpu(gpu, pids);
    }
}

fn tick_gpu(gpu: usize, pids: fn() -> Vec<i32>) {
    let Some(b) = bucket(gpu) else { return };
    timed::arm();
    let now = now_ns();
    b.refill(now);
    let Some(q) = quota(gpu) else { return };
    let me = me();
    let leader = b.hold_lease(me, now, LEASE_STALE_NS);
    CTL.with(|c| {
        let mut all = c.borrow_mut();
        if all.len() <= gpu {
            all.resize_with(gpu + 1, || None);
        }
        let c = &mut all[gpu];
        if !leader {
            *c = None;
            return;
        }
        let ctl = c.get_or_insert_with(|| {
            crate::log::log!(
                Info,
                "compute controller of GPU {gpu}: this process ({q:?})"
            );
            let mut ctrl = Controller::new(q);
            if b.units_per_ms() > 0 {
                ctrl.seed_scale(1e6 / b.units_per_ms() as f64);
            }
            Ctl {
                ctrl,
                sampler: None,
                sampler_error: false,
                waits: b.waits(),
                blind: None,
            }
        });
        control(ctl, gpu, b, now, pids);
    });
}

/// Hands the bucket the controller's decision: its rate and what the
/// metrics show.
fn apply(b: Bucket, d: &Decision) {
    b.set_rate(d.rate, d.units_per_ms);
    b.publish(d.target, d.achieved);
}

fn control(ctl: &mut Ctl, gpu: usize, b: Bucket, now: u64, pids: fn() -> Vec<i32>) {
    ctl.ctrl.record_launched(now, b.launched());
    if cost::mps() == Some(true) {
        ctl.ctrl.assume_blind();
    }
    if ctl.sampler.is_none() && !ctl.sampler_error {
        let (bus, uuid) = crate::config::enforce()
            .and_then(|e| e.gpus.get(gpu))
            .map(|g| (g.bus_id.clone(), g.uuid.clone()))
            .unwrap_or_default();
        match sampler::Sampler::open(&bus, &uuid) {
            Ok(s) => ctl.sampler = Some(s),
            Err(e) => {
                // Without feedback the bucket keeps the last rate it had.
                crate::log::log!(Error, "compute quota: no utilisation feedback: {e}");
                ctl.sampler_error = true;
            }
        }
    }
    let Some(s) = ctl.sampler.as_mut() else {
        return;
    };
    if let Some(d) = ctl.ctrl.check_samples(now) {
        apply(b, &d);
    }
    // MPS clients' kernels run beside other clients', so a timed launch
    // is no measure of its own share there: the blind rule stays.
    let timed = (cost::mps() != Some(true))
        .then(|| timed::scale(gpu, now.saturating_sub(TIMED_WINDOW_NS)))
        .flatten();
    ctl.ctrl.set_timed(timed);
    let mut waited = || {
        let waits = b.waits();
        let waited = waits != ctl.waits;
        ctl.waits = waits;
        waited
    };
    let reported = s.poll(now, pids);
    if reported.is_empty()
        && let Some(d) = ctl.ctrl.add_timed_period(now, &mut waited)
    {
        apply(b, &d);
        crate::log::log!(
            Debug,
            "compute: no samples; timed use {:.1}% target {:.1}% rate {:.4e}/ns timed {:.4e}",
            d.achieved,
            d.target,
            d.rate,
            timed.map_or(0.0, |t| t.ns_per_unit)
        );
    }
    for r in reported {
        let start = r.end_ns.saturating_sub(r.len_ns);
        let p = Period {
            end_ns: r.end_ns,
            len_ns: r.len_ns,
            own: r.own,
            others: r.others,
            cost: ctl.ctrl.cost_between(start, r.end_ns),
        };
        let waited = waited();
        let d = if r.eclipsed {
            ctl.ctrl.add_eclipsed(p, r.device, waited)
        } else {
            ctl.ctrl.add_period(p, waited)
        };
        if let Some(d) = d {
            apply(b, &d);
            crate::log::log!(
                Debug,
                "compute: own {:.1}% others {:.1}% (avg {:.1}%) target {:.1}% rate {:.4e}/ns m {:.3} scale {:.4e} timed {:.4e}",
                r.own,
                r.others,
                d.achieved,
                d.target,
                d.rate,
                ctl.ctrl.integral(),
                ctl.ctrl.scale().unwrap_or(0.0),
                timed.map_or(0.0, |t| t.ns_per_unit)
            );
        }
    }
    report_blind(ctl, gpu);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(util: i32, hard: bool, limit: i32) -> quota_config::ResourceData {
        quota_config::ResourceData {
            utilization: util,
            hard_limit: hard,
            limit,
            enable: true,
            ..Default::default()
        }
    }

    #[test]
    fn quota_from_config() {
        assert_eq!(quota_of(&data(0, true, 0)), None);
        assert_eq!(quota_of(&data(100, true, 0)), None, "a whole GPU");
        assert_eq!(
            quota_of(&data(30, true, 80)),
            Some(Quota {
                utilization: 30.0,
                soft_limit: None
            })
        );
        assert_eq!(
            quota_of(&data(30, false, 80)).unwrap().soft_limit,
            Some(80.0)
        );
        assert_eq!(
            quota_of(&data(30, false, 0)).unwrap().soft_limit,
            Some(100.0)
        );
        assert_eq!(
            quota_of(&data(30, false, 10)).unwrap().soft_limit,
            Some(30.0),
            "a ceiling under the quota is the quota"
        );
    }

    #[test]
    fn private_mapping_shares_the_words_and_outlives_the_ledger() {
        let d = tempfile::tempdir().unwrap();
        let (l, _f) = Ledger::create(&d.path().join("ledger"), 0).unwrap();
        let p = private_words(&l).unwrap();
        // SAFETY: `p` is the compute words of private_words' mapping, which is never unmapped.
        let b = unsafe { Bucket::at(p) };
        b.init();
        b.set_rate(2.0, 1.0);
        assert_eq!(
            l.compute_words()[11].load(Ordering::Relaxed),
            2.0f64.to_bits()
        );
        // SAFETY: `throttled_word(p)` is the aligned throttled_ns word in the header page of
        // the never-unmapped private mapping.
        let t = unsafe { &*throttled_word(p) };
        t.fetch_add(7, Ordering::Relaxed);
        assert_eq!(l.throttled_ns(), 7, "the ledger's counter, shared");
        drop(l);
        assert_eq!(b.rate(), 2.0, "still mapped");
        t.fetch_add(1, Ordering::Relaxed);
    }
}
