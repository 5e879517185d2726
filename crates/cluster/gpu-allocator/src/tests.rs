//! Unit tests: every rule and every error on small synthetic topologies.
//! Sequences on the simulated node files are in tests/nodes.rs; shares on
//! several GPUs in shares/tests.rs, which borrows the nodes built here.

use crate::*;
use test_support::sets::subsets;

const GIB: u64 = 1 << 30;

/// NVLink links inside `set` on `a`'s topology.
pub(crate) fn links(a: &Allocator, set: &[usize]) -> u32 {
    test_support::sets::links(set, |x, y| a.topology().nvlink_count(x, y))
}

pub(crate) fn gpu(i: usize, memory_gib: u64) -> GpuInfo {
    GpuInfo {
        index: i,
        uuid: format!("GPU-{i:04}"),
        minor: i as u32,
        memory_bytes: memory_gib * GIB,
        numa_node: Some((i / 4) as u32),
        pci_bus_id: format!("00000000:{:02X}:00.0", i + 1),
    }
}

/// Pairs on a switch, fours on a host bridge, the rest across sockets.
pub(crate) fn hier(a: usize, b: usize) -> PcieLevel {
    if a / 2 == b / 2 {
        PcieLevel::Single
    } else if a / 4 == b / 4 {
        PcieLevel::HostBridge
    } else {
        PcieLevel::System
    }
}

pub(crate) fn pcie_node(n: usize) -> Allocator {
    Allocator::new(Topology::from_fn((0..n).map(|i| gpu(i, 16)).collect(), hier, |_, _| 0).unwrap())
}

/// DGX-1V hybrid cube-mesh: NVLink counts as `nvidia-smi topo -m` shows them.
pub(crate) const DGX1_NVLINK: [[u32; 8]; 8] = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
];

pub(crate) fn dgx1() -> Allocator {
    Allocator::new(
        Topology::from_fn((0..8).map(|i| gpu(i, 16)).collect(), hier, |a, b| {
            DGX1_NVLINK[a][b]
        })
        .unwrap(),
    )
}

fn whole(a: &Allocator, n: u32) -> Vec<usize> {
    match a.evaluate(&Request::whole(n)).unwrap() {
        Placement::Exclusive { gpus } => gpus,
        p => panic!("whole request placed as {p:?}"),
    }
}

fn share_gpu(a: &Allocator, cores: u32, units: u64) -> usize {
    match a.evaluate(&Request::share(cores, units)).unwrap() {
        Placement::Share { gpu, .. } => gpu,
        p => panic!("share placed as {p:?}"),
    }
}

fn take(a: &mut Allocator, id: &str, gpus: &[usize]) {
    a.commit(
        id,
        &Placement::Exclusive {
            gpus: gpus.to_vec(),
        },
    )
    .unwrap();
}

fn put_share(a: &mut Allocator, id: &str, gpu: usize, cores: u32, units: u64) {
    a.commit(
        id,
        &Placement::Share {
            gpu,
            cores,
            memory_units: units,
        },
    )
    .unwrap();
}

// ---- request validation --------------------------------------------------

#[test]
fn cores_zero_is_invalid() {
    let a = pcie_node(4);
    let e = a.evaluate(&Request::share(0, 4)).unwrap_err();
    assert_eq!(e, AllocError::InvalidCores { cores: 0 });
    assert_eq!(e.kind(), ErrorKind::InvalidRequest);
}

#[test]
fn cores_150_is_invalid_and_named() {
    let a = pcie_node(4);
    let e = a.evaluate(&Request::share(150, 4)).unwrap_err();
    assert_eq!(e, AllocError::InvalidCores { cores: 150 });
    assert!(e.to_string().contains("vcuda-core 150"), "{e}");
    assert!(e.to_string().contains("multiple of 100"), "{e}");
    assert!(matches!(
        a.evaluate(&Request::share(101, 4)),
        Err(AllocError::InvalidCores { cores: 101 })
    ));
}

