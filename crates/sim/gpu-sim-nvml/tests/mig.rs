//! The simulated NVML's MIG API through its C ABI, as a C client sees it:
//! the built `libnvidia_ml.so` copied into a root installed from
//! `config/nodes/sim-mig-h100.toml` and dlopened by path (it finds its
//! root from its own file). The structs here are written from nvml.h
//! independently of the library's, so a layout mistake shows.
//!
//! Needs `cargo build -p gpu-sim-nvml` first: `cargo test` does not
//! rebuild the cdylib (the test refuses one older than the sources).
//!
//! Walks: enable MIG, profiles, placements, a 3g.40gb and a 1g.10gb with
//! compute instances, overlaps refused, MIG device handles (UUID, name,
//! memory, attributes), destroy, disable.

#[macro_use]
mod common;

use common::*;
use gpu_sim_core::{SharedState, SimRoot};
use std::ffi::{CStr, CString, c_char, c_uint, c_void};

type Gi = *mut c_void;
type Ci = *mut c_void;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Placement {
    start: c_uint,
    size: c_uint,
}

#[repr(C)]
struct GiProfileInfoV2 {
    version: c_uint,
    id: c_uint,
    is_p2p: c_uint,
    slice_count: c_uint,
    instance_count: c_uint,
    sm_count: c_uint,
    ce: c_uint,
    dec: c_uint,
    enc: c_uint,
    jpeg: c_uint,
    ofa: c_uint,
    memory_mb: u64,
    name: [c_char; 96],
}

#[repr(C)]
struct GiInfo {
    device: Dev,
    id: c_uint,
    profile_id: c_uint,
    placement: Placement,
}

#[repr(C)]
struct CiProfileInfoV2 {
    version: c_uint,
    id: c_uint,
    slice_count: c_uint,
    instance_count: c_uint,
    sm_count: c_uint,
    shared: [c_uint; 5],
    name: [c_char; 96],
}

#[repr(C)]
struct CiInfo {
    device: Dev,
    gpu_instance: Gi,
    id: c_uint,
    profile_id: c_uint,
    placement: Placement,
}

#[repr(C)]
#[derive(Default)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Default)]
struct Attributes {
    sm_count: c_uint,
    shared: [c_uint; 5],
    gi_slices: c_uint,
    ci_slices: c_uint,
    memory_mb: u64,
}

fn cstr(buf: &[c_char]) -> String {
    // SAFETY: the library NUL-terminates what it writes; the buffer is zeroed.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn uuid_of(n: &Nvml, d: Dev) -> (Ret, String) {
    let mut buf = [0 as c_char; 96];
    let r = call!(
        n,
        "nvmlDeviceGetUUID",
        (Dev, *mut c_char, c_uint),
        d,
        buf.as_mut_ptr(),
        96
    );
    (r, cstr(&buf))
}

fn mig_mode(n: &Nvml, d: Dev) -> (c_uint, c_uint) {
    let (mut cur, mut pend) = (9, 9);
    let r = call!(
        n,
        "nvmlDeviceGetMigMode",
        (Dev, *mut c_uint, *mut c_uint),
        d,
        &mut cur,
        &mut pend
    );
    assert_eq!(r, SUCCESS);
    (cur, pend)
}

fn set_mig(n: &Nvml, d: Dev, mode: c_uint) -> Ret {
    let mut status = -1;
    let r = call!(
        n,
        "nvmlDeviceSetMigMode",
        (Dev, c_uint, *mut Ret),
        d,
        mode,
        &mut status
    );
    assert_eq!(r, SUCCESS);
    status
}

fn create_gi(n: &Nvml, d: Dev, profile_id: c_uint, at: Option<Placement>) -> (Ret, Gi) {
    let mut gi: Gi = std::ptr::null_mut();
    let r = match at {
        None => call!(
            n,
            "nvmlDeviceCreateGpuInstance",
            (Dev, c_uint, *mut Gi),
            d,
            profile_id,
            &mut gi
        ),
        Some(p) => call!(
            n,
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            (Dev, c_uint, *const Placement, *mut Gi),
            d,
            profile_id,
            &p,
            &mut gi
        ),
    };
    (r, gi)
}

fn gi_info(n: &Nvml, gi: Gi) -> GiInfo {
    // SAFETY: GiInfo is pointers and integers: all-zero is valid.
    let mut info: GiInfo = unsafe { std::mem::zeroed() };
    assert_eq!(
        call!(
            n,
            "nvmlGpuInstanceGetInfo",
            (Gi, *mut GiInfo),
            gi,
            &mut info
        ),
        SUCCESS
    );
    info
}

