//! CUDA graphs and stream capture on the simulated node, directly on the
//! sim's driver and under the interposer (tests/c/shim_graph.c): graphs
//! built node by node and captured from two streams run and occupy the
//! timeline for their kernels; graph memory is counted against the
//! container's quota at instantiation; captured launches are not charged
//! to the compute bucket, graph launches are charged their kernels.
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

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The bucket's `requested` word in the ledger's compute area
/// (cuda-shim/src/throttle/bucket.rs): cost units every launch asked for.
const REQUESTED_WORD: usize = 8;

fn node() -> (ShimNode, PathBuf) {
    ShimNode::sample(&workspace_root(), &target_dir(), "shim_graph.c")
}

/// Runs `shim_graph args` to the end; its key=value words.
fn run(c: &Container, prog: &Path, args: &[&str]) -> (HashMap<String, String>, String) {
    let out = c.command(prog).args(args).output().unwrap();
    let text = format!(
        "{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "shim_graph {args:?} failed:\n{text}");
    (kv(&text), text)
}

fn num(kv: &HashMap<String, String>, k: &str, text: &str) -> u64 {
    kv.get(k)
        .unwrap_or_else(|| panic!("no {k} in:\n{text}"))
        .parse()
        .unwrap_or_else(|_| panic!("{k} is not a number in:\n{text}"))
}

/// What both modes print whatever runs them.
fn check_graphs(c: &Container, prog: &Path, direct: bool) {
    let (e, t) = run(c, prog, &["explicit"]);
    assert_eq!(e["alloc_dptr_set"], "1", "{t}");
    assert_eq!(
        (num(&e, "nodes", &t), num(&e, "kernels", &t)),
        (7, 4),
        "{t}"
    );
    assert_eq!((num(&e, "allocs", &t), num(&e, "frees", &t)), (2, 1), "{t}");
    // Four 1 ms kernels on the simulated timeline, plus the host's delay
    // between recording the start event and launching (only bounded
    // loosely: the host's scheduling is not what this checks).
    let us = num(&e, "elapsed_us", &t);
    assert!(
        (4000..5_000_000).contains(&us),
        "explicit graph took {us} us:\n{t}"
    );
    if direct {
        assert_eq!(num(&e, "launch_took_bytes", &t), 96 * MIB, "{t}");
        assert_eq!(num(&e, "reserved", &t), 96 * MIB, "{t}");
        assert_eq!(num(&e, "used", &t), 96 * MIB, "{t}");
        assert_eq!(num(&e, "reserved_after_destroy", &t), 96 * MIB, "{t}");
        assert_eq!(num(&e, "used_after_destroy", &t), 0, "{t}");
        assert_eq!(num(&e, "reserved_after_trim", &t), 0, "{t}");
        assert_eq!(num(&e, "reserved_high", &t), 96 * MIB, "{t}");
    }

    let (g, t) = run(c, prog, &["capture"]);
    assert_eq!(num(&g, "forked_capturing", &t), 1, "{t}");
    assert_eq!(num(&g, "forked_capturing_after", &t), 0, "{t}");
    assert_eq!(
        (num(&g, "nodes", &t), num(&g, "kernels", &t)),
        (8, 6),
        "{t}"
    );
    assert_eq!((num(&g, "allocs", &t), num(&g, "frees", &t)), (1, 1), "{t}");
    assert_eq!(num(&g, "alloc_bytes", &t), 16 * MIB, "{t}");
    let us = num(&g, "elapsed_us", &t);
    assert!(
        (6000..5_000_000).contains(&us),
        "captured graph took {us} us:\n{t}"
    );
    if direct {
        assert_eq!(num(&g, "launch_took_bytes", &t), 16 * MIB, "{t}");
    }
}

#[test]
fn graphs_built_and_captured_run_on_the_sim_driver() {
    let (n, prog) = node();
    check_graphs(&n.direct(), &prog, true);
}

#[test]
fn graphs_built_and_captured_run_under_the_interposer() {
    let (n, prog) = node();
    let c = n.container(50, true, 0);
    check_graphs(&c, &prog, false);
}

/// Issue 12: graph memory was not counted; an exec could allocate past the
/// quota at its first launch.
#[test]
fn graph_memory_is_held_to_the_quota_from_instantiation_until_trim() {
    let (n, prog) = node();
    let c = n.container(50, true, 0); // 4 GiB
    let ledger = || c.manager.as_ref().unwrap().ledger();
    let mut r = Stepped::start(&c, &prog, &["mem", "1024", "3500", "2048"]);
    // The context's own memory is charged too: count from here.
    r.reach("ready");
    let (base, ledger_base) = (n.memory_used(), ledger().used());
    r.resume();
    r.reach("held");
    let k = kv(&r.text);
    assert_eq!(k["instantiate0"], "0", "{}", r.text);
    assert_eq!(
        k["instantiate1"], "2",
        "1 + 3.4 GiB > 4 GiB: OUT_OF_MEMORY\n{}",
        r.text
    );
    assert_eq!(k["instantiate2"], "0", "{}", r.text);
    assert_eq!(ledger().used() - ledger_base, 3 * GIB);
    assert_eq!(ledger().refused_allocations(), 1);
    assert_eq!(n.memory_used() - base, 3 * GIB, "the driver mapped both");
    r.resume();
    r.reach("destroyed");
    // The driver's graph pool keeps the memory until trimmed.
    assert_eq!(ledger().used() - ledger_base, 3 * GIB);
    assert_eq!(n.memory_used() - base, 3 * GIB);
    r.resume();
    r.reach("trimmed");
    assert_eq!(ledger().used(), ledger_base);
    assert_eq!(n.memory_used(), base);
    r.finish();
}

/// Issue 12: captured launches were charged as if they ran, and a graph
/// launch was charged a flat unknown cost.
#[test]
fn captured_launches_are_free_and_a_graph_launch_costs_its_kernels() {
    let (n, prog) = node();
    let c = n.container(50, true, 0);
    let m = c.manager.as_ref().unwrap();
    let requested = || m.ledger().compute_words()[REQUESTED_WORD].load(Ordering::Acquire);
    let mut r = Stepped::start(&c, &prog, &["charge"]);
    r.reach("ready");
    let (r0, used0) = (requested(), m.ledger().used());
    r.resume();
    r.reach("captured");
    assert_eq!(requested(), r0, "six captured launches were charged");
    assert_eq!(
        m.ledger().used(),
        used0,
        "the captured cuMemAllocAsync was charged"
    );
    r.resume();
    // Reserved at instantiation, before the driver backs it at the first
    // launch: a reconcile with NVML in between (the module load's) keeps
    // it. It once took it out of the process's extra, so the ledger was
    // 16 MiB short until the next tick (CI, 2026-12-07, under load).
    r.reach("instantiated");
    assert_eq!(
        m.ledger().used() - used0,
        16 * MIB,
        "the exec's graph memory before its first launch, after a reconcile"
    );
    r.resume();
    r.reach("graph");
    let graphs = requested() - r0;
    assert_eq!(
        m.ledger().used() - used0,
        16 * MIB,
        "the exec's graph memory"
    );
    r.resume();
    r.reach("direct");
    let one = requested() - r0 - graphs;
    assert!(one > 0, "a direct launch was not charged");
    // Three launches of a graph of six kernels of the same shape.
    assert_eq!(
        graphs,
        18 * one,
        "graph launches charged {graphs}, one kernel {one}"
    );
    r.resume();
    r.reach("explicit");
    let at = requested();
    let explicit = at - r0 - graphs - one;
    assert_eq!(explicit, 2 * one, "a graph of two kernels");
    r.resume();
    r.reach("setparams");
    // The second node now has 10x the blocks: charged as 1 + 10 kernels.
    let updated = requested() - at;
    assert!(
        updated > 4 * explicit,
        "after cuGraphExecKernelNodeSetParams: {updated}, before {explicit}"
    );

    r.finish();
}
