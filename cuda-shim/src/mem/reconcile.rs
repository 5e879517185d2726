//! Reconciling with NVML: the driver takes device memory nobody asks for
//! by size (contexts, module images, the device heap, pools' caches), so
//! the process's ledger reservation is max(counted, measured), where
//! measured is the real NVML's per-process used memory. The difference
//! (the "extra") is reserved in the ledger, so other processes'
//! allocations see it, and given back when it shrinks.
//!
//! Measured on the watcher's tick (at most every [`PERIOD`]) and right
//! after calls that take such memory (`ctx.rs`); never on an allocation
//! path. A measurement is dropped when an allocation or free ran while it
//! was taken (the two counts differ while one is in flight).
//!
//! Without the real NVML (a memory-only container whose node lacks
//! `libnvidia-ml.so.<ver>`) nothing is measured: the quota counts what
//! programs ask for, pools' reservations and graph memory, and one warning
//! says so. A compute quota already fails closed without it (`init.rs`).
//!
//! A share on several GPUs is measured per GPU: each GPU's NVML device
//! (found by the record's bus id), each GPU's extra in that GPU's ledger.

use super::local::{local, lock};
use super::quota::{FINISHED, STARTED, force_take, give_back};
use crate::config;
use crate::log::log;
use crate::real::{Lib, sym, try_handle};
use crate::registration::proc;
use std::ffi::{CString, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the watcher's tick measures.
pub const PERIOD: Duration = Duration::from_millis(100);

/// `nvmlProcessInfo_t` (v2/v3 layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ProcInfo {
    pub pid: u32,
    pub used: u64,
    gpu_instance: u32,
    compute_instance: u32,
}

/// `nvmlDeviceGetComputeRunningProcesses_v3` (or `_v2`, same layout).
pub(crate) type Procs = unsafe extern "C" fn(*mut c_void, *mut u32, *mut ProcInfo) -> i32;

/// The real NVML's compute processes on `dev` through `procs`, the list
/// grown as NVML's size protocol asks; `None` when it fails.
pub(crate) fn compute_processes(procs: Procs, dev: *mut c_void) -> Option<Vec<ProcInfo>> {
    let mut buf = vec![ProcInfo::default(); 64];
    for _ in 0..4 {
        let mut count = buf.len() as u32;
        // SAFETY: the real process-list query, resolved by name; `count` is the capacity of
        // `buf`, which holds that many ProcInfo entries (the v2/v3 layout).
        let r = unsafe { procs(dev, &mut count, buf.as_mut_ptr()) };
        if r == NVML_ERROR_INSUFFICIENT_SIZE {
            buf.resize(count as usize + 16, ProcInfo::default());
            continue;
        }
        if r != NVML_SUCCESS {
            return None;
        }
        buf.truncate(count as usize);
        return Some(buf);
    }
    None
}

/// The process-list query of the real NVML: `_v3`, else `_v2`.
pub(crate) fn procs_fn() -> Result<Procs, String> {
    f("nvmlDeviceGetComputeRunningProcesses_v3")
        .or_else(|_| f("nvmlDeviceGetComputeRunningProcesses_v2"))
}

struct Nvml {
    dev: *mut c_void,
    procs: Procs,
}

// SAFETY: `dev` is an opaque NVML device handle, valid process-wide and for any thread once
// obtained; NVML is thread-safe. `procs` is a plain fn pointer.
unsafe impl Send for Nvml {}
// SAFETY: as for Send: NVML calls are thread-safe and the struct is never mutated after `open`.
unsafe impl Sync for Nvml {}

const NVML_SUCCESS: i32 = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: i32 = 7;

fn f<T: Copy>(name: &str) -> Result<T, String> {
    let c = CString::new(name).unwrap();
    let p = sym(Lib::Nvml, &c);
    if p == 0 {
        return Err(format!("the real NVML has no {name}"));
    }
    // SAFETY: every caller names T as the `unsafe extern "C" fn` type of the symbol's C
    // signature (pointer-sized), and `p` is that symbol's non-zero address.
    Ok(unsafe { std::mem::transmute_copy::<usize, T>(&p) })
}

