//! Launches timed on the device: the compute controller's own measure of
//! the device time a cost unit takes, beside NVML's.
//!
//! Why: NVML's per-process samples are the controller's feedback, and a
//! real driver gives them for one process a sample period, the busiest,
//! with the device's whole busy percent (H200, driver 580;
//! tests/gpu/README.md, 2026-12-04). Two busy shares on one GPU then each
//! read periods of the device's total as their own, and hard 30 % + 60 %
//! held 30.6 % and 48.0 %. An event recorded before a launch and one after
//! it on the same stream bracket that launch's time on the device: events
//! are commands in the context's channel, processed when the context runs,
//! so the interval excludes the time the launch waited for another
//! context (a timeslice ending inside it adds the other's slice: the
//! measure errs long, the safe side for a quota).
//!
//! How: the watcher arms [`PER_TICK`] launches ([`ARMED`]) every tick; a
//! launch with a compute limit takes one ([`start`], cold) and returns a
//! [`Probe`] its wrapper closes after the real launch ([`Probe::after`]). Completed pairs
//! are read when the next probe starts, in a thread whose context is
//! current. The estimate is the timed launches' device time over their
//! cost, which needs launches picked alike whatever their cost: the first
//! launch after a moment is, while throttled, the one that slept for its
//! tokens, picked in proportion to its cost (a mix of 1- and 58-wave
//! launches of one duration then read 11 % short, and its quota ran 6
//! points over), so each probe goes to the launch a random 0..[`SKIP`]
//! launches after the one before. Graph launches are timed like kernels
//! (their cost is their kernel nodes'); launches of unknown cost are not.

use super::bucket::now_ns;
use crate::events::{self, Event, Stream};
use cuda_abi::{CUDA_ERROR_NOT_READY, CUDA_SUCCESS, CUresult};
use quota_config::MAX_GPUS;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

/// Launches still to time, set by the watcher each tick ([`PER_TICK`]).
pub(crate) static ARMED: AtomicU32 = AtomicU32::new(0);
/// Launches timed per watcher tick at most (20 ms while throttling: up to
/// 200 a second; launch costs are skewed, and fewer left the estimate
/// too noisy to act on beside a mix of 1- and 58-wave launches).
const PER_TICK: u32 = 4;
/// Launches still to pass, once armed, before the one timed.
static SKIPPING: AtomicU32 = AtomicU32::new(0);
/// Launches passed at most before the one timed (longer than the rounds of
/// launches programs repeat, so every place in a round is as likely).
const SKIP: u64 = 32;

/// Pairs in flight at most (a stream that never drains holds no more).
const MAX_PENDING: usize = 16;
/// Samples kept per GPU.
const KEEP: usize = 256;
/// Samples the estimate needs before it is used.
pub const MIN_SAMPLES: usize = 5;
/// How much older than the window a sample may be and still make up the
/// [`MIN_SAMPLES`] (a process of few, long launches, as in a small MIG
/// instance: 4 ms launches at a tenth of an instance gave 5 samples in 6 s).
const STALE_NS: u64 = 8_000_000_000;

/// A launch being timed: its start event is recorded.
pub(crate) struct Started {
    gpu: usize,
    cost: u64,
    start: usize,
    stream: Stream,
    ptsz: bool,
}

/// What a launch wrapper closes after the real launch: nothing, nearly
/// always.
#[must_use]
pub(crate) struct Probe(Option<Started>);

impl Probe {
    pub(crate) const NONE: Probe = Probe(None);

    /// After the real launch returned `r`: records the end event (cold).
    #[inline(always)]
    pub(crate) fn after(self, r: CUresult) -> CUresult {
        if let Some(s) = self.0 {
            finish(s, r);
        }
        r
    }
}

pub use super::controller::Timed;

struct Pair {
    gpu: usize,
    cost: u64,
    start: usize,
    end: usize,
}

struct Sample {
    at_ns: u64,
    ns: u64,
    cost: u64,
}

struct Book {
    pending: Vec<Pair>,
    samples: Vec<VecDeque<Sample>>,
}

static BOOK: Mutex<Book> = Mutex::new(Book {
    pending: Vec::new(),
    samples: Vec::new(),
});

fn book() -> std::sync::MutexGuard<'static, Book> {
    BOOK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Arms [`PER_TICK`] launches with a compute limit to be timed, the first
/// a random number of launches from now.
pub(crate) fn arm() {
    if ARMED.load(Ordering::Relaxed) == 0 {
        skip_some();
        ARMED.store(PER_TICK, Ordering::Relaxed);
    }
}

