//! Running processes and per-process utilization samples.

use crate::schedule;
use crate::*;
use gpu_sim_core::state::{epoch_us_to_mono, mono_to_epoch_us, now_ns};
use std::ffi::{c_uint, c_ulonglong};

/// MIG instance ids when MIG is off.
pub(crate) const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessInfo_v1_t {
    pid: c_uint,
    usedGpuMemory: c_ulonglong,
}

/// nvmlProcessInfo_t as the _v2 and _v3 calls use it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessInfo_t {
    pid: c_uint,
    usedGpuMemory: c_ulonglong,
    gpuInstanceId: c_uint,
    computeInstanceId: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct nvmlProcessUtilizationSample_t {
    pub(crate) pid: c_uint,
    pub(crate) timeStamp: c_ulonglong,
    pub(crate) smUtil: c_uint,
    pub(crate) memUtil: c_uint,
    encUtil: c_uint,
    decUtil: c_uint,
}

const _: () = assert!(std::mem::size_of::<nvmlProcessInfo_v1_t>() == 16);
const _: () = assert!(std::mem::size_of::<nvmlProcessInfo_t>() == 24);
const _: () = assert!(std::mem::size_of::<nvmlProcessUtilizationSample_t>() == 32);

/// How many entries the caller's buffer holds: `*count`, or 0 when `buf`
/// is null (a size query).
///
/// # Safety
/// `count` must be non-null and valid for reads.
unsafe fn capacity<T>(count: *const c_uint, buf: *mut T) -> usize {
    if buf.is_null() {
        0
    } else {
        // SAFETY: the caller guarantees `count` is valid.
        unsafe { *count as usize }
    }
}

/// The two-call protocol: `*count` too small (or `infos` null) gives
/// INSUFFICIENT_SIZE with the needed count; no processes is SUCCESS with 0.
fn fill<T>(count: *mut c_uint, infos: *mut T, items: Vec<T>) -> R {
    if count.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, checked above.
    let cap = unsafe { capacity(count, infos) };
    let n = items.len();
    // SAFETY: count is a valid out-pointer.
    unsafe { *count = n as c_uint };
    if n > cap {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (i, it) in items.into_iter().enumerate() {
        // SAFETY: the caller's array holds `cap` >= n entries.
        unsafe { infos.add(i).write_unaligned(it) };
    }
    Ok(())
}

/// Compute processes on a device with the memory they hold, as the driver
/// lists them to this caller (its namespace's by their PIDs there; all, by
/// host PID, to a caller in the initial namespace). A MIG device handle
/// lists the processes using that MIG device; a GPU lists them all, each
/// with the GPU and compute instance it uses (NO_INSTANCE for none).
fn compute<T>(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut T,
    make: fn(u32, u64, Option<(u32, u32)>) -> T,
) -> nvmlReturn_t {
    let list = |c: &Ctx, s: usize, only: Option<(u32, u32)>| {
        let items = c
            .state
            .listed_processes(s)
            .into_iter()
            .filter_map(|p| {
                let mig = c.state.process_mig_use(p.slot, s);
                let pid = p.pid().wrapping_add(sample_pid_offset());
                (only.is_none() || mig == only).then(|| make(pid, p.used_bytes, mig))
            })
            .collect();
        fill(count, infos, items)
    };
    crate::mig_handles::with_dev_or_mig(
        device,
        |c, s| list(c, s, None),
        |c, (s, g, ci)| list(c, s, Some((g.id, ci.id))),
    )
}

fn v1(pid: u32, used: u64, _: Option<(u32, u32)>) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t {
        pid,
        usedGpuMemory: used,
    }
}

fn v2(pid: u32, used: u64, mig: Option<(u32, u32)>) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        usedGpuMemory: used,
        gpuInstanceId: mig.map_or(NO_INSTANCE, |m| m.0),
        computeInstanceId: mig.map_or(NO_INSTANCE, |m| m.1),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    compute(device, count, infos, v1)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    compute(device, count, infos, v2)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    compute(device, count, infos, v2)
}

