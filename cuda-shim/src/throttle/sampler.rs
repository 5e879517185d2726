//! Utilisation feedback from the real NVML (the versioned
//! `libnvidia-ml.so.<ver>` beside the interposer, never our own wrappers):
//! `nvmlDeviceGetProcessUtilization` samples of every process on the
//! container's GPU, split into the container's host PIDs and the rest;
//! inside a MIG device, GPM samples of its GPU instance (`super::gpm`).

use super::controller::DEFAULT_PERIOD_NS;
use super::gpm::InstanceSampler;
use crate::real::{Lib, sym};
use std::ffi::{CString, c_void};

const NVML_SUCCESS: i32 = 0;
const NVML_ERROR_NOT_FOUND: i32 = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: i32 = 7;

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Sample {
    pid: u32,
    time_stamp: u64,
    sm_util: u32,
    mem_util: u32,
    enc_util: u32,
    dec_util: u32,
}

pub(super) type Device = *mut c_void;
type ProcUtil = unsafe extern "C" fn(Device, *mut Sample, *mut u32, u64) -> i32;

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Default)]
struct Rates {
    gpu: u32,
    memory: u32,
}
type DeviceRates = unsafe extern "C" fn(Device, *mut Rates) -> i32;

/// A finished sample period as NVML reported it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reported {
    /// End of the period, CLOCK_MONOTONIC ns.
    pub end_ns: u64,
    pub len_ns: u64,
    pub own: f64,
    pub others: f64,
    /// Only other processes were named, and they are neighbours: a busier
    /// one's sample, which on a real driver says nothing of the
    /// container's own use (see [`Processes::poll`]).
    pub eclipsed: bool,
    /// With `eclipsed`: the device's busy percent as NVML gave it when the
    /// period was read (`nvmlDeviceGetUtilizationRates`), if it could.
    pub device: Option<f64>,
}

/// Where a GPU's feedback comes from.
pub enum Sampler {
    /// Per-process samples of a whole GPU.
    Processes(Processes),
    /// A MIG device's GPU instance, all of it the container's.
    Instance(InstanceSampler),
}

impl Sampler {
    /// The feedback of the share's GPU `bus_id`, or of MIG device `uuid`
    /// when the share is inside one.
    pub fn open(bus_id: &str, uuid: &str) -> Result<Sampler, String> {
        if uuid.starts_with(quota_config::MIG_UUID_PREFIX) {
            match InstanceSampler::open(uuid) {
                Ok(i) => return Ok(Sampler::Instance(i)),
                // Before Hopper: the parent's samples, which MIG mode
                // leaves empty, so the controller's blind path (an assumed
                // wave time, flagged in the ledger) holds the quota.
                Err(e) => crate::log::log!(Warn, "compute quota: {e}"),
            }
        }
        Processes::open(bus_id).map(Sampler::Processes)
    }

    /// Periods finished since the last call, oldest first; `now`: the
    /// tick's CLOCK_MONOTONIC ns, when the launch count was last recorded
    /// (a GPM period ends there, so its launches are known).
    pub fn poll(&mut self, now: u64, own_pids: impl FnOnce() -> Vec<i32>) -> Vec<Reported> {
        match self {
            Sampler::Processes(p) => p.poll(own_pids),
            Sampler::Instance(i) => i.poll(now).into_iter().collect(),
        }
    }
}

pub struct Processes {
    dev: Device,
    get: ProcUtil,
    last_seen_us: u64,
    prev_ts_us: Option<u64>,
    /// Shortest gap seen between two periods: the driver's sample period.
    period_ns: u64,
    buf: Vec<Sample>,
    /// The GPU's compute processes (to tell a neighbour from a PID that
    /// cannot be mapped); None where the driver lacks the call.
    list: Option<crate::mem::Procs>,
    rates: Option<DeviceRates>,
}

// The device handle is only used on the thread that owns the sampler.
// SAFETY: the NVML device handle is opaque and valid from any thread (NVML is thread-safe);
// `get` is a plain fn pointer; a Sampler is used by one thread at a time.
unsafe impl Send for Processes {}