/// NVML's device of `bus_id`; with `first_if_unknown` (a one-GPU
/// container, which sees only its GPU), the first device when the bus id
/// names none.
fn open(bus_id: &str, first_if_unknown: bool) -> Result<Nvml, String> {
    try_handle(Lib::Nvml).map_err(str::to_string)?;
    let init: unsafe extern "C" fn() -> i32 = f("nvmlInit_v2")?;
    // SAFETY: the real nvmlInit_v2, resolved by name; no arguments.
    let r = unsafe { init() };
    if r != NVML_SUCCESS {
        return Err(format!("nvmlInit_v2 returned {r}"));
    }
    let by_bus: unsafe extern "C" fn(*const i8, *mut *mut c_void) -> i32 =
        f("nvmlDeviceGetHandleByPciBusId_v2")?;
    let by_index: unsafe extern "C" fn(u32, *mut *mut c_void) -> i32 =
        f("nvmlDeviceGetHandleByIndex_v2")?;
    let mut dev = std::ptr::null_mut();
    let id = CString::new(bus_id).unwrap_or_default();
    // SAFETY: the real NVML lookups, resolved by name; `id` is a live NUL-terminated CString
    // and `dev` our local.
    if bus_id.is_empty() || unsafe { by_bus(id.as_ptr().cast(), &mut dev) } != NVML_SUCCESS {
        if !first_if_unknown {
            return Err(format!("NVML has no GPU {bus_id}"));
        }
        // A container sees its own GPU only.
        // SAFETY: the real nvmlDeviceGetHandleByIndex_v2, resolved by name; `dev` is our local.
        let r = unsafe { by_index(0, &mut dev) };
        if r != NVML_SUCCESS {
            return Err(format!("no GPU {bus_id:?} (first GPU: {r})"));
        }
    }
    Ok(Nvml {
        dev,
        procs: procs_fn()?,
    })
}

/// NVML's device of each GPU of the share (record order), where found.
fn nvml() -> &'static [Option<Nvml>] {
    static NVML: OnceLock<Vec<Option<Nvml>>> = OnceLock::new();
    NVML.get_or_init(|| {
        let Some(enf) = config::enforce() else {
            return Vec::new();
        };
        let one = enf.gpus.len() == 1;
        enf.gpus
            .iter()
            .map(|g| match open(&g.bus_id, one) {
                Ok(n) => Some(n),
                Err(e) => {
                    log!(
                        Warn,
                        "memory the driver takes on its own (contexts, modules, heap) on GPU \
                         {} is not counted against its quota: {e}",
                        g.bus_id
                    );
                    None
                }
            })
            .collect()
    })
}

/// The device memory NVML says this process uses: listed under its host
/// PID (what real drivers report, from any PID namespace), else under its
/// own namespace's PID (a driver that cannot see the host's PIDs from inside
/// the container). `None` when NVML does not list the process at all:
/// unknown, never taken for zero.
fn measure(n: &Nvml, host_pid: i32, own_pid: i32) -> Option<u64> {
    let listed = compute_processes(n.procs, n.dev)?;
    let used_by = |pid: i32| {
        listed
            .iter()
            .filter(|p| p.pid as i32 == pid)
            .map(|p| p.used)
            .max()
    };
    used_by(host_pid).or_else(|| (own_pid != host_pid).then(|| used_by(own_pid)).flatten())
}

/// Says once that NVML does not list this process (MPS, MIG, a PID
/// namespace NVML cannot map): what the driver takes on its own is not
/// counted until it does.
fn unlisted(host_pid: i32) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        log!(
            Warn,
            "NVML does not list this process (host PID {host_pid}, PID {} here): memory the \
             driver takes on its own (contexts, modules, heap) is not counted until it does",
            std::process::id()
        )
    });
}

static LAST_NS: AtomicU64 = AtomicU64::new(0);

/// The extra this process holds in the ledgers now (all GPUs).
pub fn extra() -> u64 {
    lock(&local().extra).iter().sum()
}

/// One measurement of each GPU (a GPU is skipped when nothing can be
/// measured or an allocation ran meanwhile).
fn reconcile() {
    if config::enforce().is_none() {
        return;
    }
    let p = proc();
    if !p.is_registered() {
        return;
    }
    let devs = nvml();
    let mut extra = lock(&local().extra);
    let n = devs.len().max(extra.len());
    extra.resize(n, 0);
    let guard = p.attach();
    let Some(a) = guard.as_ref() else { return };
    for (gpu, n) in devs.iter().enumerate() {
        if let Some(n) = n {
            reconcile_gpu(a, gpu, n, &mut extra[gpu]);
        }
    }
}