fn create_ci(n: &Nvml, gi: Gi, profile: c_uint) -> (Ret, Ci) {
    let mut ci: Ci = std::ptr::null_mut();
    let r = call!(
        n,
        "nvmlGpuInstanceCreateComputeInstance",
        (Gi, c_uint, *mut Ci),
        gi,
        profile,
        &mut ci
    );
    (r, ci)
}

fn remaining(n: &Nvml, d: Dev, profile_id: c_uint) -> c_uint {
    let mut count = 99;
    let r = call!(
        n,
        "nvmlDeviceGetGpuInstanceRemainingCapacity",
        (Dev, c_uint, *mut c_uint),
        d,
        profile_id,
        &mut count
    );
    assert_eq!(r, SUCCESS);
    count
}

/// Profile ids as the driver reports them (nvidia-smi mig -lgip).
const P_1G_10GB: c_uint = 19;
const P_3G_40GB: c_uint = 9;
const P_4G_40GB: c_uint = 5;

#[test]
fn mig_walk_through_the_c_abi() {
    let (dir, lib) = install("sim-mig-h100");
    let n = Nvml::open(&lib);
    assert_eq!(call!(n, "nvmlInit_v2", ()), SUCCESS);
    let mut gpu: Dev = std::ptr::null_mut();
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetHandleByIndex_v2",
            (c_uint, *mut Dev),
            0,
            &mut gpu
        ),
        SUCCESS
    );

    // Disabled: no instances, no MIG devices.
    assert_eq!(mig_mode(&n, gpu), (0, 0));
    assert_eq!(create_gi(&n, gpu, P_1G_10GB, None).0, NOT_SUPPORTED);
    let mut max = 99;
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetMaxMigDeviceCount",
            (Dev, *mut c_uint),
            gpu,
            &mut max
        ),
        SUCCESS
    );
    assert_eq!(max, 0);
    assert_eq!(set_mig(&n, gpu, 1), SUCCESS, "idle: applied at once");
    assert_eq!(mig_mode(&n, gpu), (1, 1));

    profiles(&n, gpu);
    placements(&n, gpu);

    // A 3g.40gb at 4 and a 1g.10gb in the first free slice.
    let (r, g3) = create_gi(&n, gpu, P_3G_40GB, Some(Placement { start: 4, size: 4 }));
    assert_eq!(r, SUCCESS);
    let i3 = gi_info(&n, g3);
    assert_eq!(
        (i3.id, i3.profile_id, i3.placement),
        (1, 9, Placement { start: 4, size: 4 })
    );
    assert_eq!(i3.device, gpu);
    let (r, g1) = create_gi(&n, gpu, P_1G_10GB, None);
    assert_eq!(r, SUCCESS);
    assert_eq!(gi_info(&n, g1).placement, Placement { start: 0, size: 1 });
    // Overlaps refused.
    let at5 = Some(Placement { start: 5, size: 1 });
    assert_eq!(create_gi(&n, gpu, P_1G_10GB, at5).0, INSUFFICIENT_RESOURCES);
    assert_eq!(
        create_gi(&n, gpu, P_4G_40GB, None).0,
        INSUFFICIENT_RESOURCES
    );
    let bad = Some(Placement { start: 2, size: 4 });
    assert_eq!(create_gi(&n, gpu, P_3G_40GB, bad).0, INVALID_ARGUMENT);
    assert_eq!(remaining(&n, gpu, P_4G_40GB), 0);
    assert_eq!(remaining(&n, gpu, P_1G_10GB), 3);
    // Another process sees them in the shared state.
    let other = SharedState::open(&SimRoot::new(dir.path())).unwrap();
    let ids: Vec<u32> = other.gpu_instances(0).iter().map(|g| g.id).collect();
    assert_eq!(ids, [1, 7]);

    let (c3, _c1) = compute_instances(&n, g3, g1);
    mig_devices(&n, gpu);

    // Destroying a GI with a CI, or disabling MIG with GIs, is refused.
    assert_eq!(call!(n, "nvmlGpuInstanceDestroy", (Gi,), g3), IN_USE);
    assert_eq!(set_mig(&n, gpu, 0), IN_USE);
    assert_eq!(mig_mode(&n, gpu), (1, 0), "pending disable");
    assert_eq!(call!(n, "nvmlComputeInstanceDestroy", (Ci,), c3), SUCCESS);
    assert_eq!(
        call!(n, "nvmlComputeInstanceDestroy", (Ci,), c3),
        INVALID_ARGUMENT
    );
    assert_eq!(call!(n, "nvmlGpuInstanceDestroy", (Gi,), g3), SUCCESS);
    assert_eq!(
        call!(n, "nvmlGpuInstanceDestroy", (Gi,), g3),
        INVALID_ARGUMENT
    );
    let mut got: Gi = std::ptr::null_mut();
    let r = call!(
        n,
        "nvmlDeviceGetGpuInstanceById",
        (Dev, c_uint, *mut Gi),
        gpu,
        1,
        &mut got
    );
    assert_eq!(r, NOT_FOUND);
    let r = call!(
        n,
        "nvmlDeviceGetGpuInstanceById",
        (Dev, c_uint, *mut Gi),
        gpu,
        7,
        &mut got
    );
    assert_eq!((r, got), (SUCCESS, g1));
    assert_eq!(remaining(&n, gpu, P_3G_40GB), 1, "the 1g at 0 blocks 0:4");
    assert_eq!(call!(n, "nvmlShutdown", ()), SUCCESS);
}

