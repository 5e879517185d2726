//! The simulated NVML's GPM API through its C ABI, as a C client sees it:
//! the built `libnvidia_ml.so` copied into a root installed from a node
//! file and dlopened by path (as in `mig.rs`, whose note applies: `cargo
//! build -p gpu-sim-nvml` first). The structs are written from nvml.h
//! independently of the library's.
//!
//! Load comes from this test process itself through `gpu-sim-core`: bound
//! to one GPU instance, it queues kernels on that instance's timeline.

#[macro_use]
mod common;

use common::*;
use gpu_sim_core::{SharedState, SimRoot};
use std::ffi::{CStr, c_char, c_uint, c_void};
use std::time::Duration;

type Sample = *mut c_void;

const GRAPHICS_UTIL: c_uint = 1;
const SM_UTIL: c_uint = 2;
const SM_OCCUPANCY: c_uint = 3;

#[repr(C)]
#[derive(Clone, Copy)]
struct Metric {
    id: c_uint,
    ret: Ret,
    value: f64,
    short_name: *const c_char,
    long_name: *const c_char,
    unit: *const c_char,
}

/// nvmlGpmMetricsGet_t, with CUDA 13 pynvml's longer array (477): the
/// version stayed 1 when the header grew it.
#[repr(C)]
struct MetricsGet {
    version: c_uint,
    num: c_uint,
    sample1: Sample,
    sample2: Sample,
    metrics: [Metric; 477],
}

#[repr(C)]
struct Support {
    version: c_uint,
    supported: c_uint,
}

fn gpu(n: &Nvml, i: c_uint) -> Dev {
    let mut d: Dev = std::ptr::null_mut();
    let r = call!(
        n,
        "nvmlDeviceGetHandleByIndex_v2",
        (c_uint, *mut Dev),
        i,
        &mut d
    );
    assert_eq!(r, SUCCESS);
    d
}

fn support(n: &Nvml, d: Dev, version: c_uint) -> (Ret, c_uint) {
    let mut s = Support {
        version,
        supported: 9,
    };
    let r = call!(
        n,
        "nvmlGpmQueryDeviceSupport",
        (Dev, *mut Support),
        d,
        &mut s
    );
    (r, s.supported)
}

fn alloc(n: &Nvml) -> Sample {
    let mut s: Sample = std::ptr::null_mut();
    assert_eq!(
        call!(n, "nvmlGpmSampleAlloc", (*mut Sample), &mut s),
        SUCCESS
    );
    assert!(!s.is_null());
    s
}

fn free(n: &Nvml, s: Sample) -> Ret {
    call!(n, "nvmlGpmSampleFree", (Sample), s)
}

fn sample(n: &Nvml, d: Dev, s: Sample) -> Ret {
    call!(n, "nvmlGpmSampleGet", (Dev, Sample), d, s)
}

fn mig_sample(n: &Nvml, d: Dev, gi: c_uint, s: Sample) -> Ret {
    call!(n, "nvmlGpmMigSampleGet", (Dev, c_uint, Sample), d, gi, s)
}

fn metrics_get(version: c_uint, s1: Sample, s2: Sample, ids: &[c_uint]) -> Box<MetricsGet> {
    // SAFETY: integers, a double and pointers: all-zero is valid.
    let mut m: Box<MetricsGet> = Box::new(unsafe { std::mem::zeroed() });
    m.version = version;
    m.num = ids.len() as c_uint;
    (m.sample1, m.sample2) = (s1, s2);
    for (e, &id) in m.metrics.iter_mut().zip(ids) {
        e.id = id;
        e.ret = -1;
        e.value = -1.0;
    }
    m
}

/// (status, [(metric status, value)]) for `ids` between two samples.
fn metrics(n: &Nvml, s1: Sample, s2: Sample, ids: &[c_uint]) -> (Ret, Vec<(Ret, f64)>) {
    let mut m = metrics_get(1, s1, s2, ids);
    let r = call!(n, "nvmlGpmMetricsGet", (*mut MetricsGet), &mut *m);
    let got = m.metrics[..ids.len()]
        .iter()
        .map(|e| (e.ret, e.value))
        .collect();
    (r, got)
}

fn sm_util(n: &Nvml, s1: Sample, s2: Sample) -> f64 {
    let (r, got) = metrics(n, s1, s2, &[SM_UTIL]);
    assert_eq!((r, got[0].0), (SUCCESS, SUCCESS));
    got[0].1
}

