//! The sampler: a thread that reads NVML every sample period and publishes a
//! [`Snapshot`]. Scrapes and RPCs only read the latest snapshot, so NVML is
//! never in the request path and a slow driver cannot stall a scrape.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use crate::Error;

/// Use of one process on one GPU over the last window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcSample {
    /// Percent of the GPU's time the process ran kernels (SM utilization).
    pub utilization_percent: f64,
    pub memory_used_bytes: u64,
}

/// One GPU at the last sample.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuSample {
    /// NVML index.
    pub index: u32,
    pub uuid: String,
    /// Whole-device utilization as NVML reports it, percent.
    pub utilization_percent: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// By host PID.
    pub processes: HashMap<u32, ProcSample>,
    /// The window the per-process utilization covers (epoch µs), if known.
    pub window_us: Option<(u64, u64)>,
    /// Its MIG devices, when it is in MIG mode (filled by a reader that
    /// knows MIG: `node_agent::display`).
    pub mig: Vec<MigSample>,
}

/// One MIG device at the last sample.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MigSample {
    /// `MIG-…`.
    pub uuid: String,
    /// `3g.40gb`.
    pub profile: String,
    pub memory_total_bytes: u64,
    /// What its processes hold (NVML's process list of the parent GPU).
    pub memory_used_bytes: u64,
    pub processes: u32,
}

/// Everything the sampler learnt at its last tick.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub taken: Option<SystemTime>,
    /// By NVML index.
    pub gpus: Vec<GpuSample>,
}

impl Snapshot {
    pub fn gpu(&self, index: u32) -> Option<&GpuSample> {
        self.gpus.iter().find(|g| g.index == index)
    }
}

/// Latest snapshot, shared between the sampler and the servers.
#[derive(Debug, Default)]
pub struct SnapshotCell(RwLock<Arc<Snapshot>>);

impl SnapshotCell {
    pub fn load(&self) -> Arc<Snapshot> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn store(&self, s: Snapshot) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(s);
    }
}

/// Source of GPU samples: NVML in production, fakes in unit tests and the
/// benchmark.
pub trait GpuReader: Send + 'static {
    fn sample(&mut self) -> Result<Vec<GpuSample>, Error>;
}

/// Run after each sample, on the sampler's thread.
pub type AfterSample = Box<dyn FnMut(&Snapshot) + Send>;

/// Counters about the sampler itself, exported as metrics.
#[derive(Debug, Default)]
pub struct SamplerStats {
    pub ticks: AtomicU64,
    pub errors: AtomicU64,
    /// CPU time of the sampler thread, nanoseconds.
    pub cpu_ns: AtomicU64,
    /// Wall time of the last tick, nanoseconds.
    pub last_tick_ns: AtomicU64,
}