fn profiles(n: &Nvml, gpu: Dev) {
    const V2: c_uint = 0x98 | (2 << 24);
    // SAFETY: integers and a char array: all-zero is valid.
    let mut info: GiProfileInfoV2 = unsafe { std::mem::zeroed() };
    info.version = V2;
    let f = |p: c_uint, i: &mut GiProfileInfoV2| {
        call!(
            n,
            "nvmlDeviceGetGpuInstanceProfileInfoV",
            (Dev, c_uint, *mut GiProfileInfoV2),
            gpu,
            p,
            i
        )
    };
    assert_eq!(
        f(0, &mut info),
        SUCCESS,
        "NVML_GPU_INSTANCE_PROFILE_1_SLICE"
    );
    assert_eq!(cstr(&info.name), "MIG 1g.10gb");
    assert_eq!(
        (
            info.id,
            info.slice_count,
            info.instance_count,
            info.sm_count,
            info.memory_mb
        ),
        (19, 1, 7, 16, 9984)
    );
    assert_eq!(
        f(2, &mut info),
        SUCCESS,
        "NVML_GPU_INSTANCE_PROFILE_3_SLICE"
    );
    assert_eq!(
        (info.id, info.sm_count, info.memory_mb, info.ce),
        (9, 60, 40448, 3)
    );
    assert_eq!(f(5, &mut info), NOT_SUPPORTED, "no 8-slice profile on H100");
    assert_eq!(
        f(0x12, &mut info),
        INVALID_ARGUMENT,
        "past NVML_GPU_INSTANCE_PROFILE_COUNT"
    );
    info.version = 0x98 | (1 << 24);
    assert_eq!(f(0, &mut info), VERSION_MISMATCH);
}

fn placements(n: &Nvml, gpu: Dev) {
    let mut count: c_uint = 0;
    let mut out = [Placement::default(); 8];
    let f = |p: c_uint, out: *mut Placement, count: &mut c_uint| {
        call!(
            n,
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
            (Dev, c_uint, *mut Placement, *mut c_uint),
            gpu,
            p,
            out,
            count
        )
    };
    assert_eq!(f(P_3G_40GB, std::ptr::null_mut(), &mut count), SUCCESS);
    assert_eq!(count, 2);
    assert_eq!(f(P_3G_40GB, out.as_mut_ptr(), &mut count), SUCCESS);
    assert_eq!(
        out[..2],
        [
            Placement { start: 0, size: 4 },
            Placement { start: 4, size: 4 }
        ]
    );
    assert_eq!(f(P_1G_10GB, out.as_mut_ptr(), &mut count), SUCCESS);
    assert_eq!(count, 7);
    assert_eq!(out[6], Placement { start: 6, size: 1 });
}

/// A 3c in the 3g and a 1c in the 1g; returns their handles.
fn compute_instances(n: &Nvml, g3: Gi, g1: Gi) -> (Ci, Ci) {
    // SAFETY: integers and a char array: all-zero is valid.
    let mut info: CiProfileInfoV2 = unsafe { std::mem::zeroed() };
    info.version = 0x88 | (2 << 24);
    let r = call!(
        n,
        "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        (Gi, c_uint, c_uint, *mut CiProfileInfoV2),
        g3,
        2,
        0,
        &mut info
    );
    assert_eq!(r, SUCCESS, "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE in a 3g");
    assert_eq!(
        (
            info.id,
            info.slice_count,
            info.instance_count,
            info.sm_count
        ),
        (2, 3, 1, 60)
    );
    assert_eq!(cstr(&info.name), "MIG 3g.40gb");
    let (r, c3) = create_ci(n, g3, 2);
    assert_eq!(r, SUCCESS);
    assert_eq!(
        create_ci(n, g3, 0).0,
        INSUFFICIENT_RESOURCES,
        "the 3c fills the 3g"
    );
    assert_eq!(create_ci(n, g3, 3).0, NOT_SUPPORTED, "no 4c in a 3g");
    // SAFETY: pointers and integers: all-zero is valid.
    let mut ci: CiInfo = unsafe { std::mem::zeroed() };
    assert_eq!(
        call!(
            n,
            "nvmlComputeInstanceGetInfo_v2",
            (Ci, *mut CiInfo),
            c3,
            &mut ci
        ),
        SUCCESS
    );
    assert_eq!(
        (ci.id, ci.profile_id, ci.placement),
        (0, 2, Placement { start: 0, size: 3 })
    );
    assert_eq!(ci.gpu_instance, g3);
    let (r, c1) = create_ci(n, g1, 0);
    assert_eq!(r, SUCCESS);
    let mut list = [std::ptr::null_mut(); 7];
    let mut count = 0;
    let r = call!(
        n,
        "nvmlGpuInstanceGetComputeInstances",
        (Gi, c_uint, *mut Ci, *mut c_uint),
        g1,
        0,
        list.as_mut_ptr(),
        &mut count
    );
    assert_eq!((r, count, list[0]), (SUCCESS, 1, c1));
    (c3, c1)
}

