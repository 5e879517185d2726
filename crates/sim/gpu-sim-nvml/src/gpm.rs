//! GPM (GPU Performance Monitoring, Hopper and newer): samples of a whole
//! GPU or of one MIG GPU instance, and metrics between two of them.
//!
//! A sample records which timeline it reads (a GPU, or a GPU instance's own
//! one: `gpu-sim-core`'s mig_use.rs) and when it was taken; the metrics are
//! the timelines' busy share of the time between two samples. SM_UTIL and
//! GRAPHICS_UTIL are both that share (the sim runs compute kernels only and
//! has no per-SM model); every other metric is NOT_SUPPORTED in its entry.
//!
//! Measured on the real 550 and 535 libraries (no GPU needed): every GPM
//! call before init, Alloc and Free included, is UNINITIALIZED.

use crate::mig_handles::with_dev_or_mig;
use crate::*;
use gpu_sim_core::state::now_ns;
use std::collections::BTreeSet;
use std::ffi::{CStr, c_uint};
use std::ptr::{addr_of, addr_of_mut};

// Layouts as nvml.h has them, per the nvml-wrapper-sys 0.10 bindings
// (~/.cargo/registry/src/*/nvml-wrapper-sys-0.10.0/src/bindings.rs:
// nvmlGpmMetric_t, nvmlGpmMetricsGet_t, nvmlGpmSupport_t and the
// NVML_GPM_* constants).

pub const NVML_GPM_METRICS_GET_VERSION: c_uint = 1;
pub const NVML_GPM_SUPPORT_VERSION: c_uint = 1;
pub const NVML_GPM_METRIC_GRAPHICS_UTIL: c_uint = 1;
pub const NVML_GPM_METRIC_SM_UTIL: c_uint = 2;
/// The metrics array's length in the 12.x header the bindings follow. Later
/// headers grew it (CUDA 13's pynvml: 477) without a new struct version;
/// only entries below `numMetrics` are touched, so a bigger array is fine.
pub const NVML_GPM_METRIC_MAX: usize = 210;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlGpmMetricInfo_t {
    shortName: *const c_char,
    longName: *const c_char,
    unit: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlGpmMetric_t {
    metricId: c_uint,
    nvmlReturn: nvmlReturn_t,
    value: f64,
    metricInfo: nvmlGpmMetricInfo_t,
}

#[repr(C)]
pub struct nvmlGpmMetricsGet_t {
    version: c_uint,
    numMetrics: c_uint,
    sample1: nvmlGpmSample_t,
    sample2: nvmlGpmSample_t,
    metrics: [nvmlGpmMetric_t; NVML_GPM_METRIC_MAX],
}

#[repr(C)]
pub struct nvmlGpmSupport_t {
    version: c_uint,
    isSupportedDevice: c_uint,
}

const _: () = assert!(std::mem::size_of::<nvmlGpmMetric_t>() == 40);
const _: () = assert!(std::mem::size_of::<nvmlGpmMetricsGet_t>() == 24 + 40 * NVML_GPM_METRIC_MAX);
const _: () = assert!(std::mem::offset_of!(nvmlGpmMetricsGet_t, metrics) == 24);
const _: () = assert!(std::mem::size_of::<nvmlGpmSupport_t>() == 8);

/// What a sample reads: a GPU's timeline, or one GPU instance's of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Source {
    gpu: usize,
    gi: Option<u32>,
}

/// An `nvmlGpmSample_t`: opaque to C, owned by the caller from Alloc to
/// Free. `None` until a SampleGet fills it.
pub struct GpmSample {
    taken: Option<(Source, u64)>,
}

pub type nvmlGpmSample_t = *mut GpmSample;

/// Addresses of the samples handed out and not yet freed: a stale or
/// foreign pointer is INVALID_ARGUMENT rather than a wild access, and
/// holding the lock while a sample is read or written orders those against
/// its Free.
static LIVE: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