/// Samples taken so far (saturating at [`MIN_SAMPLES`]).
static TAKEN: AtomicU32 = AtomicU32::new(0);
/// Launches passed at most before each of the first [`MIN_SAMPLES`]: a
/// process of few, long launches (a small MIG instance's, throttled on an
/// assumed wave time) otherwise waited seconds for its first estimate;
/// the later samples, picked over [`SKIP`], soon replace these.
const SKIP_FIRST: u64 = 4;

/// The next probe goes to a launch 0..[`SKIP`] launches on (the clock's
/// low bits).
fn skip_some() {
    let span = if TAKEN.load(Ordering::Relaxed) < MIN_SAMPLES as u32 {
        SKIP_FIRST
    } else {
        SKIP
    };
    SKIPPING.store((now_ns() / 64 % span) as u32, Ordering::Relaxed);
}

/// Starts timing a launch of `cost` units onto `stream` of `gpu`'s context
/// (the armed one; another thread may have taken it first).
#[cold]
#[inline(never)]
pub(crate) fn start(gpu: usize, cost: u64, stream: Stream, ptsz: bool) -> Probe {
    let left = SKIPPING.load(Ordering::Relaxed);
    if left > 0 {
        SKIPPING.store(left - 1, Ordering::Relaxed);
        return Probe::NONE;
    }
    // No probe while the process captures: the harvest's cuEventQuery
    // is a call a GLOBAL capture forbids every thread (it invalidated a
    // capture in shim_capture's test).
    if cost == 0 || crate::graph::CAPTURES.load(Ordering::Relaxed) != 0 {
        return Probe::NONE;
    }
    let took = ARMED.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    if took.is_err() {
        return Probe::NONE;
    }
    skip_some();
    // RELAXED, should a capture begin on another thread meanwhile.
    crate::graph::relaxed(|| {
        let mut b = book();
        b.harvest();
        if b.pending.len() >= MAX_PENDING {
            return Probe::NONE;
        }
        drop(b);
        let Some(start) = events::create() else {
            return Probe::NONE;
        };
        if events::record(start as Event, stream, ptsz) != CUDA_SUCCESS {
            events::destroy(start as Event);
            return Probe::NONE;
        }
        Probe(Some(Started {
            gpu,
            cost,
            start,
            stream,
            ptsz,
        }))
    })
}

#[cold]
#[inline(never)]
fn finish(s: Started, r: CUresult) {
    crate::graph::relaxed(|| finish_relaxed(s, r));
}

fn finish_relaxed(s: Started, r: CUresult) {
    let end = if r == CUDA_SUCCESS {
        events::create()
    } else {
        None
    };
    let Some(end) = end.filter(|&e| events::record(e as Event, s.stream, s.ptsz) == CUDA_SUCCESS)
    else {
        // The launch failed, or the end could not be recorded: no sample.
        for e in end.into_iter().chain([s.start]) {
            events::destroy(e as Event);
        }
        return;
    };
    book().pending.push(Pair {
        gpu: s.gpu,
        cost: s.cost,
        start: s.start,
        end,
    });
}

impl Book {
    /// Takes the completed pairs, keeping each one's ns per unit.
    fn harvest(&mut self) {
        let now = now_ns();
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            let r = events::query(p.end as Event);
            if r == CUDA_ERROR_NOT_READY {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            let ns = (r == CUDA_SUCCESS)
                .then(|| events::elapsed_ns(p.start as Event, p.end as Event))
                .flatten();
            events::destroy(p.start as Event);
            events::destroy(p.end as Event);
            if let Some(ns) = ns {
                self.add(p.gpu, now, ns, p.cost);
            }
        }
    }

    fn add(&mut self, gpu: usize, at_ns: u64, ns: u64, cost: u64) {
        if gpu >= MAX_GPUS {
            return;
        }
        let _ = TAKEN.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            (n < MIN_SAMPLES as u32).then_some(n + 1)
        });
        if self.samples.len() <= gpu {
            self.samples.resize_with(gpu + 1, VecDeque::new);
        }
        let q = &mut self.samples[gpu];
        if q.len() == KEEP {
            q.pop_front();
        }
        q.push_back(Sample { at_ns, ns, cost });
    }

    /// Device time over cost of the recent samples, with the standard
    /// error of that ratio. Launch costs are skewed (one 58-wave launch
    /// outweighs 58 1-wave ones), so a second's samples moved the ratio by
    /// -17 % to +60 % around NVML's scale: acted on whenever lower, the low
    /// readings ran a share 5-8 points over its quota alone on the GPU.
    /// The samples since `since_ns`, or the newest [`MIN_SAMPLES`] if
    /// fewer, back to [`STALE_NS`] before it.
    fn scale(&self, gpu: usize, since_ns: u64) -> Option<Timed> {
        let q = self.samples.get(gpu)?;
        let fresh = q.iter().filter(|s| s.at_ns >= since_ns).count();
        let recent: Vec<&Sample> = q
            .iter()
            .rev()
            .take(fresh.max(MIN_SAMPLES))
            .filter(|s| s.at_ns + STALE_NS >= since_ns)
            .collect();
        let recent = untimesliced(recent);
        let n = recent.len();
        let ns: f64 = recent.iter().map(|s| s.ns as f64).sum();
        let cost: f64 = recent.iter().map(|s| s.cost as f64).sum();
        if n < MIN_SAMPLES || cost <= 0.0 {
            return None;
        }
        let ratio = ns / cost;
        let mean_cost = cost / n as f64;
        // Sample (co)variances of the residuals about the ratio (their
        // mean is 0) and of the costs, over n * mean cost².
        let (mut spread, mut cross, mut costs) = (0.0, 0.0, 0.0);
        for s in &recent {
            let (c, r) = (s.cost as f64, s.ns as f64 - ratio * s.cost as f64);
            spread += r * r;
            cross += r * (c - mean_cost);
            costs += (c - mean_cost).powi(2);
        }
        let per = (n - 1) as f64 * n as f64 * mean_cost * mean_cost;
        Some(Timed {
            ns_per_unit: ratio,
            error: (spread / per).sqrt(),
            cross: cross / per,
            cost_spread: costs / per,
        })
    }
}

