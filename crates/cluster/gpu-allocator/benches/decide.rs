//! Allocation decision time on the simulated 16-GPU node holding 1,000 shares.
//!
//! `cargo bench -p gpu-allocator` prints p50/p99 per decision and ratios to
//! baselines measured in the same run:
//! * the same decision on the empty node (shows the cost does not grow with
//!   the number of allocations);
//! * a naive evaluator that recomputes each GPU's usage from the allocation
//!   list on every decision (what per-GPU aggregates avoid).
//!
//! Target: p99 under 1 ms for the share decision with 1,000 shares.

use std::hint::black_box;
use std::time::{Duration, Instant};

use gpu_allocator::{Allocator, Placement, Request};
use test_support::allocator::node;

const WARMUP: usize = 2_000;
const SAMPLES: usize = 50_000;

/// 1,000 one-core, one-unit shares over GPUs 0..`over` (round robin).
fn with_shares(over: usize) -> Allocator {
    let mut a = node("sim-16gpu.toml");
    for i in 0..1_000 {
        let p = Placement::Share {
            gpu: i % over,
            cores: 1,
            memory_units: 1,
        };
        a.commit(format!("pod-{i}/c"), &p).unwrap();
    }
    a
}

struct Stats {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn measure(f: impl FnMut()) -> Stats {
    measure_n(f, WARMUP, SAMPLES)
}

/// Fewer samples, no warm-up, for the slow case.
fn measure_few(f: impl FnMut()) -> Stats {
    measure_n(f, 0, 500)
}

/// Runs `f` `warmup` times, then times `samples` runs.
fn measure_n(mut f: impl FnMut(), warmup: usize, samples: usize) -> Stats {
    for _ in 0..warmup {
        f();
    }
    let mut t: Vec<Duration> = (0..samples)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort_unstable();
    Stats {
        p50: t[samples / 2],
        p99: t[samples * 99 / 100],
        max: t[samples - 1],
    }
}

/// Baseline: each GPU's free cores and memory recomputed from every
/// allocation, then the same fullest-fit choice.
fn naive_share(a: &Allocator, allocs: &[Placement], req: &Request) -> Option<usize> {
    let n = a.topology().len();
    let mut cores = vec![0u32; n];
    let mut units = vec![0u64; n];
    for p in allocs {
        match p {
            Placement::Share {
                gpu,
                cores: c,
                memory_units: m,
            } => {
                cores[*gpu] += c;
                units[*gpu] += m;
            }
            Placement::Exclusive { gpus } => {
                for &g in gpus {
                    cores[g] = 100;
                    units[g] = a.usage(g).total_memory_units;
                }
            }
            Placement::Shares {
                gpus,
                cores: c,
                memory_units: m,
            } => {
                for &g in gpus {
                    cores[g] += c;
                    units[g] += m;
                }
            }
            // Not against a GPU's own cores (the bench makes none).
            Placement::InMig { .. } => {}
        }
    }
    (0..n)
        .filter(|&g| {
            100 - cores[g] >= req.cores
                && a.usage(g).total_memory_units - units[g] >= req.memory_units
        })
        .min_by_key(|&g| (100 - cores[g], a.usage(g).total_memory_units - units[g], g))
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn row(name: &str, s: &Stats, base: Option<&Stats>) {
    let ratio = base
        .map(|b| format!("{:>8.2}x", s.p50.as_secs_f64() / b.p50.as_secs_f64()))
        .unwrap_or_else(|| format!("{:>9}", "-"));
    println!(
        "{name:<58} p50 {:>8.2} us  p99 {:>8.2} us  max {:>9.2} us  ratio(p50) {ratio}",
        us(s.p50),
        us(s.p99),
        us(s.max)
    );
}

fn main() {
    // `cargo test --benches` runs this too; keep that quick.
    if std::env::args().any(|a| a == "--test") {
        let a = with_shares(16);
        assert!(a.evaluate(&Request::share(10, 4)).is_ok());
        assert!(a.evaluate(&Request::shares(2, 10, 4)).is_ok());
        return;
    }
    let share_req = Request::share(10, 4);
    let empty = node("sim-16gpu.toml");
    let full = with_shares(16);
    assert_eq!(full.allocations().count(), 1_000);
    let allocs: Vec<Placement> = full.allocations().map(|(_, p)| p.clone()).collect();
    assert_eq!(
        naive_share(&full, &allocs, &share_req),
        full.evaluate(&share_req).ok().map(|p| p.gpus()[0])
    );

    println!("gpu-allocator decision time, sim-16gpu, {SAMPLES} samples each");
    let base_empty = measure(|| {
        black_box(empty.evaluate(black_box(&share_req))).unwrap();
    });
    let base_naive = measure(|| {
        black_box(naive_share(&full, black_box(&allocs), &share_req)).unwrap();
    });
    let ours = measure(|| {
        black_box(full.evaluate(black_box(&share_req))).unwrap();
    });
    row("baseline: share decision, empty node", &base_empty, None);
    row(
        "baseline: naive share decision (scan 1,000 allocations)",
        &base_naive,
        None,
    );
    row(
        "share decision, 1,000 shares (vs empty node)",
        &ours,
        Some(&base_empty),
    );
    row(
        "share decision, 1,000 shares (vs naive scan)",
        &ours,
        Some(&base_naive),
    );
    println!(
        "target p99 < 1000 us: {}",
        if ours.p99 < Duration::from_millis(1) {
            "met"
        } else {
            "MISSED"
        }
    );

    // Whole-GPU decisions with the 1,000 shares packed onto GPUs 0..9, six idle.
    let packed = with_shares(10);
    for n in [1, 2, 4] {
        let req = Request::whole(n);
        assert!(packed.evaluate(&req).is_ok());
        let s = measure(|| {
            black_box(packed.evaluate(black_box(&req))).unwrap();
        });
        row(
            &format!("{n} whole GPU(s), 1,000 shares on GPUs 0..9"),
            &s,
            Some(&base_empty),
        );
    }
    // The worst exhaustive case: 8 of 16 idle GPUs (12,870 candidate sets).
    let req = Request::whole(8);
    let s = measure_few(|| {
        black_box(empty.evaluate(black_box(&req))).unwrap();
    });
    row(
        "8 whole GPUs, empty node (12,870 sets)",
        &s,
        Some(&base_empty),
    );

    // Shares on 2 and 4 GPUs on the loaded node: every GPU has room, so all
    // C(16, n) sets are ranked.
    for n in [2, 4] {
        let req = Request::shares(n, 10, 4);
        assert!(full.evaluate(&req).is_ok());
        let s = measure_few(|| {
            black_box(full.evaluate(black_box(&req))).unwrap();
        });
        row(
            &format!("share on each of {n} GPUs, 1,000 shares"),
            &s,
            Some(&base_empty),
        );
    }

    // A full allocate + release cycle on the loaded node.
    let mut cycle = with_shares(16);
    let s = measure(|| {
        cycle.allocate("bench", &share_req).unwrap();
        cycle.release("bench").unwrap();
    });
    row(
        "share allocate + release, 1,000 shares",
        &s,
        Some(&base_empty),
    );
}