fn cstr(p: *const c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: the library's static NUL-terminated names.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Profile ids as the driver reports them (nvidia-smi mig -lgip).
const P_1G_10GB: u32 = 19;
const P_3G_40GB: u32 = 9;

#[test]
fn gpm_reads_each_gpu_instance_apart() {
    let (dir, lib) = install("sim-mig-h100");
    let n = Nvml::open(&lib);
    assert_eq!(call!(n, "nvmlInit_v2", ()), SUCCESS);
    let (gpu0, gpu1) = (gpu(&n, 0), gpu(&n, 1));
    assert_eq!(support(&n, gpu0, 1), (SUCCESS, 1), "H100: Hopper");
    assert_eq!(support(&n, gpu0, 2).0, VERSION_MISMATCH);
    let mut state = 9;
    let r = call!(
        n,
        "nvmlGpmQueryIfStreamingEnabled",
        (Dev, *mut c_uint),
        gpu0,
        &mut state
    );
    assert_eq!((r, state), (SUCCESS, 0));
    let r = call!(n, "nvmlGpmSetStreamingEnabled", (Dev, c_uint), gpu0, 1);
    assert_eq!(r, NOT_SUPPORTED);
    assert_eq!(free(&n, std::ptr::null_mut()), INVALID_ARGUMENT);
    let r = call!(n, "nvmlGpmSampleAlloc", (*mut Sample), std::ptr::null_mut());
    assert_eq!(r, INVALID_ARGUMENT);

    // Not in MIG mode: no instance samples.
    let s = alloc(&n);
    assert_eq!(mig_sample(&n, gpu0, 1, s), NOT_SUPPORTED);

    // MIG on GPU 0: a 1g and a 3g, one compute instance each.
    let st = SharedState::open(&SimRoot::new(dir.path())).unwrap();
    st.set_mig_mode(0, true).unwrap();
    let small = st.create_gpu_instance(0, P_1G_10GB, None).unwrap().id;
    let big = st.create_gpu_instance(0, P_3G_40GB, None).unwrap().id;
    st.create_compute_instance(0, small, 0, None).unwrap();
    st.create_compute_instance(0, big, 2, None).unwrap();
    let missing = (0..15).find(|&g| g != small && g != big).unwrap();
    assert_eq!(mig_sample(&n, gpu0, missing, s), NOT_FOUND);
    assert_eq!(mig_sample(&n, gpu1, big, s), NOT_SUPPORTED, "GPU 1: no MIG");
    let mut mig: Dev = std::ptr::null_mut();
    let r = call!(
        n,
        "nvmlDeviceGetMigDeviceHandleByIndex",
        (Dev, c_uint, *mut Dev),
        gpu0,
        0,
        &mut mig
    );
    assert_eq!(r, SUCCESS);
    let mut mig_gi = 99;
    let r = call!(
        n,
        "nvmlDeviceGetGpuInstanceId",
        (Dev, *mut c_uint),
        mig,
        &mut mig_gi
    );
    assert_eq!(
        (r, mig_gi),
        (SUCCESS, big),
        "MIG devices by GPU-instance id"
    );
    assert_eq!(
        support(&n, mig, 1).0,
        INVALID_ARGUMENT,
        "asked of the parent"
    );
    assert_eq!(mig_sample(&n, mig, big, s), INVALID_ARGUMENT);

    // This process, bound to the 3g, queues 400 ms of kernels from now.
    let me = st.attach().unwrap();
    assert!(st.bind_mig(me, 0, big, 0));
    st.launch(me, 0, 400_000_000, 0);
    let [b1, b2, s1, s2, w1, w2, m1, m2, g1, g2] = [(); 10].map(|_| alloc(&n));
    let take = |b, s, w, m, g| {
        assert_eq!(mig_sample(&n, gpu0, big, b), SUCCESS);
        assert_eq!(mig_sample(&n, gpu0, small, s), SUCCESS);
        assert_eq!(sample(&n, gpu0, w), SUCCESS);
        assert_eq!(sample(&n, mig, m), SUCCESS);
        assert_eq!(sample(&n, gpu1, g), SUCCESS);
    };
    take(b1, s1, w1, m1, g1);
    std::thread::sleep(Duration::from_millis(150));
    take(b2, s2, w2, m2, g2);

    let (r, got) = metrics(&n, b1, b2, &[SM_UTIL, GRAPHICS_UTIL, SM_OCCUPANCY]);
    assert_eq!(r, SUCCESS);
    assert_eq!(got[0], (SUCCESS, 100.0), "the busy 3g");
    assert_eq!(got[1], (SUCCESS, 100.0));
    assert_eq!(got[2], (NOT_SUPPORTED, 0.0));
    assert_eq!(sm_util(&n, s1, s2), 0.0, "the idle 1g");
    assert_eq!(sm_util(&n, m1, m2), 100.0, "the 3g's MIG device");
    assert_eq!(
        sm_util(&n, w1, w2),
        100.0,
        "the GPU: its instances together"
    );
    assert_eq!(sm_util(&n, g1, g2), 0.0, "the other GPU");
    let mut m = metrics_get(1, b1, b2, &[SM_UTIL]);
    assert_eq!(
        call!(n, "nvmlGpmMetricsGet", (*mut MetricsGet), &mut *m),
        SUCCESS
    );
    let e = m.metrics[0];
    let names = (cstr(e.short_name), cstr(e.long_name), cstr(e.unit));
    assert_eq!(names, ("smutil".into(), "SM_UTIL".into(), "%".into()));
    assert_eq!(m.metrics[1].ret, 0, "past numMetrics: untouched");

    // Refused: other sources, wrong order, an untaken or freed sample,
    // too many metrics, another version.
    assert_eq!(metrics(&n, b1, s2, &[SM_UTIL]).0, INVALID_ARGUMENT);
    assert_eq!(metrics(&n, w1, g2, &[SM_UTIL]).0, INVALID_ARGUMENT);
    assert_eq!(metrics(&n, b2, b1, &[SM_UTIL]).0, INVALID_ARGUMENT);
    let fresh = alloc(&n);
    assert_eq!(metrics(&n, b1, fresh, &[SM_UTIL]).0, INVALID_ARGUMENT);
    assert_eq!(
        metrics(&n, std::ptr::null_mut(), b2, &[SM_UTIL]).0,
        INVALID_ARGUMENT
    );
    let mut big_ask = metrics_get(1, b1, b2, &[SM_UTIL; 211]);
    let r = call!(n, "nvmlGpmMetricsGet", (*mut MetricsGet), &mut *big_ask);
    assert_eq!(r, INVALID_ARGUMENT, "more than NVML_GPM_METRIC_MAX (210)");
    let mut v2 = metrics_get(2, b1, b2, &[SM_UTIL]);
    let r = call!(n, "nvmlGpmMetricsGet", (*mut MetricsGet), &mut *v2);
    assert_eq!(r, VERSION_MISMATCH);
    for p in [b1, b2, s1, s2, w1, w2, m1, m2, g1, g2, fresh, s] {
        assert_eq!(free(&n, p), SUCCESS);
    }
    assert_eq!(free(&n, b1), INVALID_ARGUMENT, "freed twice");
    assert_eq!(metrics(&n, b1, b2, &[SM_UTIL]).0, INVALID_ARGUMENT);
    assert_eq!(call!(n, "nvmlShutdown", ()), SUCCESS);
}

#[test]
fn gpm_is_for_hopper_and_newer() {
    let (dir, lib) = install("sim-mig-a100");
    let n = Nvml::open(&lib);
    assert_eq!(call!(n, "nvmlInit_v2", ()), SUCCESS);
    let gpu0 = gpu(&n, 0);
    assert_eq!(support(&n, gpu0, 1), (SUCCESS, 0), "A100: Ampere");
    let st = SharedState::open(&SimRoot::new(dir.path())).unwrap();
    st.set_mig_mode(0, true).unwrap();
    let gi = st.create_gpu_instance(0, P_1G_10GB, None).unwrap().id;
    let s = alloc(&n);
    assert_eq!(sample(&n, gpu0, s), NOT_SUPPORTED);
    assert_eq!(mig_sample(&n, gpu0, gi, s), NOT_SUPPORTED);
    let mut state = 9;
    let r = call!(
        n,
        "nvmlGpmQueryIfStreamingEnabled",
        (Dev, *mut c_uint),
        gpu0,
        &mut state
    );
    assert_eq!(r, NOT_SUPPORTED);
    assert_eq!(free(&n, s), SUCCESS);
    assert_eq!(call!(n, "nvmlShutdown", ()), SUCCESS);
}
