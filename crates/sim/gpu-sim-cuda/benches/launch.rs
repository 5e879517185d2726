//! Cost of `cuLaunchKernel` in the simulated driver, uncontended, called
//! through dlopen/dlsym as a client (or the interposer) calls it. Prints
//! ns per launch and the ratio to a baseline measured in the same run: one
//! `clock_gettime(CLOCK_MONOTONIC)` (vDSO), the one clock read a launch makes.
//!
//! `cargo bench -p gpu-sim-cuda --bench launch` (the cdylib is built with it).

use gpu_sim_core::{NodeSpec, SharedState, SimRoot};
use std::ffi::c_void;
use std::hint::black_box;
use std::time::Instant;

type Launch = unsafe extern "C" fn(
    *mut c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> i32;

const NODE: &str = r#"
name = "bench"
driver_version = "580.95.05"
cuda_version = "13.0"

[[gpu]]
name = "NVIDIA A100-SXM4-40GB"
uuid = "GPU-00000000-0000-0000-0000-0000000000b1"
memory_mib = 40960
sm_count = 108
pci_bus_id = "00000000:07:00.0"
minor = 0
"#;

fn check(r: i32, what: &str) {
    assert_eq!(r, 0, "{what} failed: CUresult {r}");
}

/// Median of `rounds` timings of `n` calls, in ns per call.
fn measure(rounds: usize, n: u64, mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..n {
                f();
            }
            t.elapsed().as_nanos() as f64 / n as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // A root with the node's state and device node; found through GPU_SIM_ROOT.
    let dir = tempfile::tempdir().unwrap();
    let root = SimRoot::new(dir.path());
    SharedState::install(&root, &NodeSpec::parse(NODE, "bench").unwrap()).unwrap();
    std::fs::create_dir_all(root.dev_dir()).unwrap();
    std::fs::write(root.device_node(0), b"").unwrap();
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("GPU_SIM_ROOT", dir.path()) };

    // The exports, called directly (the rlib of the same code as the cdylib).
    // SAFETY: the driver's exports with the argument types of their C declarations; every pointer is a local or a handle this driver returned.
    unsafe {
        let init = cuda::cuInit;
        let ctx_create = cuda::ctx::cuCtxCreate_v2;
        let load = cuda::module::cuModuleLoadData;
        let get_fn = cuda::module::cuModuleGetFunction;
        // Through a pointer the optimiser cannot see through, as after dlsym.
        let launch: Launch = black_box(cuda::launch::cuLaunchKernel);
        check(init(0), "cuInit");
        let mut ctx = std::ptr::null_mut();
        check(ctx_create(&mut ctx, 0, 0), "cuCtxCreate");
        let mut module = std::ptr::null_mut();
        check(
            load(&mut module, c"image".as_ptr().cast()),
            "cuModuleLoadData",
        );
        let mut f = std::ptr::null_mut();
        check(get_fn(&mut f, module, c"k".as_ptr()), "cuModuleGetFunction");

        let n = 200_000;
        let null: *mut c_void = std::ptr::null_mut();
        let launch_ns = measure(15, n, || {
            let r = launch(
                black_box(f),
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                null,
                null.cast(),
                null.cast(),
            );
            debug_assert_eq!(r, 0);
            black_box(r);
        });
        let clock_ns = measure(15, n, || {
            black_box(gpu_sim_core::state::now_ns());
        });
        println!("cuLaunchKernel (uncontended): {launch_ns:.1} ns/launch");
        println!("baseline clock_gettime(CLOCK_MONOTONIC): {clock_ns:.1} ns/call");
        println!("ratio launch/baseline: {:.2}", launch_ns / clock_ns);
        println!(
            "target < 1000 ns/launch: {}",
            if launch_ns < 1000.0 { "met" } else { "MISSED" }
        );
    }
}