/// The real NVML's `name`, as the `unsafe extern "C" fn` type `T`.
pub(super) fn nvml_fn<T: Copy>(name: &str) -> Result<T, String> {
    let c = CString::new(name).unwrap();
    let p = sym(Lib::Nvml, &c);
    if p == 0 {
        return Err(format!("the real NVML has no {name}"));
    }
    assert_eq!(size_of::<T>(), size_of::<usize>());
    // SAFETY: T is pointer-sized (asserted) and every caller names it as the `unsafe extern "C"
    // fn` type of the symbol's C signature; `p` is its non-zero address.
    Ok(unsafe { std::mem::transmute_copy::<usize, T>(&p) })
}

/// Initialises the real NVML (counted: every call is matched by nothing,
/// the watcher keeps it for the process's life).
pub(super) fn nvml_init() -> Result<(), String> {
    let init: unsafe extern "C" fn() -> i32 = nvml_fn("nvmlInit_v2")?;
    // SAFETY: the real nvmlInit_v2, resolved by name; no arguments.
    let r = unsafe { init() };
    if r != NVML_SUCCESS {
        return Err(format!("nvmlInit_v2 returned {r}"));
    }
    Ok(())
}

impl Processes {
    /// Initialises the real NVML and finds the GPU by `bus_id` (the only
    /// visible GPU when the id does not match: a container sees just its
    /// own).
    pub fn open(bus_id: &str) -> Result<Processes, String> {
        nvml_init()?;
        let by_bus: unsafe extern "C" fn(*const i8, *mut Device) -> i32 =
            nvml_fn("nvmlDeviceGetHandleByPciBusId_v2")?;
        let count: unsafe extern "C" fn(*mut u32) -> i32 = nvml_fn("nvmlDeviceGetCount_v2")?;
        let by_index: unsafe extern "C" fn(u32, *mut Device) -> i32 =
            nvml_fn("nvmlDeviceGetHandleByIndex_v2")?;
        let mut dev: Device = std::ptr::null_mut();
        let id = CString::new(bus_id).unwrap_or_default();
        // SAFETY: the real NVML lookups, resolved by name; `id` is a live NUL-terminated
        // CString and `dev` our local.
        if bus_id.is_empty() || unsafe { by_bus(id.as_ptr().cast(), &mut dev) } != NVML_SUCCESS {
            let mut n = 0;
            // SAFETY: the real driver's function of this C signature, resolved by name; its
            // pointer arguments are our own live locals.
            let r = unsafe { count(&mut n) };
            if r != NVML_SUCCESS || n == 0 {
                return Err(format!("no GPU {bus_id:?} and no GPU at all (count: {r})"));
            }
            if n > 1 {
                crate::log::log!(
                    Warn,
                    "GPU {bus_id:?} not found among {n} GPUs; throttling by the first"
                );
            }
            // SAFETY: the real driver's function of this C signature, resolved by name; its
            // pointer arguments are our own live locals.
            let r = unsafe { by_index(0, &mut dev) };
            if r != NVML_SUCCESS {
                return Err(format!("nvmlDeviceGetHandleByIndex_v2(0) returned {r}"));
            }
        }
        Ok(Processes {
            dev,
            get: nvml_fn("nvmlDeviceGetProcessUtilization")?,
            // Only periods from now on.
            last_seen_us: realtime_us(),
            prev_ts_us: None,
            period_ns: DEFAULT_PERIOD_NS,
            buf: Vec::new(),
            list: crate::mem::procs_fn().ok(),
            rates: nvml_fn("nvmlDeviceGetUtilizationRates").ok(),
        })
    }

    /// The PIDs of the GPU's compute processes as NVML names them (empty
    /// when unknown).
    fn running(&self) -> Vec<u32> {
        self.list
            .and_then(|list| crate::mem::compute_processes(list, self.dev))
            .map_or_else(Vec::new, |l| l.iter().map(|p| p.pid).collect())
    }

    /// The device's busy percent over NVML's latest period.
    fn device_busy(&self) -> Option<f64> {
        let f = self.rates?;
        let mut r = Rates::default();
        // SAFETY: the real nvmlDeviceGetUtilizationRates, resolved by name, into our local.
        (unsafe { f(self.dev, &mut r) } == NVML_SUCCESS).then_some(r.gpu as f64)
    }