fn live() -> std::sync::MutexGuard<'static, BTreeSet<usize>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on a live sample; anything else is INVALID_ARGUMENT.
fn with_sample<T>(
    p: nvmlGpmSample_t,
    f: impl FnOnce(&mut GpmSample) -> T,
) -> Result<T, nvmlReturn_t> {
    let set = live();
    if p.is_null() || !set.contains(&(p as usize)) {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: a Box this module leaked and has not freed (it is in LIVE,
    // whose lock we hold, so no Free runs meanwhile).
    Ok(f(unsafe { &mut *p }))
}

fn record(p: nvmlGpmSample_t, src: Source) -> R {
    with_sample(p, |s| s.taken = Some((src, now_ns())))
}

/// GPM needs Hopper (compute capability 9.x) or newer.
fn gpm_capable(c: &Ctx, sim: usize) -> bool {
    c.gpu(sim).compute_capability().0 >= 9
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(gpmSample: *mut nvmlGpmSample_t) -> nvmlReturn_t {
    ffi(|| {
        ctx()?;
        if gpmSample.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let p = Box::into_raw(Box::new(GpmSample { taken: None }));
        live().insert(p as usize);
        put(gpmSample, p)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleFree(gpmSample: nvmlGpmSample_t) -> nvmlReturn_t {
    ffi(|| {
        ctx()?;
        if !live().remove(&(gpmSample as usize)) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: it was in LIVE, so it is a Box from Alloc, freed once
        // (removed from LIVE above, under its lock).
        drop(unsafe { Box::from_raw(gpmSample) });
        Ok(())
    })
}

/// `isSupportedDevice` for a GPU handle. A MIG device handle is
/// INVALID_ARGUMENT: support is asked of its parent.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    device: nvmlDevice_t,
    gpmSupport: *mut nvmlGpmSupport_t,
) -> nvmlReturn_t {
    on_gpu(device, |c, sim| {
        check_version(gpmSupport, NVML_GPM_SUPPORT_VERSION)?;
        put(
            gpmSupport,
            nvmlGpmSupport_t {
                version: NVML_GPM_SUPPORT_VERSION,
                isSupportedDevice: gpm_capable(c, sim).into(),
            },
        )
    })
}

/// Runs `f` for a whole-GPU handle; a MIG device handle is INVALID_ARGUMENT.
fn on_gpu(device: nvmlDevice_t, f: impl FnOnce(&Ctx, usize) -> R) -> nvmlReturn_t {
    with_dev_or_mig(device, f, |_, _| Err(NVML_ERROR_INVALID_ARGUMENT))
}

/// A sample of a GPU handle: the whole GPU (in MIG mode, its instances
/// together). A MIG device handle samples its GPU instance (DCGM samples
/// compute instances this way; the sim's compute instances share their GPU
/// instance's timeline).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleGet(
    device: nvmlDevice_t,
    gpmSample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    let take = |c: &Ctx, gpu: usize, gi: Option<u32>| {
        with_sample(gpmSample, |_| ())?;
        if !gpm_capable(c, gpu) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        record(gpmSample, Source { gpu, gi })
    };
    with_dev_or_mig(
        device,
        |c, sim| take(c, sim, None),
        |c, (sim, g, _)| take(c, sim, Some(g.id)),
    )
}

/// A sample of GPU instance `gpuInstanceId` of a GPU (its parent handle) in
/// MIG mode: NOT_SUPPORTED when the GPU cannot do GPM or is not in MIG
/// mode, NOT_FOUND when it has no such instance.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    device: nvmlDevice_t,
    gpuInstanceId: c_uint,
    gpmSample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    on_gpu(device, |c, sim| {
        with_sample(gpmSample, |_| ())?;
        if !gpm_capable(c, sim) || !c.state.mig_mode(sim).is_ok_and(|(cur, _)| cur) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        if c.state.gpu_instance(sim, gpuInstanceId).is_none() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        let src = Source {
            gpu: sim,
            gi: Some(gpuInstanceId),
        };
        record(gpmSample, src)
    })
}

/// What two samples measure: their source and the time between them, or
/// INVALID_ARGUMENT (not taken, of different sources, or out of order).
fn window(
    first: Option<(Source, u64)>,
    second: Option<(Source, u64)>,
) -> Result<(Source, u64, u64), nvmlReturn_t> {
    match (first, second) {
        (Some((a, t1)), Some((b, t2))) if a == b && t2 > t1 => Ok((a, t1, t2)),
        _ => Err(NVML_ERROR_INVALID_ARGUMENT),
    }
}

/// Percent of [from, to) the source ran kernels. A whole GPU counts its own
/// timeline and its instances' (one of the two is empty unless MIG mode
/// changed in between), summed and capped: the time any of them was busy,
/// when they rarely overlap (nvidia's docs do not say what a whole-GPU
/// sample of a GPU in MIG mode reads).
fn busy_percent(c: &Ctx, src: Source, from: u64, to: u64) -> f64 {
    let s = &c.state;
    match src.gi {
        Some(gi) => s.gi_utilization(src.gpu, gi, from, to),
        None => {
            let gis: f64 = s
                .gpu_instances(src.gpu)
                .iter()
                .map(|g| s.gi_utilization(src.gpu, g.id, from, to))
                .sum();
            (s.utilization(src.gpu, from, to) + gis).min(100.0)
        }
    }
}

/// The entry for metric `id` given the measured busy percent.
fn metric(id: c_uint, busy: f64) -> nvmlGpmMetric_t {
    // Names as the real library's table has them (its strings: "gract"
    // GRAPHICS_UTIL, "smutil" SM_UTIL).
    let named = |short: &'static CStr, long: &'static CStr| nvmlGpmMetric_t {
        metricId: id,
        nvmlReturn: NVML_SUCCESS,
        value: busy,
        metricInfo: nvmlGpmMetricInfo_t {
            shortName: short.as_ptr(),
            longName: long.as_ptr(),
            unit: c"%".as_ptr(),
        },
    };
    match id {
        NVML_GPM_METRIC_GRAPHICS_UTIL => named(c"gract", c"GRAPHICS_UTIL"),
        NVML_GPM_METRIC_SM_UTIL => named(c"smutil", c"SM_UTIL"),
        _ => nvmlGpmMetric_t {
            metricId: id,
            nvmlReturn: NVML_ERROR_NOT_SUPPORTED,
            value: 0.0,
            metricInfo: nvmlGpmMetricInfo_t {
                shortName: std::ptr::null(),
                longName: std::ptr::null(),
                unit: std::ptr::null(),
            },
        },
    }
}

/// Fills `metrics[i]` for i < numMetrics from the two samples' window:
/// version 1, at most NVML_GPM_METRIC_MAX metrics, two samples of one
/// source taken in order. Each entry carries its own status.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMetricsGet(metricsGet: *mut nvmlGpmMetricsGet_t) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        check_version(metricsGet, NVML_GPM_METRICS_GET_VERSION)?;
        // Raw field accesses, no reference to the whole struct: a caller
        // built against another header has a metrics array of another length.
        // SAFETY: non-null (checked above), the caller's nvmlGpmMetricsGet_t.
        let (n, p1, p2) = unsafe {
            (
                addr_of!((*metricsGet).numMetrics).read_unaligned(),
                addr_of!((*metricsGet).sample1).read_unaligned(),
                addr_of!((*metricsGet).sample2).read_unaligned(),
            )
        };
        let n = n as usize;
        if n > NVML_GPM_METRIC_MAX {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let first = with_sample(p1, |s| s.taken)?;
        let second = with_sample(p2, |s| s.taken)?;
        let (src, from, to) = window(first, second)?;
        let busy = busy_percent(&c, src, from, to);
        // SAFETY: as above; the metrics array starts at a fixed offset.
        let base = unsafe { addr_of_mut!((*metricsGet).metrics) }.cast::<nvmlGpmMetric_t>();
        for i in 0..n {
            // SAFETY: i < numMetrics, the entries the caller says its array
            // holds; metricId is an input, the rest outputs.
            unsafe {
                let m = base.add(i);
                let id = addr_of!((*m).metricId).read_unaligned();
                m.write_unaligned(metric(id, busy));
            }
        }
        Ok(())
    })
}

/// Streaming (the driver sampling GPM on its own) is never on in the sim.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmQueryIfStreamingEnabled(
    device: nvmlDevice_t,
    state: *mut c_uint,
) -> nvmlReturn_t {
    on_gpu(device, |c, sim| {
        if !gpm_capable(c, sim) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        put(state, 0)
    })
}