fn mig_devices(n: &Nvml, gpu: Dev) {
    let mut max = 0;
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetMaxMigDeviceCount",
            (Dev, *mut c_uint),
            gpu,
            &mut max
        ),
        SUCCESS
    );
    assert_eq!(max, 7);
    let by_index = |i: c_uint, out: &mut Dev| {
        call!(
            n,
            "nvmlDeviceGetMigDeviceHandleByIndex",
            (Dev, c_uint, *mut Dev),
            gpu,
            i,
            out
        )
    };
    let (mut m0, mut m1, mut none) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    assert_eq!(by_index(0, &mut m0), SUCCESS);
    assert_eq!(by_index(1, &mut m1), SUCCESS);
    assert_eq!(by_index(2, &mut none), NOT_FOUND);
    let is_mig = |d: Dev| {
        let mut v = 9;
        assert_eq!(
            call!(
                n,
                "nvmlDeviceIsMigDeviceHandle",
                (Dev, *mut c_uint),
                d,
                &mut v
            ),
            SUCCESS
        );
        v
    };
    assert_eq!((is_mig(m0), is_mig(gpu)), (1, 0));
    let mut parent: Dev = std::ptr::null_mut();
    let r = call!(
        n,
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        (Dev, *mut Dev),
        m0,
        &mut parent
    );
    assert_eq!((r, parent), (SUCCESS, gpu));
    let (mut gi, mut ci) = (99, 99);
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetGpuInstanceId",
            (Dev, *mut c_uint),
            m0,
            &mut gi
        ),
        SUCCESS
    );
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetComputeInstanceId",
            (Dev, *mut c_uint),
            m0,
            &mut ci
        ),
        SUCCESS
    );
    assert_eq!((gi, ci), (1, 0), "index 0: the lowest GPU-instance id");
    // UUIDs: MIG-<uuid>, stable, one per device, not the GPU's.
    let (r, u0) = uuid_of(n, m0);
    assert_eq!(r, SUCCESS);
    assert!(u0.starts_with("MIG-") && u0.len() == 40, "{u0}");
    assert_eq!(uuid_of(n, m0).1, u0);
    assert_ne!(uuid_of(n, m1).1, u0);
    let c = CString::new(u0.clone()).unwrap();
    let mut by_uuid: Dev = std::ptr::null_mut();
    let r = call!(
        n,
        "nvmlDeviceGetHandleByUUID",
        (*const c_char, *mut Dev),
        c.as_ptr(),
        &mut by_uuid
    );
    assert_eq!(
        (r, by_uuid),
        (SUCCESS, m0),
        "a MIG UUID names its MIG device"
    );
    assert!(uuid_of(n, gpu).1.starts_with("GPU-"));
    let mut name = [0 as c_char; 96];
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetName",
            (Dev, *mut c_char, c_uint),
            m0,
            name.as_mut_ptr(),
            96
        ),
        SUCCESS
    );
    assert_eq!(cstr(&name), "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
    let mut mem = Memory::default();
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetMemoryInfo",
            (Dev, *mut Memory),
            m0,
            &mut mem
        ),
        SUCCESS
    );
    assert_eq!((mem.total, mem.free), (40448 << 20, 40448 << 20));
    let mut a = Attributes::default();
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetAttributes_v2",
            (Dev, *mut Attributes),
            m1,
            &mut a
        ),
        SUCCESS
    );
    assert_eq!(
        (a.sm_count, a.gi_slices, a.ci_slices, a.memory_mb),
        (16, 1, 1, 9984)
    );
    assert_eq!(
        call!(
            n,
            "nvmlDeviceGetAttributes_v2",
            (Dev, *mut Attributes),
            gpu,
            &mut a
        ),
        NOT_SUPPORTED
    );
}
