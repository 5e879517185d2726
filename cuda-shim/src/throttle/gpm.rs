//! Utilisation feedback inside a MIG device: NVML has no per-process
//! samples on a GPU in MIG mode, but GPM (GPU Performance Monitoring,
//! Hopper and newer) samples each GPU instance's SMs. The controller is fed
//! the instance's SM utilisation as the container's own: right when the
//! share is the instance's only tenant; with several shares in one
//! instance each is charged for all of them, so together they stay within
//! the largest quota (never above any, fail closed).
//!
//! Layouts and ids: NVIDIA's `nvml.h` (`nvmlGpmMetricsGet_t`,
//! `nvmlGpmSupport_t`, `NVML_GPM_METRIC_SM_UTIL`), as nvml-wrapper-sys
//! 0.10's `bindings.rs` carries them.

use super::controller::DEFAULT_PERIOD_NS;
use super::sampler::{Device, Reported, nvml_fn, nvml_init};
use std::ffi::{CString, c_char, c_void};

const NVML_SUCCESS: i32 = 0;
const GPM_METRICS_GET_VERSION: u32 = 1;
const GPM_SUPPORT_VERSION: u32 = 1;
const GPM_METRIC_SM_UTIL: u32 = 2;
const GPM_METRIC_MAX: usize = 210;

type Sample = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy)]
struct MetricInfo {
    short_name: *mut c_char,
    long_name: *mut c_char,
    unit: *mut c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Metric {
    metric_id: u32,
    nvml_return: i32,
    value: f64,
    info: MetricInfo,
}

#[repr(C)]
struct MetricsGet {
    version: u32,
    num_metrics: u32,
    sample1: Sample,
    sample2: Sample,
    metrics: [Metric; GPM_METRIC_MAX],
}

#[repr(C)]
struct Support {
    version: u32,
    is_supported_device: u32,
}

type MigSampleGet = unsafe extern "C" fn(Device, u32, Sample) -> i32;
type MetricsGetFn = unsafe extern "C" fn(*mut MetricsGet) -> i32;
type SampleFree = unsafe extern "C" fn(Sample) -> i32;

/// GPM samples of one GPU instance, one per controller period.
pub struct InstanceSampler {
    parent: Device,
    gpu_instance: u32,
    sample_get: MigSampleGet,
    metrics_get: MetricsGetFn,
    sample_free: SampleFree,
    /// `[previous, next]`.
    samples: [Sample; 2],
    /// CLOCK_MONOTONIC ns of the previous sample; 0: none yet.
    prev_ns: u64,
    request: Box<MetricsGet>,
}

// SAFETY: NVML handles and GPM samples are opaque and usable from any
// thread (NVML is thread-safe); one thread at a time owns the sampler.
unsafe impl Send for InstanceSampler {}

impl InstanceSampler {
    /// The GPU instance of MIG device `mig_uuid` (`MIG-…`), sampled on its
    /// parent; an error when the GPU has no GPM (before Hopper).
    pub fn open(mig_uuid: &str) -> Result<InstanceSampler, String> {
        nvml_init()?;
        let by_uuid: unsafe extern "C" fn(*const c_char, *mut Device) -> i32 =
            nvml_fn("nvmlDeviceGetHandleByUUID")?;
        let gi_of: unsafe extern "C" fn(Device, *mut u32) -> i32 =
            nvml_fn("nvmlDeviceGetGpuInstanceId")?;
        let parent_of: unsafe extern "C" fn(Device, *mut Device) -> i32 =
            nvml_fn("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")?;
        let support: unsafe extern "C" fn(Device, *mut Support) -> i32 =
            nvml_fn("nvmlGpmQueryDeviceSupport")?;
        let alloc: unsafe extern "C" fn(*mut Sample) -> i32 = nvml_fn("nvmlGpmSampleAlloc")?;
        let id = CString::new(mig_uuid).map_err(|_| format!("MIG uuid {mig_uuid:?}"))?;
        let (mut mig, mut parent, mut gi): (Device, Device, u32) =
            (std::ptr::null_mut(), std::ptr::null_mut(), 0);
        let mut s = Support {
            version: GPM_SUPPORT_VERSION,
            is_supported_device: 0,
        };
        // SAFETY: the real NVML's functions of these C signatures, resolved by name; every
        // pointer is our live local (`id` NUL-terminated).
        unsafe {
            let r = by_uuid(id.as_ptr(), &mut mig);
            if r != NVML_SUCCESS {
                return Err(format!(
                    "no MIG device {mig_uuid} (nvmlDeviceGetHandleByUUID: {r})"
                ));
            }
            let r = gi_of(mig, &mut gi);
            if r != NVML_SUCCESS {
                return Err(format!(
                    "{mig_uuid}: nvmlDeviceGetGpuInstanceId returned {r}"
                ));
            }
            let r = parent_of(mig, &mut parent);
            if r != NVML_SUCCESS {
                return Err(format!("{mig_uuid}: no parent GPU ({r})"));
            }
            let r = support(parent, &mut s);
            if r != NVML_SUCCESS || s.is_supported_device == 0 {
                return Err(format!(
                    "{mig_uuid}: its GPU has no GPM (nvmlGpmQueryDeviceSupport: {r}, supported {}), \
                     so nothing measures the instance's use: the compute quota runs on estimates",
                    s.is_supported_device
                ));
            }
        }
        let mut samples = [std::ptr::null_mut(); 2];
        for s in &mut samples {
            // SAFETY: as above; `s` is our local out-pointer.
            let r = unsafe { alloc(s) };
            if r != NVML_SUCCESS {
                return Err(format!("nvmlGpmSampleAlloc returned {r}"));
            }
        }
        Ok(InstanceSampler {
            parent,
            gpu_instance: gi,
            sample_get: nvml_fn("nvmlGpmMigSampleGet")?,
            metrics_get: nvml_fn("nvmlGpmMetricsGet")?,
            sample_free: nvml_fn("nvmlGpmSampleFree")?,
            samples,
            prev_ns: 0,
            request: Box::new(MetricsGet {
                version: GPM_METRICS_GET_VERSION,
                num_metrics: 1,
                sample1: std::ptr::null_mut(),
                sample2: std::ptr::null_mut(),
                metrics: [Metric {
                    metric_id: 0,
                    nvml_return: 0,
                    value: 0.0,
                    info: MetricInfo {
                        short_name: std::ptr::null_mut(),
                        long_name: std::ptr::null_mut(),
                        unit: std::ptr::null_mut(),
                    },
                }; GPM_METRIC_MAX],
            }),
        })
    }