/// This process's timed ns of device time per cost unit on `gpu`, from
/// launches completed since `since_ns` (at least the newest
/// [`MIN_SAMPLES`], [`Book::scale`]); `None` with fewer than that.
/// A class of launches of one cost needs this many samples to be trimmed.
const CLASS_MIN: usize = 4;
/// A sample over this times its class's lower quartile is dropped.
const TRIM: f64 = 2.0;

/// The samples less those another context's timeslice interrupted: such
/// a launch reads long by the other's whole slice (its events bracket the
/// preemption), and when both contexts are busy a launch of a millisecond
/// is interrupted about every other time on a 2 ms timeslice, which read
/// a hard 30 % and 60 % as 25 % and 54 % (the H100 held 29.5 % and 54.1 %).
/// Within launches of one cost, those left uninterrupted agree to the
/// jitter of their kernels; the interrupted ones stand well above their
/// lower quartile.
fn untimesliced(mut v: Vec<&Sample>) -> Vec<&Sample> {
    v.sort_by_key(|s| (s.cost, s.ns));
    let mut out = Vec::with_capacity(v.len());
    for class in v.chunk_by(|a, b| a.cost == b.cost) {
        if class.len() < CLASS_MIN {
            out.extend_from_slice(class);
            continue;
        }
        let limit = class[class.len() / 4].ns as f64 * TRIM;
        out.extend(class.iter().filter(|s| s.ns as f64 <= limit));
    }
    out
}