/// NOT_SUPPORTED: the sim has no streaming sampler to turn on, and its
/// samples already read the timelines at any interval.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSetStreamingEnabled(
    device: nvmlDevice_t,
    _state: c_uint,
) -> nvmlReturn_t {
    on_gpu(device, |_, _| Err(NVML_ERROR_NOT_SUPPORTED))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU0: Source = Source { gpu: 0, gi: None };

    #[test]
    fn a_window_needs_two_samples_of_one_source_in_order() {
        let gi1 = Source {
            gpu: 0,
            gi: Some(1),
        };
        assert_eq!(
            window(Some((GPU0, 10)), Some((GPU0, 20))),
            Ok((GPU0, 10, 20))
        );
        let bad = Err(NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(window(None, Some((GPU0, 20))), bad, "not taken");
        assert_eq!(window(Some((GPU0, 20)), Some((GPU0, 10))), bad, "reversed");
        assert_eq!(window(Some((GPU0, 10)), Some((GPU0, 10))), bad, "the same");
        assert_eq!(
            window(Some((GPU0, 10)), Some((gi1, 20))),
            bad,
            "two sources"
        );
        let gpu1 = Source { gpu: 1, gi: None };
        assert_eq!(window(Some((GPU0, 10)), Some((gpu1, 20))), bad);
    }

    #[test]
    fn utilization_metrics_are_named_the_rest_not_supported() {
        let m = metric(NVML_GPM_METRIC_SM_UTIL, 42.5);
        assert_eq!((m.metricId, m.nvmlReturn, m.value), (2, NVML_SUCCESS, 42.5));
        // SAFETY: static NUL-terminated strings.
        let s = |p| unsafe { CStr::from_ptr(p) }.to_str().unwrap();
        let i = m.metricInfo;
        assert_eq!(
            (s(i.shortName), s(i.longName), s(i.unit)),
            ("smutil", "SM_UTIL", "%")
        );
        let g = metric(NVML_GPM_METRIC_GRAPHICS_UTIL, 42.5);
        assert_eq!((g.nvmlReturn, g.value), (NVML_SUCCESS, 42.5));
        assert_eq!(s(g.metricInfo.longName), "GRAPHICS_UTIL");
        let o = metric(3, 42.5); // SM_OCCUPANCY
        assert_eq!(
            (o.metricId, o.nvmlReturn, o.value),
            (3, NVML_ERROR_NOT_SUPPORTED, 0.0)
        );
        assert!(o.metricInfo.shortName.is_null());
    }

    #[test]
    fn every_gpm_call_needs_init_as_the_real_library() {
        // This test binary never initializes (see system.rs's tests).
        let mut p: nvmlGpmSample_t = std::ptr::null_mut();
        let mut support = nvmlGpmSupport_t {
            version: NVML_GPM_SUPPORT_VERSION,
            isSupportedDevice: 7,
        };
        let mut state = 9;
        let gpu = handle_of(0);
        // SAFETY: valid out-pointers to locals; null and handle arguments
        // are refused before use.
        let got = unsafe {
            [
                nvmlGpmSampleAlloc(&mut p),
                nvmlGpmSampleFree(std::ptr::null_mut()),
                nvmlGpmSampleGet(gpu, std::ptr::null_mut()),
                nvmlGpmMigSampleGet(gpu, 1, std::ptr::null_mut()),
                nvmlGpmMetricsGet(std::ptr::null_mut()),
                nvmlGpmQueryDeviceSupport(gpu, &mut support),
                nvmlGpmQueryIfStreamingEnabled(gpu, &mut state),
                nvmlGpmSetStreamingEnabled(gpu, 1),
            ]
        };
        assert_eq!(got, [NVML_ERROR_UNINITIALIZED; 8]);
        assert!(p.is_null());
        assert_eq!((support.isSupportedDevice, state), (7, 9));
    }

    #[test]
    fn only_live_samples_are_used() {
        let p = Box::into_raw(Box::new(GpmSample { taken: None }));
        assert_eq!(with_sample(p, |_| ()), Err(NVML_ERROR_INVALID_ARGUMENT));
        live().insert(p as usize);
        assert_eq!(record(p, GPU0), Ok(()));
        let taken = with_sample(p, |s| s.taken).unwrap();
        assert_eq!(taken.map(|t| t.0), Some(GPU0));
        assert!(live().remove(&(p as usize)));
        // SAFETY: the Box made above, out of LIVE again.
        drop(unsafe { Box::from_raw(p) });
        assert_eq!(
            with_sample(std::ptr::null_mut(), |_| ()),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }
}