/// A running sampler thread; stops when dropped.
pub struct Sampler {
    stop: Option<mpsc::Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl Sampler {
    /// Samples with `reader` now and then every `period`, storing into `cell`.
    pub fn spawn(
        reader: impl GpuReader,
        period: Duration,
        cell: Arc<SnapshotCell>,
        stats: Arc<SamplerStats>,
    ) -> Result<Sampler, Error> {
        Self::spawn_with(reader, period, cell, stats, None)
    }

    /// [`Sampler::spawn`], calling `after` with each new snapshot on the
    /// sampler's thread (the escape guard: within the period it was seen).
    pub fn spawn_with(
        mut reader: impl GpuReader,
        period: Duration,
        cell: Arc<SnapshotCell>,
        stats: Arc<SamplerStats>,
        mut after: Option<AfterSample>,
    ) -> Result<Sampler, Error> {
        let (tx, rx) = mpsc::channel::<()>();
        let join = std::thread::Builder::new()
            .name("gpu-display-sampler".into())
            .spawn(move || {
                loop {
                    let cpu0 = thread_cpu_ns();
                    let t0 = Instant::now();
                    match reader.sample() {
                        Ok(gpus) => {
                            cell.store(Snapshot {
                                taken: Some(SystemTime::now()),
                                gpus,
                            });
                            if let Some(a) = after.as_mut() {
                                a(&cell.load());
                            }
                        }
                        Err(e) => {
                            stats.errors.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(error = %e, "GPU sample failed; keeping the previous one");
                        }
                    }
                    stats.ticks.fetch_add(1, Ordering::Relaxed);
                    stats
                        .last_tick_ns
                        .store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    stats
                        .cpu_ns
                        .fetch_add(thread_cpu_ns().saturating_sub(cpu0), Ordering::Relaxed);
                    match rx.recv_timeout(period) {
                        Err(RecvTimeoutError::Timeout) => {}
                        // Stop asked, or the handle was dropped.
                        _ => break,
                    }
                }
            })
            .map_err(Error::Thread)?;
        Ok(Sampler {
            stop: Some(tx),
            join: Some(join),
        })
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// CPU time consumed by the calling thread, nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_THREAD_CPUTIME_ID always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn epoch_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as u64
}

/// Per-GPU state carried between ticks to turn NVML's per-period process
/// samples into a utilization over the window since the last tick.
#[derive(Debug, Clone, Copy, Default)]
pub struct WindowState {
    /// Newest sample timestamp consumed (epoch µs); 0 before the first tick.
    pub last_seen_us: u64,
    /// The driver's sampling period, learnt from the gaps between sample
    /// timestamps (it differs between GPU generations); 0 until known.
    pub period_us: u64,
}

/// One NVML process utilization sample: (pid, timestamp µs, SM percent).
pub type RawSample = (u32, u64, u32);

/// Folds one batch of per-period samples (those newer than
/// `state.last_seen_us`) into per-PID percentages of the window they cover.
///
/// Each sample is one process's share of the driver's window that ends at
/// its timestamp and began where the previous sample's window ended (NVML's
/// `lastSeenTimeStamp` semantics: a timestamp is the end of the period the
/// sample covers); a process that did not run in a period has no sample
/// there. A real driver's periods are not a grid: their ends wander, and a
/// skipped period is folded into the next sample, whose window is then two
/// periods long. So each sample is weighted by its own window (the gap to
/// the previous timestamp, capped at [`MAX_WINDOW_PERIODS`] typical periods,
/// beyond which the gap was idle device time with no sample at all), and a
/// PID's utilization is the sum of its samples times their windows over the
/// window since the last batch. Taking the shortest gap as every sample's
/// window read 19.7 % for a process at 25.2 % (20 ms of wander, one period
/// in 11 folded). The window ends at the newest timestamp consumed, so
/// periods are never counted twice nor lost between ticks.
pub fn fold_samples(
    state: &mut WindowState,
    samples: &[RawSample],
    now_us: u64,
    first_window_us: u64,
) -> (HashMap<u32, f64>, Option<(u64, u64)>) {
    let mut out = HashMap::new();
    let mut stamps: Vec<u64> = samples.iter().map(|s| s.1).collect();
    stamps.sort_unstable();
    stamps.dedup();
    learn_period(state, &stamps);
    let start = if state.last_seen_us == 0 {
        now_us.saturating_sub(first_window_us)
    } else {
        state.last_seen_us
    };
    let Some(&newest) = stamps.last() else {
        // Nothing ran: move on so this idle time is not charged to the next
        // batch's processes.
        if state.period_us > 0 {
            state.last_seen_us = state
                .last_seen_us
                .max(now_us.saturating_sub(state.period_us));
        } else if state.last_seen_us == 0 {
            state.last_seen_us = start;
        }
        return (out, None);
    };
    let period = state.period_us;
    if period == 0 {
        // One period seen and none learnt yet: the batch is one sample.
        for &(pid, _, sm) in samples {
            *out.entry(pid).or_insert(0.0) += sm as f64 / stamps.len() as f64;
        }
    } else {
        let window = newest.saturating_sub(start).max(period);
        for &(pid, ts, sm) in samples {
            let own = own_window(state.last_seen_us, &stamps, ts, period);
            *out.entry(pid).or_insert(0.0) += sm as f64 * own as f64 / window as f64;
        }
    }
    for v in out.values_mut() {
        *v = v.min(100.0);
    }
    state.last_seen_us = newest;
    (out, Some((start, newest)))
}

/// A gap between timestamps longer than this many typical periods was idle
/// device time (no process ran, no sample), not one sample's window: a
/// driver folds a skipped period into the next sample (two periods) and
/// its period ends wander by a fraction of one.
pub const MAX_WINDOW_PERIODS: f64 = 2.5;

/// The window of the sample stamped `ts`: back to the previous timestamp
/// (of this batch, else the newest one consumed before it), at most
/// [`MAX_WINDOW_PERIODS`] periods; a typical period for the first sample
/// ever.
fn own_window(last_seen_us: u64, stamps: &[u64], ts: u64, period: u64) -> u64 {
    let i = stamps.partition_point(|&t| t < ts);
    let prev = match i {
        0 if last_seen_us > 0 => last_seen_us,
        0 => ts.saturating_sub(period),
        _ => stamps[i - 1],
    };
    let cap = (period as f64 * MAX_WINDOW_PERIODS) as u64;
    ts.saturating_sub(prev).min(cap)
}

/// The driver's typical period: the median gap between a batch's distinct
/// timestamps (wander and folded periods move the shortest and the mean,
/// not the median); from a batch with a single gap, the shortest seen.
fn learn_period(state: &mut WindowState, stamps: &[u64]) {
    let mut gaps: Vec<u64> = stamps.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_unstable();
    match gaps.len() {
        0 => {}
        1 => {
            if state.period_us == 0 || gaps[0] < state.period_us {
                state.period_us = gaps[0];
            }
        }
        n => state.period_us = gaps[(n - 1) / 2],
    }
}

/// Samples the GPUs through NVML.
pub struct NvmlReader {
    nvml: Arc<Nvml>,
    windows: Vec<WindowState>,
    first_window: Duration,
}

impl NvmlReader {
    /// Uses an NVML handle the manager already holds. `first_window` is how
    /// far back the first tick looks (the sample period is a good choice).
    pub fn new(nvml: Arc<Nvml>, first_window: Duration) -> NvmlReader {
        NvmlReader {
            nvml,
            windows: Vec::new(),
            first_window,
        }
    }

    /// Loads NVML from `lib` (the host driver's `libnvidia-ml.so.1`).
    pub fn open(lib: &Path, first_window: Duration) -> Result<NvmlReader, Error> {
        let nvml = Nvml::builder()
            .lib_path(lib.as_os_str())
            .init()
            .map_err(|e| Error::Nvml {
                what: format!("loading {}", lib.display()),
                source: e,
            })?;
        Ok(NvmlReader::new(Arc::new(nvml), first_window))
    }

    fn sample_gpu(&mut self, index: u32, now_us: u64) -> Result<GpuSample, NvmlError> {
        let dev = self.nvml.device_by_index(index)?;
        let uuid = dev.uuid()?;
        let mem = dev.memory_info()?;
        let util = dev.utilization_rates().map(|u| u.gpu).unwrap_or(0);
        let mut processes: HashMap<u32, ProcSample> = HashMap::new();
        for p in dev.running_compute_processes()? {
            let used = match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            };
            processes.entry(p.pid).or_default().memory_used_bytes += used;
        }
        let state = &mut self.windows[index as usize];
        let since = if state.last_seen_us == 0 {
            now_us.saturating_sub(self.first_window.as_micros() as u64)
        } else {
            state.last_seen_us
        };
        let raw: Vec<RawSample> = match dev.process_utilization_stats(since) {
            Ok(v) => v
                .into_iter()
                .filter(|s| s.timestamp > since)
                .map(|s| (s.pid, s.timestamp, s.sm_util))
                .collect(),
            // NOT_FOUND: no sample newer than `since`.
            Err(NvmlError::NotFound) => Vec::new(),
            // Some GPUs (and vGPU guests) cannot report per-process use.
            Err(NvmlError::NotSupported) => Vec::new(),
            Err(e) => return Err(e),
        };
        let (per_pid, window) =
            fold_samples(state, &raw, now_us, self.first_window.as_micros() as u64);
        for (pid, pct) in per_pid {
            processes.entry(pid).or_default().utilization_percent = pct;
        }
        Ok(GpuSample {
            index,
            uuid,
            utilization_percent: util as f64,
            memory_used_bytes: mem.used,
            memory_total_bytes: mem.total,
            processes,
            window_us: window,
            mig: Vec::new(),
        })
    }
}

impl GpuReader for NvmlReader {
    fn sample(&mut self) -> Result<Vec<GpuSample>, Error> {
        let n = self.nvml.device_count().map_err(|e| Error::Nvml {
            what: "counting devices".into(),
            source: e,
        })?;
        if self.windows.len() != n as usize {
            self.windows = vec![WindowState::default(); n as usize];
        }
        let now = epoch_us();
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            match self.sample_gpu(i, now) {
                Ok(g) => out.push(g),
                // One lost GPU (Xid 79) must not hide the others.
                Err(e) => tracing::warn!(gpu = i, error = %e, "sampling GPU failed"),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 100_000; // 100 ms in µs

    #[test]
    fn steady_process_over_whole_periods() {
        let mut st = WindowState {
            last_seen_us: 10 * P,
            period_us: P,
        };
        // 10 periods, pid 7 at 30 % in each, pid 8 at 50 % in half of them.
        let mut s = Vec::new();
        for k in 11..=20 {
            s.push((7, k * P, 30));
            if k % 2 == 0 {
                s.push((8, k * P, 50));
            }
        }
        let (u, w) = fold_samples(&mut st, &s, 20 * P + 5, P);
        assert!((u[&7] - 30.0).abs() < 1e-9);
        assert!((u[&8] - 25.0).abs() < 1e-9);
        assert_eq!(w, Some((10 * P, 20 * P)));
        assert_eq!(st.last_seen_us, 20 * P);
    }

    #[test]
    fn period_is_learnt_from_gaps() {
        let mut st = WindowState::default();
        let s = [(1, 5 * P, 40), (1, 6 * P, 40), (1, 7 * P, 40)];
        let (u, _) = fold_samples(&mut st, &s, 7 * P + 10, 3 * P);
        assert_eq!(st.period_us, P);
        // First window: [now - 3P, 7P] ~ 3 periods.
        assert!((u[&1] - 40.0).abs() < 1.0, "{}", u[&1]);
    }

    #[test]
    fn idle_batch_moves_the_window() {
        let mut st = WindowState {
            last_seen_us: 10 * P,
            period_us: P,
        };
        let (u, w) = fold_samples(&mut st, &[], 30 * P, P);
        assert!(u.is_empty() && w.is_none());
        assert_eq!(st.last_seen_us, 29 * P);
        // The next busy period is not diluted by the idle ones.
        let (u, _) = fold_samples(&mut st, &[(3, 30 * P, 80)], 30 * P + 1, P);
        assert!((u[&3] - 80.0).abs() < 1e-9);
    }

    /// A real driver's schedule (as gpu-sim's `[nvml_sampling]`): period
    /// ends wander by up to 20 ms, one period in 11 is skipped and folded
    /// into the next sample. A process busy 25 % of the time reports 25 in
    /// each sample, of whatever window; folded over 1 s batches it reads
    /// 25 ± 0.6, where the shortest gap taken for the period read ~20.
    #[test]
    fn wandering_and_skipped_periods_are_weighted_by_their_own_windows() {
        let end = |k: u64| k * P + (k * 7919 % 20) * 1000; // 0..20 ms late
        let skipped = |k: u64| k % 11 == 5;
        let mut st = WindowState::default();
        let mut got = Vec::new();
        let mut batch = Vec::new();
        for k in 10..=70u64 {
            if skipped(k) {
                continue;
            }
            batch.push((4, end(k), 25));
            if k % 10 == 0 {
                let (u, _) = fold_samples(&mut st, &batch, end(k) + 30_000, 2 * P);
                got.push(u[&4]);
                batch.clear();
            }
        }
        assert!(
            (90_000..=110_000).contains(&st.period_us),
            "{}",
            st.period_us
        );
        // The first batch looks back a guessed window; the rest are exact.
        for u in &got[1..] {
            assert!((u - 25.0).abs() < 0.6, "{got:?}");
        }
    }

    #[test]
    fn single_sample_without_known_period() {
        let mut st = WindowState::default();
        let (u, _) = fold_samples(&mut st, &[(9, 1000, 60), (10, 1000, 20)], 1001, 1_000_000);
        assert_eq!(u[&9], 60.0);
        assert_eq!(u[&10], 20.0);
    }

    #[test]
    fn sampler_thread_publishes_and_stops() {
        struct Fake(u32);
        impl GpuReader for Fake {
            fn sample(&mut self) -> Result<Vec<GpuSample>, Error> {
                self.0 += 1;
                Ok(vec![GpuSample {
                    index: 0,
                    utilization_percent: self.0 as f64,
                    ..Default::default()
                }])
            }
        }
        let cell = Arc::new(SnapshotCell::default());
        let stats = Arc::new(SamplerStats::default());
        let s = Sampler::spawn(
            Fake(0),
            Duration::from_millis(5),
            cell.clone(),
            stats.clone(),
        )
        .unwrap();
        let t = Instant::now();
        while stats.ticks.load(Ordering::Relaxed) < 3 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        s.stop();
        assert!(cell.load().gpu(0).unwrap().utilization_percent >= 3.0);
    }
}