#[test]
fn share_with_zero_memory_is_invalid() {
    let a = pcie_node(4);
    let e = a.evaluate(&Request::share(30, 0)).unwrap_err();
    assert_eq!(e, AllocError::ShareWithoutMemory { cores: 30 });
    assert!(e.to_string().contains("vcuda-memory is 0"), "{e}");
    assert_eq!(e.kind(), ErrorKind::InvalidRequest);
}

#[test]
fn share_memory_larger_than_any_gpu_is_invalid() {
    // GPUs of 16 and 8 GiB: 64 units is the most a share can have.
    let gpus = vec![gpu(0, 16), gpu(1, 8)];
    let a = Allocator::new(Topology::from_fn(gpus, hier, |_, _| 0).unwrap());
    assert_eq!(share_gpu(&a, 10, 64), 0);
    let e = a.evaluate(&Request::share(10, 65)).unwrap_err();
    assert_eq!(
        e,
        AllocError::MemoryTooLarge {
            requested: 65,
            largest: 64
        }
    );
    assert!(e.to_string().contains("16384 MiB"), "{e}");
    assert_eq!(e.kind(), ErrorKind::InvalidRequest);
}

#[test]
fn share_with_share_mode_off_is_invalid() {
    let a = pcie_node(4);
    let req = Request {
        cores: 50,
        memory_units: 4,
        share_mode: false,
        gpus: 1,
    };
    let e = a.evaluate(&req).unwrap_err();
    assert_eq!(e, AllocError::ShareModeOff { cores: 50 });
    assert!(e.to_string().contains("--share-mode"), "{e}");
    // Whole GPUs need no share mode.
    let req = Request {
        cores: 100,
        memory_units: 0,
        share_mode: false,
        gpus: 1,
    };
    assert!(a.evaluate(&req).is_ok());
}

#[test]
fn more_gpus_than_the_node_has_is_invalid() {
    let a = pcie_node(4);
    let e = a.evaluate(&Request::whole(5)).unwrap_err();
    assert_eq!(
        e,
        AllocError::TooManyGpus {
            cores: 500,
            requested: 5,
            total: 4
        }
    );
    assert_eq!(e.kind(), ErrorKind::InvalidRequest);
}

#[test]
fn bad_requests_change_nothing() {
    let mut a = pcie_node(4);
    put_share(&mut a, "s", 1, 30, 8);
    let before = a.usages().to_vec();
    for req in [
        Request::share(0, 1),
        Request::share(150, 1),
        Request::share(20, 0),
        Request::share(20, 1_000),
        Request::whole(9),
        Request {
            cores: 20,
            memory_units: 1,
            share_mode: false,
            gpus: 1,
        },
    ] {
        assert!(a.allocate(format!("{req:?}"), &req).is_err());
        assert_eq!(a.usages(), before.as_slice());
    }
    assert_eq!(a.allocations().count(), 1);
}