fn reconcile_gpu(a: &crate::registration::Attach, gpu: usize, n: &Nvml, extra: &mut u64) {
    let p = proc();
    let started = STARTED.load(Ordering::Acquire);
    if FINISHED.load(Ordering::Acquire) != started {
        return;
    }
    let used = p.used_on(gpu).load(Ordering::Acquire);
    // Graph memory reserved but not backed until its exec's first launch:
    // not in NVML's figure yet, so not compared with it.
    let unmapped = crate::graph::unmapped_on(gpu);
    let Some(measured) = measure(n, a.host_pid, std::process::id() as i32) else {
        // Only a process that holds device memory is listed; before its
        // first context nothing is missing.
        if used > 0 {
            unlisted(a.host_pid);
        }
        return;
    };
    if STARTED.load(Ordering::Acquire) != started || FINISHED.load(Ordering::Acquire) != started {
        return;
    }
    let counted = used.saturating_sub(*extra).saturating_sub(unmapped);
    let target = measured.saturating_sub(counted);
    if target > *extra {
        force_take(a, gpu, target - *extra);
    } else {
        give_back(Some(a), gpu, *extra - target);
    }
    if target != *extra {
        log!(
            Debug,
            "GPU {gpu}: NVML says {measured} bytes, counted {counted}: extra {} -> {target}",
            *extra
        );
    }
    *extra = target;
}

/// How old a measurement may be when a program asks what is free.
const FRESH: Duration = Duration::from_millis(2);

/// A kernel launch returned since the last measurement: with lazy loading
/// the driver loads a kernel's module at its first launch, so its memory
/// may have grown. Set after the real launch, cleared before a measurement.
static LAUNCHED: AtomicBool = AtomicBool::new(false);

/// Every launch, after the real call: one relaxed load, the store only on
/// the first launch after a measurement (the line stays shared otherwise).
#[inline(always)]
pub(crate) fn launched() {
    if !LAUNCHED.load(Ordering::Relaxed) {
        LAUNCHED.store(true, Ordering::Release);
    }
}

/// Measures again, for the memory queries (`cuMemGetInfo`,
/// `nvmlDeviceGetMemoryInfo`), unless the last measurement is under
/// [`FRESH`] old and no launch ran since: what the driver took on its own
/// (a module loaded lazily at a kernel's first launch) is then already in
/// the answer, as it is in the driver's per-process figure. vLLM sizes its
/// KV cache from one such query right after its warm-up launches; with the
/// time window alone, a query under 2 ms after the previous one missed the
/// module its launch loaded.
pub(crate) fn fresh() {
    if config::enforce().is_none() {
        return;
    }
    let last = LAST_NS.load(Ordering::Acquire);
    if last != 0
        && now_ns().saturating_sub(last) < FRESH.as_nanos() as u64
        && !LAUNCHED.load(Ordering::Acquire)
    {
        return;
    }
    now();
}

/// Measures now (after a context, module or heap change).
pub(crate) fn now() {
    measuring(now_ns());
    reconcile();
}

/// A measurement starts at `at`: what [`fresh`] compares with.
fn measuring(at: u64) {
    LAST_NS.store(at, Ordering::Release);
    LAUNCHED.store(false, Ordering::Release);
}

/// Measures now; true when the extra is above `before` (taken before the
/// call that may have grown it; the watcher's tick may have measured the
/// growth first) and the container is now over its quota.
pub(crate) fn grew_over_quota(before: u64) -> bool {
    now();
    if extra() <= before {
        return false;
    }
    let guard = proc().attach();
    guard
        .as_ref()
        .is_some_and(|a| a.gpus.iter().any(|g| g.ledger.used() > g.quota))
}

fn now_ns() -> u64 {
    static T0: OnceLock<Instant> = OnceLock::new();
    T0.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// The watcher's tick: pools, then NVML, at most every [`PERIOD`].
pub fn tick() {
    if config::enforce().is_none() {
        return;
    }
    let now = now_ns();
    let last = LAST_NS.load(Ordering::Acquire);
    if now.saturating_sub(last) < PERIOD.as_nanos() as u64 && last != 0 {
        return;
    }
    measuring(now);
    super::pool::settle_all();
    reconcile();
}
