//! Stream capture modes (issue 20): the simulated driver enforces them as
//! NVIDIA's does (`crates/sim/gpu-sim-cuda/src/capture_mode.rs`), and the
//! interposer's own driver calls (launch wrappers, pool bookkeeping, the
//! watcher's tick, graph accounting) never invalidate a GLOBAL-mode capture
//! of the application, on its own thread or another (tests/c/shim_capture.c).
//!
//! Needs `cargo build --workspace` first.

use simnode::{Container, ShimNode};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use stepped::Stepped;
use test_support::kv;
use test_support::shim::{simnode, stepped};
use test_support::{target_dir, workspace_root};

/// The bucket's `requested` word in the ledger's compute area
/// (cuda-shim/src/throttle/bucket.rs): cost units every launch asked for.
const REQUESTED_WORD: usize = 8;
const UNSUPPORTED: &str = "900";
const INVALIDATED: &str = "901";
const WRONG_THREAD: &str = "908";

fn node() -> (ShimNode, PathBuf) {
    ShimNode::sample(&workspace_root(), &target_dir(), "shim_capture.c")
}

/// One capture-mode case of `shim_capture rules`: the prohibited call's
/// result, the captured launch after it, the end of the capture, and
/// whether a graph came back.
fn case(k: &HashMap<String, String>, name: &str, text: &str) -> (String, String, String, bool) {
    let get = |s: &str| {
        k.get(&format!("{name}_{s}"))
            .unwrap_or_else(|| panic!("no {name}_{s} in:\n{text}"))
            .clone()
    };
    (get("call"), get("after"), get("end"), get("graph") == "1")
}

fn rules(c: &Container, prog: &Path) {
    let out = c.command(prog).arg("rules").output().unwrap();
    let text = format!(
        "{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "shim_capture rules failed:\n{text}");
    let k = kv(&text);
    let ok = ("0".to_string(), "0".to_string(), "0".to_string(), true);
    let refused = (
        UNSUPPORTED.to_string(),
        INVALIDATED.to_string(),
        INVALIDATED.to_string(),
        false,
    );
    // GLOBAL: another thread in GLOBAL mode may not make unsafe calls
    // (cudaMalloc is the documentation's example; cudaEventQuery is what
    // PyTorch's NCCL watchdog tripped over; pool attributes per CCCL).
    for name in [
        "global_other_alloc",
        "global_other_event_query",
        "global_other_pool_attr",
    ] {
        assert_eq!(case(&k, name, &text), refused, "{name}:\n{text}");
    }
    // ... unless that thread is in THREAD_LOCAL or RELAXED mode.
    for name in [
        "global_other_threadlocal_alloc",
        "global_other_relaxed_alloc",
    ] {
        assert_eq!(case(&k, name, &text), ok, "{name}:\n{text}");
    }
    // THREAD_LOCAL captures restrict only their own thread.
    assert_eq!(case(&k, "threadlocal_other_alloc", &text), ok, "{text}");
    assert_eq!(case(&k, "threadlocal_own_alloc", &text), refused, "{text}");
    // RELAXED restricts nobody.
    assert_eq!(case(&k, "relaxed_own_alloc", &text), ok, "{text}");
    // Stream-ordered work on another stream is never unsafe.
    assert_eq!(case(&k, "global_other_outside_work", &text), ok, "{text}");
    // The legacy stream encompasses the capturing (blocking) stream.
    assert_eq!(
        case(&k, "global_own_legacy_launch", &text),
        refused,
        "{text}"
    );
    // A non-RELAXED capture ends on the thread that began it.
    assert_eq!(k["wrong_thread_end"], WRONG_THREAD, "{text}");
    assert_eq!(k["then_end"], "0", "{text}");
}

#[test]
fn the_sim_driver_enforces_capture_modes() {
    let (n, prog) = node();
    rules(&n.direct(), &prog);
}

#[test]
fn the_interposer_passes_capture_mode_rules_through() {
    let (n, prog) = node();
    rules(&n.container(50, true, 0), &prog);
}

/// A GLOBAL capture stays valid while the interposer throttles launches
/// into it and beside it, charges stream-ordered and synchronous
/// allocations of another thread, walks and charges that thread's graph
/// instantiations and replays, and its watcher ticks (NVML, pools); the
/// captured graph's replays are charged its kernels.
#[test]
fn a_global_capture_survives_the_interposer() {
    let (n, prog) = node();
    let c = n.container(50, true, 0);
    let m = c.manager.as_ref().unwrap();
    let requested = || m.ledger().compute_words()[REQUESTED_WORD].load(Ordering::Acquire);
    let mut r = Stepped::start(&c, &prog, &["shim"]);
    r.reach("ready");
    r.resume();
    r.reach("captured");
    let k = kv(&r.text);
    let num = |s: &str| -> u64 { k[s].parse().unwrap() };
    assert_eq!(k["end"], "0", "the capture was invalidated:\n{}", r.text);
    assert_eq!(num("outside_errors"), 0, "{}", r.text);
    assert!(num("outside_ops") >= 20, "{}", r.text);
    let captured = num("captured");
    assert!(captured >= 20, "{}", r.text);
    let r0 = requested();
    r.resume();
    r.reach("graph");
    let graphs = requested() - r0;
    r.resume();
    r.reach("direct");
    let one = requested() - r0 - graphs;
    assert!(one > 0, "a direct launch was not charged");
    assert_eq!(
        graphs,
        3 * captured * one,
        "3 replays of {captured} kernels charged {graphs}, one kernel {one}"
    );
    r.finish();
}