/// No graphics or MPS clients exist on the simulated node.
fn none<T>(device: nvmlDevice_t, count: *mut c_uint, infos: *mut T) -> nvmlReturn_t {
    ffi(|| {
        ctx()?.dev(device)?;
        fill(count, infos, Vec::new())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    none(device, count, infos)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v2(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    none(device, count, infos)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    none(device, count, infos)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    none(device, count, infos)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    none(device, count, infos)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    none(device, count, infos)
}

// ---- utilization samples ------------------------------------------------

/// The driver's nominal sampling period: one sample per process per period
/// (see `schedule.rs` for how real periods wander).
pub const SAMPLE_NS: u64 = 100_000_000;
/// How far back samples reach (the real driver's buffer is bounded too).
pub const HISTORY_NS: u64 = 5_000_000_000;
/// Test knob: added to the PID of every utilization sample and every
/// listed compute process this process reads, as if the processes ran in a
/// PID namespace the caller cannot map (NVML names a process by one PID in
/// both: what the interposer's compute quota must notice). Unset: real PIDs.
pub const SAMPLE_PID_OFFSET_ENV: &str = "GPU_SIM_NVML_SAMPLE_PID_OFFSET";

/// Test knob: while this file exists in the sim's state directory
/// (`run/gpu-sim/`), no process reports utilization samples, as when the
/// driver's sampling stalls: what feedback-less throttling looks like.
pub const SAMPLES_OFF_FILE: &str = "nvml-samples-off";

fn busiest_only() -> bool {
    std::env::var_os(gpu_sim_core::SAMPLE_BUSIEST_ONLY_ENV).is_some_and(|v| v == "1")
}

fn sample_pid_offset() -> u32 {
    std::env::var(SAMPLE_PID_OFFSET_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Samples of periods that ended after `last_seen_us` (epoch µs), within
/// the history and already published, oldest first: one per process that
/// ran in the sample's window, with its whole-percent share of the window
/// in smUtil. The node's schedule (`schedule.rs`) may wander, publish late
/// and skip a period now and then, as a real driver's does.
pub(crate) fn samples(
    c: &Ctx,
    sim: usize,
    last_seen_us: u64,
) -> Vec<nvmlProcessUtilizationSample_t> {
    if c.state.root().state_dir().join(SAMPLES_OFF_FILE).exists() {
        return Vec::new();
    }
    let now = now_ns();
    let mut since = now.saturating_sub(HISTORY_NS);
    if last_seen_us > 0 {
        since = since.max(epoch_us_to_mono(last_seen_us));
    }
    let mut out = Vec::new();
    let pid_offset = sample_pid_offset();
    let sched = &c.state.node().nvml_sampling;
    for k in (since / SAMPLE_NS).max(1)..=now / SAMPLE_NS {
        let (start, end) = schedule::window(sched, sim, k);
        if schedule::skipped(sched, sim, k) || schedule::published(sched, sim, k) > now {
            continue;
        }
        let ts = mono_to_epoch_us(end);
        if ts <= last_seen_us {
            continue;
        }
        let sample = |pid: u32, pct: f64| nvmlProcessUtilizationSample_t {
            pid,
            timeStamp: ts,
            smUtil: pct.round() as c_uint,
            memUtil: (pct / 2.0).round() as c_uint,
            encUtil: 0,
            decUtil: 0,
        };
        let used = c.state.process_utilization(sim, start, end);
        match gpu_sim_core::mps_server_pid() {
            // Under MPS the server runs every client's kernels: one sample.
            Some(server) if !used.is_empty() => {
                let pct: f64 = used.iter().map(|(_, p)| p).sum();
                out.push(sample(server, pct.min(100.0)));
            }
            Some(_) => {}
            None => {
                if busiest_only() {
                    // The busiest process, with the device's whole busy time.
                    let top = used.iter().max_by(|a, b| a.1.total_cmp(&b.1));
                    let all: f64 = used.iter().map(|(_, p)| p).sum();
                    if let Some((p, _)) = top {
                        out.push(sample(p.pid().wrapping_add(pid_offset), all.min(100.0)));
                    }
                    continue;
                }
                for (p, pct) in used {
                    out.push(sample(p.pid().wrapping_add(pid_offset), pct));
                }
            }
        }
    }
    out
}

/// Samples handed out by a size query, kept so that the query and the call
/// that follows it see the same set even when a period ends in between.
struct Pending {
    sim: usize,
    last_seen_us: u64,
    taken_ns: u64,
    samples: Vec<nvmlProcessUtilizationSample_t>,
}

static PENDING: Mutex<Option<Pending>> = Mutex::new(None);

/// Real semantics: a null buffer or a too small `*count` gives
/// INSUFFICIENT_SIZE with the needed count; no samples newer than
/// `lastSeenTimeStamp` gives NOT_FOUND.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    last_seen_us: c_ulonglong,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        let kept = pending.take().filter(|p| {
            p.sim == sim
                && p.last_seen_us == last_seen_us
                && now_ns().saturating_sub(p.taken_ns) < SAMPLE_NS * 10
        });
        let list = match kept {
            Some(p) if !utilization.is_null() => p.samples,
            _ => samples(&c, sim, last_seen_us),
        };
        if list.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        // SAFETY: non-null, checked above.
        let cap = unsafe { capacity(count, utilization) };
        if list.len() > cap {
            // SAFETY: valid out-pointer.
            unsafe { *count = list.len() as c_uint };
            *pending = Some(Pending {
                sim,
                last_seen_us,
                taken_ns: now_ns(),
                samples: list,
            });
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        fill(count, utilization, list)
    })
}
