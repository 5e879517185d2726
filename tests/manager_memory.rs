//! Memory requests below limits through the real `gpu-manager` and the
//! real interposer on a simulated 16 GiB GPU (docs/qos.md, "Memory"): a
//! pod annotated `tencent.com/vcuda-memory-limit: 12Gi` with a 4 GiB
//! `vcuda-memory` borrows up to 12 GiB while nothing else is guaranteed;
//! a guaranteed 8 GiB pod then allocates, the borrower's process is ended
//! with a message saying why (its stderr, an Event on its pod, a metric),
//! and the guaranteed allocation succeeds. Needs `cargo build --workspace`.

use std::process::Command;
use std::time::{Duration, Instant};

use test_support::manager::{Env, Options, VCORE, container_env};
use test_support::process::{field, hold, release};
use vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_is_reclaimed_for_a_guaranteed_share_and_nothing_else_is_touched() {
    let opts = Options {
        extra_args: vec![
            "--interposer".into(),
            test_support::target_dir().join("libvcuda.so").into(),
        ],
        ..Options::default()
    };
    let mut env = Env::start("sim-1gpu-16gb", opts).await;
    // A limit below the guarantee, or on a whole GPU, is refused by name.
    let low = env.pod(
        &[("main", 30, 16)],
        &[("tencent.com/vcuda-memory-limit", "1Gi")],
    );
    let e = env
        .admit(&low, "main", 30, 16)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tencent.com/vcuda-memory-limit") && e.contains("below"),
        "{e}"
    );

    let burst = env.pod(
        &[("main", 30, 16)],
        &[("tencent.com/vcuda-memory-limit", "12Gi")],
    );
    let rb = env.admit(&burst, "main", 30, 16).await.unwrap()[VCORE].clone();
    let guaranteed = env.pod(&[("main", 30, 32)], &[]);
    let small = env.pod(&[("main", 10, 4)], &[]);
    let rs = env.admit(&small, "main", 10, 4).await.unwrap()[VCORE].clone();

    let tmp = tempfile::tempdir().unwrap();
    let exe = test_support::compile_c("hold_memory", &env.sim, tmp.path());
    let sim_root = env.sim_root().to_path_buf();
    let in_container = |r: &ContainerAllocateResponse| {
        let mut c = Command::new(&exe);
        c.envs(container_env(r))
            .env("GPU_SIM_ROOT", &sim_root)
            .env_remove("LOGGER_LEVEL");
        c
    };

    // Alone beside a 1 GiB guarantee: the borrower sees its limit as the
    // card, and free what it may still take (limit - what it holds).
    let (probe, line) = hold(&mut in_container(&rb), 1024);
    assert_eq!(field(&line, "total_mib"), 12288, "{line}");
    let free = field(&line, "free_mib");
    assert!(
        (10_500..=11_264).contains(&free),
        "limit - 1 GiB - its context: {line}"
    );
    release(probe);

    // It fills to its limit (11 GiB + its context), 3 times its guarantee.
    let (borrower, line) = hold(&mut in_container(&rb), 11 * 1024);
    assert!(
        line.starts_with("pid="),
        "borrowing 7+ GiB above its quota: {line}"
    );
    let (bystander, _) = hold(&mut in_container(&rs), 512);
    // The display shows what is lent on the GPU and what the borrower
    // holds above its guarantee (11 GiB and its context, minus 4).
    let http = env.logged_http_addr().expect("display address");
    let metric = |body: &str, name: &str, pod: Option<&str>| -> f64 {
        body.lines()
            .find(|l| {
                l.starts_with(name) && pod.is_none_or(|p| l.contains(&format!("pod=\"{p}\"")))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{body}"))
    };
    let (_, body) =
        tokio::task::block_in_place(|| test_support::process::http_get(http, "/metrics"));
    let lent = metric(&body, "vcuda_gpu_memory_lent_bytes", None);
    assert!(lent >= (7u64 << 30) as f64, "lent {lent}");
    let borrowed = metric(
        &body,
        "vcuda_container_memory_borrowed_bytes",
        Some(&burst.name),
    );
    assert_eq!(borrowed, lent, "the one borrower holds all that is lent");

    // Past its limit it is refused, as any quota (here already its new
    // context's memory).
    let (mut over, line) = hold(&mut in_container(&rb), 1024);
    assert!(
        line.starts_with("FAIL cu") && line.contains("OUT_OF_MEMORY"),
        "{line}"
    );
    over.wait().unwrap();

    // The guaranteed 8 GiB share comes and allocates 7 GiB (+ context):
    // only the borrower's lent memory can make room.
    let rg = env.admit(&guaranteed, "main", 30, 32).await.unwrap()[VCORE].clone();
    let t = Instant::now();
    let (g, line) = tokio::task::block_in_place(|| hold(&mut in_container(&rg), 7 * 1024));
    let took = t.elapsed();
    assert!(
        line.starts_with("pid="),
        "the guaranteed allocation: {line}"
    );
    eprintln!(
        "guaranteed 7 GiB: cuMemAlloc with one reclaim {} us, the process's start to its line {took:?}",
        field(&line, "alloc_us")
    );
    assert!(took < Duration::from_secs(10), "reclaim bounded: {took:?}");

    // The borrower was ended, by SIGKILL, saying why on its stderr.
    let mut borrower = borrower;
    let status = borrower.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let err = std::io::read_to_string(borrower.stderr.take().unwrap()).unwrap();
    assert!(
        err.contains("vcuda: process") && err.contains("was ended to reclaim GPU memory"),
        "{err}"
    );
    // An Event on its pod names the reason and the share that needed it.
    let ev = env
        .wait_event("VcudaMemoryReclaimed", &burst.name, Duration::from_secs(10))
        .await;
    let note = ev["note"].as_str().unwrap();
    assert!(note.contains(&guaranteed.name), "{note}");
    // Nothing else was touched: the bystander and the guaranteed share
    // hold what they allocated.
    release(bystander);
    release(g);
    // The metric counts the reclaim.
    let http = env.logged_http_addr().expect("display address");
    let (_, body) =
        tokio::task::block_in_place(|| test_support::process::http_get(http, "/metrics"));
    let reclaims = body
        .lines()
        .find(|l| l.starts_with("vcuda_container_memory_reclaims_total") && l.contains(&burst.name))
        .unwrap_or_else(|| panic!("no reclaim series in\n{body}"));
    assert!(reclaims.ends_with(" 1"), "{reclaims}");
}