    /// The period since the previous sample, once it is a controller
    /// period long (the instance's SM use, as the container's own).
    pub fn poll(&mut self, now_ns: u64) -> Option<Reported> {
        if self.prev_ns != 0 && now_ns.saturating_sub(self.prev_ns) < DEFAULT_PERIOD_NS {
            return None;
        }
        // SAFETY: the real nvmlGpmMigSampleGet; `parent` is a live handle and the sample
        // one we allocated.
        let r = unsafe { (self.sample_get)(self.parent, self.gpu_instance, self.samples[1]) };
        if r != NVML_SUCCESS {
            crate::log::log!(Debug, "nvmlGpmMigSampleGet(gi {}): {r}", self.gpu_instance);
            return None;
        }
        let first = self.prev_ns == 0;
        let len_ns = now_ns.saturating_sub(self.prev_ns);
        self.prev_ns = now_ns;
        if first {
            self.samples.swap(0, 1);
            return None;
        }
        let m = &mut *self.request;
        m.sample1 = self.samples[0];
        m.sample2 = self.samples[1];
        m.metrics[0].metric_id = GPM_METRIC_SM_UTIL;
        // SAFETY: the real nvmlGpmMetricsGet on our boxed request (full layout, one metric
        // asked) naming two samples we allocated and filled.
        let r = unsafe { (self.metrics_get)(m) };
        self.samples.swap(0, 1);
        if r != NVML_SUCCESS || m.metrics[0].nvml_return != NVML_SUCCESS {
            let metric = m.metrics[0].nvml_return;
            crate::log::log!(Debug, "nvmlGpmMetricsGet: {r}, SM_UTIL: {metric}");
            return None;
        }
        Some(Reported {
            end_ns: now_ns,
            len_ns,
            own: m.metrics[0].value.clamp(0.0, 100.0),
            others: 0.0,
            eclipsed: false,
            device: None,
        })
    }
}

impl Drop for InstanceSampler {
    fn drop(&mut self) {
        for s in self.samples {
            // SAFETY: samples we allocated and free once.
            unsafe { (self.sample_free)(s) };
        }
    }
}