#[test]
fn full_node_is_insufficient_not_invalid() {
    let mut a = pcie_node(2);
    take(&mut a, "w", &[0]);
    put_share(&mut a, "s", 1, 90, 4);
    let e = a.evaluate(&Request::share(20, 4)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient);
    assert!(e.to_string().contains("GPU1 with 10 cores"), "{e}");
    let e = a.evaluate(&Request::whole(1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient);
    assert!(e.to_string().contains("0 fully free"), "{e}");
}

#[test]
fn whole_gpu_request_ignores_memory() {
    let a = pcie_node(4);
    let req = Request {
        cores: 200,
        memory_units: 12_345,
        share_mode: true,
        gpus: 1,
    };
    assert_eq!(
        a.evaluate(&req).unwrap(),
        Placement::Exclusive { gpus: vec![0, 1] }
    );
}

// ---- shares ---------------------------------------------------------------

#[test]
fn share_goes_to_fullest_gpu_that_fits() {
    let mut a = pcie_node(4);
    put_share(&mut a, "a", 0, 30, 4);
    put_share(&mut a, "b", 1, 60, 4);
    put_share(&mut a, "c", 2, 80, 4);
    // 20 cores fit GPU 2 (20 free), the fullest.
    assert_eq!(share_gpu(&a, 20, 4), 2);
    // 30 cores: GPU 2 is too full, GPU 1 is next fullest.
    assert_eq!(share_gpu(&a, 30, 4), 1);
    // 50 cores: only GPU 0 and the idle GPU 3; GPU 0 is fuller.
    assert_eq!(share_gpu(&a, 50, 4), 0);
}

#[test]
fn share_skips_gpu_without_enough_memory() {
    let mut a = pcie_node(4);
    put_share(&mut a, "a", 0, 50, 60); // 4 of 64 units left
    put_share(&mut a, "b", 1, 10, 4);
    assert_eq!(share_gpu(&a, 10, 4), 0);
    assert_eq!(share_gpu(&a, 10, 5), 1);
}

#[test]
fn share_ties_on_cores_go_to_least_free_memory() {
    let mut a = pcie_node(4);
    put_share(&mut a, "a", 0, 40, 4);
    put_share(&mut a, "b", 1, 40, 20);
    assert_eq!(share_gpu(&a, 10, 1), 1);
}

#[test]
fn share_never_lands_on_a_whole_gpu() {
    let mut a = pcie_node(2);
    take(&mut a, "w", &[0]);
    assert_eq!(share_gpu(&a, 1, 1), 1);
    let e = a
        .commit(
            "s",
            &Placement::Share {
                gpu: 0,
                cores: 1,
                memory_units: 1,
            },
        )
        .unwrap_err();
    assert!(matches!(e, AllocError::Conflict { .. }), "{e}");
}

#[test]
fn first_share_on_idle_gpus_keeps_intact_pairs() {
    // GPU 6 held whole: its pair mate 7 is the fragment to fill first.
    let mut a = pcie_node(8);
    take(&mut a, "w", &[6]);
    assert_eq!(share_gpu(&a, 10, 1), 7);
    // With nothing held, the lowest index.
    assert_eq!(share_gpu(&pcie_node(8), 10, 1), 0);
}

#[test]
fn shares_fill_one_gpu_before_the_next() {
    let mut a = pcie_node(4);
    for i in 0..10 {
        a.allocate(format!("s{i}"), &Request::share(10, 4)).unwrap();
    }
    assert_eq!(a.usage(0).allocated_cores, 100);
    assert_eq!(a.usage(0).shares, 10);
    assert_eq!(share_gpu(&a, 10, 4), 1);
}

// ---- whole GPUs --------------------------------------------------------------

#[test]
fn one_whole_gpu_goes_to_most_fragmented_subtree() {
    let mut a = pcie_node(8);
    take(&mut a, "w0", &[5]);
    // GPU 4 is alone in its pair: take it rather than break a pair.
    assert_eq!(whole(&a, 1), vec![4]);
    take(&mut a, "w1", &[4]);
    // Pairs {6,7} (quad with 2 free) vs {0,1},{2,3} (quad with 4 free).
    assert_eq!(whole(&a, 1), vec![6]);
}

#[test]
fn whole_gpus_take_the_tightest_subtree() {
    let mut a = pcie_node(8);
    assert_eq!(whole(&a, 2), vec![0, 1]);
    assert_eq!(whole(&a, 4), vec![0, 1, 2, 3]);
    take(&mut a, "w", &[0]);
    // Pair {2,3} is tighter than any set with GPU 1 in it.
    assert_eq!(whole(&a, 2), vec![2, 3]);
    // Quad {4..7} is the only free quad.
    assert_eq!(whole(&a, 4), vec![4, 5, 6, 7]);
    // Three: within the broken quad, keeping {4..7} whole.
    assert_eq!(whole(&a, 3), vec![1, 2, 3]);
}

#[test]
fn among_equal_subtrees_the_more_fragmented_is_used() {
    // Quad {4..7} has GPU 6 taken; both {0,1} and {4,5} are free pairs, but
    // {4,5} sits in the broken quad.
    let mut a = pcie_node(8);
    take(&mut a, "w", &[6]);
    assert_eq!(whole(&a, 2), vec![4, 5]);
}

#[test]
fn whole_gpus_need_idle_gpus() {
    let mut a = pcie_node(4);
    put_share(&mut a, "s", 0, 1, 1);
    assert_eq!(whole(&a, 2), vec![2, 3]);
    assert_eq!(whole(&a, 3), vec![1, 2, 3]);
    assert_eq!(
        a.evaluate(&Request::whole(4)).unwrap_err().kind(),
        ErrorKind::Insufficient
    );
}

#[test]
fn nvlink_beats_pcie_closeness() {
    // DGX-1: {2,3} share a switch and 2 links; {0,1} share a switch but 1 link.
    let mut a = dgx1();
    assert_eq!(whole(&a, 2), vec![2, 3]);
    assert_eq!(whole(&a, 4), vec![0, 1, 2, 3]);
    take(&mut a, "w", &[2]);
    // 0-3 and 0-4 have 2 links; 0-3 is within one host bridge.
    assert_eq!(whole(&a, 2), vec![6, 7]);
    take(&mut a, "w2", &[6]);
    // Best left: 2-link pairs {0,3} (PHB), {0,4}, {1,5} (SYS), {4,7} (PHB).
    assert_eq!(whole(&a, 2), vec![0, 3]);
}

#[test]
fn dgx1_every_2_and_4_request_gets_best_bandwidth() {
    // All 2^8 states of which GPUs are held whole.
    for mask in 0u32..256 {
        let mut a = dgx1();
        let held: Vec<usize> = (0..8).filter(|i| mask & (1 << i) != 0).collect();
        for &g in &held {
            take(&mut a, &format!("h{g}"), &[g]);
        }
        let free: Vec<usize> = (0..8).filter(|i| mask & (1 << i) == 0).collect();
        for k in [2, 4] {
            let best = subsets(&free, k).iter().map(|s| links(&a, s)).max();
            match (a.evaluate(&Request::whole(k as u32)), best) {
                (Ok(p), Some(best)) => {
                    assert_eq!(links(&a, p.gpus()), best, "held {held:?}, {k} GPUs: {p}")
                }
                (Err(e), None) => assert_eq!(e.kind(), ErrorKind::Insufficient),
                (r, b) => panic!("held {held:?}, {k} GPUs: {r:?} vs best {b:?}"),
            }
        }
    }
}

#[test]
fn unhealthy_gpus_get_nothing_new() {
    let mut a = pcie_node(4);
    put_share(&mut a, "s", 0, 10, 1);
    a.set_healthy(0, false).unwrap();
    a.set_healthy(2, false).unwrap();
    assert_eq!(share_gpu(&a, 10, 1), 1);
    // 1 and 3 are both alone in their pairs: lowest index.
    assert_eq!(whole(&a, 1), vec![1]);
    assert_eq!(whole(&a, 2), vec![1, 3]);
    assert_eq!(
        a.evaluate(&Request::whole(3)).unwrap_err().kind(),
        ErrorKind::Insufficient
    );
    // What was there stays.
    assert_eq!(a.usage(0).shares, 1);
    a.set_healthy(0, true).unwrap();
    assert_eq!(share_gpu(&a, 10, 1), 0);
    assert_eq!(
        a.set_healthy(4, false),
        Err(AllocError::UnknownGpu { gpu: 4, total: 4 })
    );
}

#[test]
fn gpus_in_mig_mode_get_no_share_and_are_not_whole_gpus() {
    let mut a = pcie_node(4);
    a.set_mig(0, true).unwrap();
    a.set_mig(1, true).unwrap();
    // Shares go to 2 (fullest-first among equals: the pair left intact).
    assert_ne!(share_gpu(&a, 10, 1), 0);
    assert_ne!(share_gpu(&a, 10, 1), 1);
    assert_eq!(whole(&a, 2), vec![2, 3]);
    let e = a.evaluate(&Request::whole(3)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient);
    assert!(e.to_string().contains("2 in MIG mode"), "{e}");
    a.set_mig(2, true).unwrap();
    a.set_mig(3, true).unwrap();
    let e = a.evaluate(&Request::share(10, 1)).unwrap_err();
    assert!(e.to_string().contains("unhealthy or in MIG mode"), "{e}");
    assert!(a.render().contains("[MIG]"));
    // Published and read back by the extender and the webhook.
    let inv = crate::inventory::Inventory::of(&a, true);
    assert!(inv.to_json().contains("\"mig\":true"));
    let back = crate::inventory::Inventory::from_json(&inv.to_json()).unwrap();
    assert!(back.allocator().usage(3).mig);
    // Out of MIG mode: placeable again.
    a.set_mig(0, false).unwrap();
    assert_eq!(share_gpu(&a, 10, 1), 0);
    assert_eq!(
        a.set_mig(4, true),
        Err(AllocError::UnknownGpu { gpu: 4, total: 4 })
    );
}

#[test]
fn large_node_uses_greedy_search_within_subtrees() {
    // 40 GPUs: C(40,20) is far over the exhaustive limit.
    let a = pcie_node(40);
    assert_eq!(whole(&a, 4), vec![0, 1, 2, 3]);
    let mut a = a;
    take(&mut a, "w", &[0]);
    assert_eq!(whole(&a, 4), vec![4, 5, 6, 7]);
    let twenty = whole(&a, 20);
    assert_eq!(twenty.len(), 20);
    assert!(!twenty.contains(&0));
    a.commit("w20", &Placement::Exclusive { gpus: twenty })
        .unwrap();
    assert_eq!(whole(&a, 19).len(), 19);
}

// ---- commit, release, restore ------------------------------------------------

#[test]
fn stale_placement_conflicts_and_changes_nothing() {
    let mut a = pcie_node(2);
    let p1 = a.evaluate(&Request::share(60, 4)).unwrap();
    let p2 = a.evaluate(&Request::share(60, 4)).unwrap();
    assert_eq!(p1, p2);
    a.commit("one", &p1).unwrap();
    let before = a.usages().to_vec();
    let e = a.commit("two", &p2).unwrap_err();
    assert!(matches!(e, AllocError::Conflict { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::State);
    assert_eq!(a.usages(), before.as_slice());
    assert!(a.allocation("two").is_none());
}

#[test]
fn ids_are_checked() {
    let mut a = pcie_node(2);
    put_share(&mut a, "x", 0, 10, 1);
    let e = a
        .commit(
            "x",
            &Placement::Share {
                gpu: 1,
                cores: 10,
                memory_units: 1,
            },
        )
        .unwrap_err();
    assert_eq!(e, AllocError::DuplicateAllocation { id: "x".into() });
    assert_eq!(
        a.release("y").unwrap_err(),
        AllocError::UnknownAllocation { id: "y".into() }
    );
}

#[test]
fn malformed_placements_are_rejected() {
    let mut a = pcie_node(2);
    for (p, want) in [
        (Placement::Exclusive { gpus: vec![] }, "names no GPU"),
        (Placement::Exclusive { gpus: vec![1, 1] }, "named twice"),
        (
            Placement::Share {
                gpu: 0,
                cores: 100,
                memory_units: 1,
            },
            "1..99",
        ),
        (Placement::Exclusive { gpus: vec![2] }, "does not exist"),
    ] {
        let e = a.commit("p", &p).unwrap_err();
        assert!(e.to_string().contains(want), "{p:?}: {e}");
    }
    assert_eq!(a.allocations().count(), 0);
}

#[test]
fn release_restores_exactly() {
    let mut a = pcie_node(4);
    let empty = a.usages().to_vec();
    let p = a.allocate("w", &Request::whole(2)).unwrap();
    let mid = a.usages().to_vec();
    a.allocate("s", &Request::share(30, 7)).unwrap();
    assert_eq!(
        a.release("s").unwrap(),
        Placement::Share {
            gpu: 2,
            cores: 30,
            memory_units: 7
        }
    );
    assert_eq!(a.usages(), mid.as_slice());
    assert_eq!(a.release("w").unwrap(), p);
    assert_eq!(a.usages(), empty.as_slice());
}

#[test]
fn restore_takes_what_fits_and_reports_the_rest() {
    let mut a = pcie_node(4);
    let rejected = a.restore(vec![
        ("w".to_string(), Placement::Exclusive { gpus: vec![2, 3] }),
        (
            "s1".to_string(),
            Placement::Share {
                gpu: 0,
                cores: 70,
                memory_units: 10,
            },
        ),
        // Over-commits GPU 0.
        (
            "s2".to_string(),
            Placement::Share {
                gpu: 0,
                cores: 40,
                memory_units: 10,
            },
        ),
        // GPU 3 is already held.
        ("w2".to_string(), Placement::Exclusive { gpus: vec![3] }),
    ]);
    let ids: Vec<&str> = rejected.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["s2", "w2"]);
    assert_eq!(a.usage(0).allocated_cores, 70);
    assert!(a.usage(2).exclusive && a.usage(3).exclusive);
    assert_eq!(a.usage(3).allocated_memory_units, 64);
    // And decisions continue from the restored state.
    assert_eq!(share_gpu(&a, 30, 1), 0);
    assert_eq!(whole(&a, 1), vec![1]);
}

#[test]
fn render_shows_tree_and_usage() {
    let mut a = dgx1();
    put_share(&mut a, "s", 1, 30, 8);
    take(&mut a, "w", &[4]);
    a.set_healthy(7, false).unwrap();
    let text = a.render();
    assert!(text.starts_with("SYS (8 GPUs, 5 whole free)\n"), "{text}");
    assert!(text.contains("├─ PHB (4 GPUs, 3 whole free)"), "{text}");
    assert!(text.contains("│  ├─ PIX (2 GPUs, 1 whole free)"), "{text}");
    assert!(
        text.contains("GPU1 /dev/nvidia1 GPU-0001: cores 30/100 used 70 free, memory 2048/16384 MiB used 14336 MiB free [1 share]"),
        "{text}"
    );
    assert!(text.contains("GPU4 /dev/nvidia4 GPU-0004: cores 100/100 used 0 free, memory 16384/16384 MiB used 0 MiB free [whole]"), "{text}");
    assert!(text.contains("[UNHEALTHY]"), "{text}");
    assert!(text.contains("NVLink links:"), "{text}");
    assert!(!pcie_node(2).render().contains("NVLink"));
}

#[test]
fn placements_serialize_for_checkpoints() {
    let p = Placement::Share {
        gpu: 2,
        cores: 30,
        memory_units: 8,
    };
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(json, r#"{"share":{"gpu":2,"cores":30,"memory_units":8}}"#);
    assert_eq!(serde_json::from_str::<Placement>(&json).unwrap(), p);
    let w = Placement::Exclusive { gpus: vec![0, 1] };
    let json = serde_json::to_string(&w).unwrap();
    assert_eq!(json, r#"{"exclusive":{"gpus":[0,1]}}"#);
    assert_eq!(serde_json::from_str::<Placement>(&json).unwrap(), w);
}

#[test]
fn a_request_placed_on_recorded_gpus() {
    let share = Request::share(30, 8).placement_on(&[2]);
    assert_eq!(
        share,
        Some(Placement::Share {
            gpu: 2,
            cores: 30,
            memory_units: 8
        })
    );
    assert_eq!(Request::share(30, 8).placement_on(&[1, 2]), None);
    // A GPU named twice counts once.
    let whole = Request::whole(2).placement_on(&[3, 1, 3]);
    assert_eq!(whole, Some(Placement::Exclusive { gpus: vec![1, 3] }));
    assert_eq!(Request::whole(2).placement_on(&[3, 3]), None);
    let tp = Request::shares(2, 50, 32).placement_on(&[1, 0]);
    assert_eq!(
        tp,
        Some(Placement::Shares {
            gpus: vec![0, 1],
            cores: 50,
            memory_units: 32
        })
    );
    assert_eq!(Request::shares(2, 50, 32).placement_on(&[1]), None);
}