pub(crate) fn scale(gpu: usize, since_ns: u64) -> Option<Timed> {
    book().scale(gpu, since_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_is_recent_device_time_over_cost_once_there_are_enough() {
        let mut b = Book {
            pending: Vec::new(),
            samples: Vec::new(),
        };
        // One duration, costs of 1 and 58 units: time over cost, not the
        // mean of the ratios (which a 1-unit sample would dominate).
        for i in 0..MIN_SAMPLES as u64 - 1 {
            b.add(1, 100 + i, 400, if i % 2 == 0 { 1 } else { 58 });
        }
        assert!(b.scale(1, 0).is_none(), "too few");
        b.add(1, 200, 400, 58);
        let ratio: f64 = 2000.0 / 176.0;
        let t = b.scale(1, 0).unwrap();
        assert_eq!(t.ns_per_unit, ratio);
        // Residuals 400 - ratio * cost: two of cost 1, three of cost 58.
        let var: f64 = (2.0 * (400.0 - ratio).powi(2) + 3.0 * (400.0 - 58.0 * ratio).powi(2)) / 4.0;
        let want = (var / 5.0f64).sqrt() / (176.0 / 5.0);
        assert!((t.error - want).abs() < 1e-9, "{} != {want}", t.error);
        let t = b.scale(1, 150).unwrap();
        assert_eq!(t.ns_per_unit, ratio, "one since 150: the newest 5");
        assert!(
            b.scale(1, 200 + STALE_NS + 1).is_none(),
            "samples past the stale horizon do not count"
        );
        assert!(b.scale(0, 0).is_none(), "another GPU has none");
        for i in 0..KEEP as u64 {
            b.add(1, 300 + i, 30, 10);
        }
        let t = b.scale(1, 0).unwrap();
        assert_eq!(
            (t.ns_per_unit, t.error),
            (3.0, 0.0),
            "the oldest are dropped"
        );
    }

    /// `error_at(l)` is the standard error from the residuals about `l`,
    /// computed directly; at the ratio itself it is `error`.
    #[test]
    fn the_error_about_a_reference_is_that_of_its_residuals() {
        let mut b = Book {
            pending: Vec::new(),
            samples: Vec::new(),
        };
        let (ns, costs) = (
            [380u64, 420, 400, 350, 460, 410],
            [1u64, 1, 12, 116, 116, 1],
        );
        for (i, (n, c)) in ns.iter().zip(costs).enumerate() {
            b.add(0, i as u64, *n, c);
        }
        let t = b.scale(0, 0).unwrap();
        let direct = |l: f64| {
            let r: Vec<f64> = ns
                .iter()
                .zip(costs)
                .map(|(n, c)| *n as f64 - l * c as f64)
                .collect();
            let k = r.len() as f64;
            let mean = r.iter().sum::<f64>() / k;
            let var = r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (k - 1.0);
            (var / k).sqrt() / (costs.iter().sum::<u64>() as f64 / k)
        };
        for l in [t.ns_per_unit, 5.0, 12.3, 40.0] {
            let (got, want) = (t.error_at(l), direct(l));
            assert!((got - want).abs() < 1e-9 * want, "at {l}: {got} != {want}");
        }
        assert!((t.error_at(t.ns_per_unit) - t.error).abs() < 1e-12);
    }

    /// One duration at costs of 1, 1, 12 and 116 units (tests/c/shim_laws.c
    /// `gridless`), NVML's scale the true 400 ns / 32.5 units: a sample
    /// that drew the 116-unit launch half again as often reads the ratio
    /// a quarter low, three of its own standard errors, and capped NVML's
    /// scale (a hard 70 alone ran at 76 %); about the true ratio, 2.3.
    #[test]
    fn a_ratio_low_by_the_draw_of_costly_launches_is_within_three_errors_of_the_truth() {
        let mut b = Book {
            pending: Vec::new(),
            samples: Vec::new(),
        };
        // 150 launches: 33 + 33 + 33 of the cheap ones, 51 at 116 units.
        let counts = [(1u64, 33), (1, 33), (12, 33), (116, 51)];
        let mut i = 0u64;
        for (cost, k) in counts {
            for j in 0..k {
                // ±30 % jitter, spread evenly over each class.
                let ns = 400.0 * (0.7 + 0.6 * (j as f64 + 0.5) / k as f64);
                b.add(0, i, ns as u64, cost);
                i += 1;
            }
        }
        let t = b.scale(0, 0).unwrap();
        let truth = 400.0 / (130.0 / 4.0);
        assert!(t.ns_per_unit < 0.8 * truth, "{} vs {truth}", t.ns_per_unit);
        assert!(
            t.ns_per_unit + 3.0 * t.error < truth,
            "the residuals about the ratio call it significant"
        );
        assert!(
            t.ns_per_unit + 3.0 * t.error_at(truth) >= truth,
            "about the truth it is within three: {} + 3 x {}",
            t.ns_per_unit,
            t.error_at(truth)
        );
    }

    /// Launches of one cost whose events bracket another context's slice
    /// (a 1 ms launch read as 2.1 to 3 ms, every third one) are left out;
    /// a class's jitter of ±30 % is not, nor a class of too few samples.
    #[test]
    fn launches_a_timeslice_interrupted_are_left_out() {
        let mut b = Book {
            pending: Vec::new(),
            samples: Vec::new(),
        };
        let mut at = 0;
        let mut add = |b: &mut Book, ns: f64, cost: u64| {
            b.add(0, at, ns as u64, cost);
            at += 1;
        };
        for j in 0..60 {
            let clean = 1_000_000.0 * (0.7 + 0.6 * ((j * 7) % 60) as f64 / 60.0);
            let ns = if j % 3 == 0 {
                2_100_000.0 + 15_000.0 * j as f64
            } else {
                clean
            };
            add(&mut b, ns, 100);
        }
        // Too few to judge: kept, interrupted or not.
        add(&mut b, 9_000_000.0, 7);
        add(&mut b, 9_000_000.0, 7);
        let t = b.scale(0, 0).unwrap();
        let kept_ns: f64 = (0..60)
            .filter(|j| j % 3 != 0)
            .map(|j| 1_000_000.0 * (0.7 + 0.6 * ((j * 7) % 60) as f64 / 60.0))
            .map(|ns: f64| ns.trunc())
            .sum::<f64>()
            + 18_000_000.0;
        let want = kept_ns / (40.0 * 100.0 + 14.0);
        assert!(
            (t.ns_per_unit - want).abs() < 1e-6 * want,
            "{} vs {want}",
            t.ns_per_unit
        );
        // Before: every sample counted, the scale read a quarter long.
        let all: f64 = b.samples[0].iter().map(|s| s.ns as f64).sum::<f64>() / 6014.0;
        assert!(all > 1.2 * want, "{all} vs {want}");
    }
}