    /// Periods finished since the last call, oldest first. `is_own`: host
    /// PID -> belongs to the container (asked only when samples arrived).
    ///
    /// A real driver names one process a sample period, the busiest (an
    /// H200 on driver 580: a 5 % tenant beside one at 50-99 % was never
    /// named in 6 s): a period naming only neighbours is
    /// [`Reported::eclipsed`], the container's use in it unknown, not
    /// zero. Named PIDs are neighbours when NVML lists the container's own
    /// processes among the GPU's compute processes by PIDs the container
    /// knows (so it could have named them; a pod's view lists only its own
    /// namespace, while samples name other pods' processes by host PID).
    /// Otherwise (the container's PIDs are not NVML's: a PID namespace
    /// that cannot be mapped, where NVML lists and names the container by
    /// PIDs it does not know) the named PID may be the container itself,
    /// and the period counts towards blindness as before. (MPS clients are
    /// told, not detected.)
    pub fn poll(&mut self, own_pids: impl FnOnce() -> Vec<i32>) -> Vec<Reported> {
        let mut n: u32 = 0;
        // SAFETY: the real nvmlDeviceGetProcessUtilization, resolved by name: a size query
        // (NULL array) into our local `n`.
        let r = unsafe { (self.get)(self.dev, std::ptr::null_mut(), &mut n, self.last_seen_us) };
        if r == NVML_ERROR_NOT_FOUND || (r != NVML_ERROR_INSUFFICIENT_SIZE && r != NVML_SUCCESS) {
            return Vec::new();
        }
        if n == 0 {
            return Vec::new();
        }
        self.buf.clear();
        self.buf.resize(n as usize + 8, Sample::default());
        let mut n = self.buf.len() as u32;
        // SAFETY: as above; `buf` holds `n` samples.
        let r = unsafe { (self.get)(self.dev, self.buf.as_mut_ptr(), &mut n, self.last_seen_us) };
        if r != NVML_SUCCESS {
            return Vec::new();
        }
        // Taken out for the loop (which may ask NVML for the process list).
        let mut buf = std::mem::take(&mut self.buf);
        let samples = &mut buf[..n as usize];
        samples.sort_by_key(|s| s.time_stamp);
        let pids = own_pids();
        let offset = mono_minus_realtime_ns();
        let mut out: Vec<Reported> = Vec::new();
        let mut running: Option<Vec<u32>> = None;
        let mut busy: Option<Option<f64>> = None;
        let mut i = 0;
        while i < samples.len() {
            let ts = samples[i].time_stamp;
            let (mut own, mut others) = (0.0, 0.0);
            while i < samples.len() && samples[i].time_stamp == ts {
                let s = samples[i];
                if pids.contains(&(s.pid as i32)) {
                    own += s.sm_util as f64;
                } else {
                    others += s.sm_util as f64;
                }
                i += 1;
            }
            // NVML lists the container's own processes by the PIDs the
            // container knows: it could have named them, so whoever it
            // named instead was busier.
            let eclipsed = own == 0.0 && others > 0.0 && {
                let r = running.get_or_insert_with(|| self.running());
                r.iter().any(|p| pids.contains(&(*p as i32)))
            };
            let device = if eclipsed {
                *busy.get_or_insert_with(|| self.device_busy())
            } else {
                None
            };
            if ts <= self.last_seen_us {
                continue;
            }
            if let Some(prev) = self.prev_ts_us {
                let gap = ts.saturating_sub(prev) * 1000;
                if gap >= 10_000_000 {
                    self.period_ns = self.period_ns.min(gap);
                }
            }
            self.prev_ts_us = Some(ts);
            out.push(Reported {
                end_ns: (ts as i128 * 1000 + offset as i128).max(0) as u64,
                len_ns: self.period_ns,
                own: own.min(100.0),
                others: others.min(100.0),
                eclipsed,
                device,
            });
        }
        if let Some(s) = samples.last() {
            self.last_seen_us = self.last_seen_us.max(s.time_stamp);
        }
        self.buf = buf;
        out
    }
}

fn clock(id: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only our local `ts`.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
}

fn realtime_us() -> u64 {
    (clock(libc::CLOCK_REALTIME) / 1000) as u64
}

/// CLOCK_MONOTONIC - CLOCK_REALTIME, to place NVML's epoch timestamps.
fn mono_minus_realtime_ns() -> i64 {
    (clock(libc::CLOCK_MONOTONIC) - clock(libc::CLOCK_REALTIME)) as i64
}
