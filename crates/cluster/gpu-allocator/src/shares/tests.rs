//! Shares on several GPUs: the split of a container's totals, validation,
//! placement (NVLink, then PCIe closeness, then the fullest set), refusals,
//! and the state (commit, release, restore, serde).

use crate::tests::{dgx1, links, pcie_node};
use crate::*;
use test_support::sets::subsets;

fn shares_gpus(a: &Allocator, n: u32, cores: u32, units: u64) -> Vec<usize> {
    match a.evaluate(&Request::shares(n, cores, units)).unwrap() {
        Placement::Shares {
            gpus,
            cores: c,
            memory_units: m,
        } => {
            assert_eq!((c, m), (cores, units), "the request's amounts on each GPU");
            gpus
        }
        p => panic!("shares placed as {p:?}"),
    }
}

fn take(a: &mut Allocator, id: &str, gpus: &[usize]) {
    let p = Placement::Exclusive {
        gpus: gpus.to_vec(),
    };
    a.commit(id, &p).unwrap();
}

fn put_share(a: &mut Allocator, id: &str, gpu: usize, cores: u32, units: u64) {
    let p = Placement::Share {
        gpu,
        cores,
        memory_units: units,
    };
    a.commit(id, &p).unwrap();
}

fn invalid(r: Result<impl std::fmt::Debug, AllocError>, want: &[&str]) {
    let e = r.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    let text = e.to_string();
    for w in want {
        assert!(text.contains(w), "{w:?} not in: {text}");
    }
}

// ---- the device plugin's split of a container's totals --------------------

#[test]
fn totals_split_evenly_over_the_gpus() {
    assert_eq!(
        Request::from_totals(80, 160, 2, true),
        Ok(Request::shares(2, 40, 80))
    );
    assert_eq!(
        Request::from_totals(120, 12, 4, true),
        Ok(Request::shares(4, 30, 3))
    );
}

#[test]
fn vcuda_core_100_over_two_gpus_is_two_halves_not_a_whole_gpu() {
    assert_eq!(
        Request::from_totals(100, 80, 2, true),
        Ok(Request::shares(2, 50, 40))
    );
    // Without a GPU count (or a count of 1) it keeps today's meaning.
    assert_eq!(
        Request::from_totals(100, 80, 1, true),
        Ok(Request {
            cores: 100,
            memory_units: 80,
            share_mode: true,
            gpus: 1
        })
    );
    assert_eq!(
        Request::from_totals(30, 8, 1, false),
        Ok(Request {
            cores: 30,
            memory_units: 8,
            share_mode: false,
            gpus: 1
        })
    );
}

#[test]
fn totals_that_do_not_split_are_refused_by_name() {
    invalid(
        Request::from_totals(81, 160, 2, true),
        &[
            "vcuda-core 81 and vcuda-memory 160 over 2 GPUs",
            "split evenly",
        ],
    );
    invalid(
        Request::from_totals(80, 161, 2, true),
        &["vcuda-memory 161", "2 × the units"],
    );
    invalid(Request::from_totals(80, 0, 2, true), &["at least one each"]);
    invalid(
        Request::from_totals(200, 80, 2, true),
        &[
            "each GPU would get 100 cores",
            "vcuda-core 200 without a GPU count",
        ],
    );
    invalid(
        Request::from_totals(0, 2, 2, true),
        &["each GPU would get 0 cores"],
    );
    invalid(Request::from_totals(80, 160, 0, true), &["at least 1"]);
}

// ---- validation -----------------------------------------------------------

#[test]
fn bad_requests_are_invalid_name_the_request_and_change_nothing() {
    let mut a = pcie_node(4);
    put_share(&mut a, "s", 0, 30, 8);
    let before = a.usages().to_vec();
    let named = "shares of 40 cores and 8 memory units (2048 MiB) on each of 2 GPUs";
    invalid(a.evaluate(&Request::shares(2, 0, 8)), &["1..99 cores"]);
    invalid(
        a.evaluate(&Request::shares(2, 100, 8)),
        &["vcuda-core 200 without a GPU count"],
    );
    let off = Request {
        share_mode: false,
        ..Request::shares(2, 40, 8)
    };
    invalid(a.evaluate(&off), &[named, "share mode is off"]);
    invalid(a.evaluate(&Request::shares(2, 40, 0)), &["memory unit"]);
    invalid(
        a.evaluate(&Request::shares(5, 40, 8)),
        &["on each of 5 GPUs", "only 4 GPUs"],
    );
    invalid(
        a.evaluate(&Request::shares(2, 40, 65)),
        &[
            "0 GPU(s) on this node hold 65 units",
            "the largest holds 64",
        ],
    );
    invalid(a.evaluate(&Request::shares(0, 40, 8)), &["at least 1"]);
    assert_eq!(a.usages(), before.as_slice());
    assert_eq!(a.allocations().count(), 1);
}

#[test]
fn enough_memory_on_too_few_gpus_is_invalid_not_insufficient() {
    // Two 16 GiB GPUs and two 40 GiB ones: 100 units fit on two GPUs only.
    let gpus = (0..4)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            minor: i as u32,
            memory_bytes: if i < 2 { 16 << 30 } else { 40 << 30 },
            numa_node: None,
            pci_bus_id: format!("00000000:{:02X}:00.0", i + 1),
        })
        .collect();
    let a = Allocator::new(Topology::from_fn(gpus, |_, _| PcieLevel::System, |_, _| 0).unwrap());
    assert_eq!(shares_gpus(&a, 2, 10, 100), vec![2, 3]);
    invalid(
        a.evaluate(&Request::shares(3, 10, 100)),
        &["2 GPU(s) on this node hold 100 units"],
    );
}

// ---- placement ------------------------------------------------------------

#[test]
fn two_gpu_share_takes_the_best_linked_pair() {
    // DGX-1: {2,3} share a switch and 2 NVLinks, like whole(2) gets.
    let a = dgx1();
    assert_eq!(shares_gpus(&a, 2, 40, 16), vec![2, 3]);
    assert_eq!(
        shares_gpus(&a, 2, 40, 16),
        a.evaluate(&Request::whole(2)).unwrap().gpus()
    );
}

#[test]
fn a_linked_pair_with_room_beats_idle_gpus_with_fewer_links() {
    let mut a = dgx1();
    take(&mut a, "w3", &[3]);
    put_share(&mut a, "s2", 2, 50, 8);
    // 2-link pairs with room: {0,4} {1,2} {1,5} {4,7} {5,6} {6,7}; {6,7}
    // shares a switch.
    assert_eq!(shares_gpus(&a, 2, 40, 16), vec![6, 7]);
    take(&mut a, "w67", &[6, 7]);
    // Then {1,2} (same host bridge), although GPU2 already holds a share and
    // {0,1} (one link, same switch) are idle.
    assert_eq!(shares_gpus(&a, 2, 40, 16), vec![1, 2]);
    // With 60 cores asked, GPU2 has no room: the next 2-link pair.
    assert_eq!(links(&a, &shares_gpus(&a, 2, 60, 16)), 2);
}

#[test]
fn without_nvlink_the_tightest_subtree_then_the_fullest_pair() {
    let mut a = pcie_node(4);
    put_share(&mut a, "s", 2, 30, 8);
    // {0,1} and {2,3} are both one switch; {2,3} is fuller.
    assert_eq!(shares_gpus(&a, 2, 20, 8), vec![2, 3]);
    // Across switches only when no switch pair has room.
    take(&mut a, "w", &[3]);
    assert_eq!(shares_gpus(&a, 2, 20, 8), vec![0, 1]);
    put_share(&mut a, "s0", 0, 90, 8);
    assert_eq!(shares_gpus(&a, 2, 20, 8), vec![1, 2]);
}

#[test]
fn unhealthy_and_whole_gpus_get_no_part() {
    let mut a = pcie_node(4);
    take(&mut a, "w", &[0]);
    a.set_healthy(2, false).unwrap();
    assert_eq!(shares_gpus(&a, 2, 10, 1), vec![1, 3]);
    let e = a.evaluate(&Request::shares(3, 10, 1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient, "{e}");
}

#[test]
fn refused_with_what_was_asked_and_what_each_gpu_has_free() {
    let mut a = pcie_node(4);
    take(&mut a, "w", &[0, 1]);
    a.set_healthy(2, false).unwrap();
    put_share(&mut a, "s", 3, 30, 8);
    let before = a.usages().to_vec();
    let e = a.evaluate(&Request::shares(2, 30, 8)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient);
    assert_eq!(
        e.to_string(),
        "not enough free GPU capacity: shares of 30 cores and 8 memory units (2048 MiB) on each of 2 GPUs \
         requested, 1 GPU(s) have room (GPU3); free per GPU: GPU0 held whole, GPU1 held whole, \
         GPU2 unhealthy, GPU3 70 cores/56 units"
    );
    assert_eq!(a.usages(), before.as_slice());
}

/// For every busy mask on the DGX-1 (busy GPUs alternately held whole and
/// holding a 60-core share, which leaves room for 30), 2- and 4-GPU shares
/// of 30 cores get a set with the most links any set with room has, and
/// among those the closest PCIe ancestor.
#[test]
fn dgx1_every_2_and_4_gpu_share_gets_best_bandwidth() {
    let mut a = dgx1();
    let idle = a.usages().to_vec();
    for mask in 0u32..256 {
        for g in (0..8).filter(|g| mask & (1 << g) != 0) {
            if g % 2 == 0 {
                take(&mut a, &format!("busy{g}"), &[g]);
            } else {
                put_share(&mut a, &format!("busy{g}"), g, 60, 8);
            }
        }
        let room: Vec<usize> = (0..8).filter(|&g| !a.usage(g).exclusive).collect();
        for k in [2u32, 4] {
            let sets = subsets(&room, k as usize);
            let result = a.evaluate(&Request::shares(k, 30, 8));
            let Some(best) = sets.iter().map(|s| links(&a, s)).max() else {
                assert_eq!(result.unwrap_err().kind(), ErrorKind::Insufficient);
                continue;
            };
            let span = |s: &[usize]| {
                let t = a.topology();
                s.iter()
                    .flat_map(|&x| s.iter().map(move |&y| (x, y)))
                    .filter(|(x, y)| x != y)
                    .map(|(x, y)| t.pcie_level(x, y))
                    .max()
                    .unwrap()
            };
            let best_span = sets
                .iter()
                .filter(|s| links(&a, s) == best)
                .map(|s| span(s))
                .min()
                .unwrap();
            let got = result.unwrap();
            let got = got.gpus();
            assert!(got.iter().all(|g| room.contains(g)), "{mask:b}: {got:?}");
            assert_eq!(links(&a, got), best, "{mask:b}, {k} GPUs: {got:?}");
            assert_eq!(span(got), best_span, "{mask:b}, {k} GPUs: {got:?}");
        }
        for g in (0..8).filter(|g| mask & (1 << g) != 0) {
            a.release(&format!("busy{g}")).unwrap();
        }
        assert_eq!(a.usages(), idle.as_slice());
    }
}

// ---- state ----------------------------------------------------------------

#[test]
fn commit_and_release_account_each_gpu() {
    let mut a = pcie_node(4);
    let empty = a.usages().to_vec();
    let p = a.allocate("tp2", &Request::shares(2, 40, 16)).unwrap();
    for &g in p.gpus() {
        let u = a.usage(g);
        assert_eq!(
            (u.allocated_cores, u.allocated_memory_units, u.shares),
            (40, 16, 1)
        );
        assert!(!u.exclusive);
    }
    assert_eq!(p.on_gpu(p.gpus()[1]), Some((40, Some(16))));
    assert_eq!(a.release("tp2").unwrap(), p);
    assert_eq!(a.usages(), empty.as_slice());
}

#[test]
fn restore_takes_a_multi_gpu_share_whole_or_not_at_all() {
    let mut a = pcie_node(4);
    let shares = |gpus: Vec<usize>, cores| Placement::Shares {
        gpus,
        cores,
        memory_units: 8,
    };
    let rejected = a.restore(vec![
        (
            "s".to_string(),
            Placement::Share {
                gpu: 1,
                cores: 70,
                memory_units: 8,
            },
        ),
        ("ok".to_string(), shares(vec![2, 3], 50)),
        // Fits GPU 0 but not GPU 1: neither gets it.
        ("over".to_string(), shares(vec![0, 1], 40)),
        ("one".to_string(), shares(vec![0], 40)),
        ("twice".to_string(), shares(vec![0, 0], 40)),
        ("unknown".to_string(), shares(vec![0, 9], 40)),
        ("hundred".to_string(), shares(vec![0, 2], 100)),
    ]);
    let why: Vec<(&str, String)> = rejected
        .iter()
        .map(|(id, e)| (id.as_str(), e.to_string()))
        .collect();
    let ids: Vec<&str> = why.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        ids,
        ["over", "one", "twice", "unknown", "hundred"],
        "{why:?}"
    );
    assert!(why[0].1.contains("GPU1 has 30 cores"), "{why:?}");
    assert!(why[1].1.contains("name 1 GPU(s)"), "{why:?}");
    assert!(why[2].1.contains("GPU0 is named twice"), "{why:?}");
    assert!(why[3].1.contains("GPU index 9 does not exist"), "{why:?}");
    assert!(why[4].1.contains("1..99 cores, not 100"), "{why:?}");
    assert_eq!(
        a.usage(0).allocated_cores,
        0,
        "nothing of a rejected one stays"
    );
    assert_eq!(a.usage(1).allocated_cores, 70);
    assert_eq!(a.usage(2).allocated_cores, 50);
    assert_eq!(a.usage(3).shares, 1);
    // A whole GPU cannot be taken under a multi-GPU share.
    let e = a
        .commit("w", &Placement::Exclusive { gpus: vec![3] })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::State);
}

#[test]
fn serde_forms_of_existing_placements_and_requests_are_unchanged() {
    let p = Placement::Shares {
        gpus: vec![0, 1],
        cores: 40,
        memory_units: 80,
    };
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(
        json,
        r#"{"shares":{"gpus":[0,1],"cores":40,"memory_units":80}}"#
    );
    assert_eq!(serde_json::from_str::<Placement>(&json).unwrap(), p);
    // A request written before the GPU count existed reads as one GPU.
    let old: Request =
        serde_json::from_str(r#"{"cores":30,"memory_units":8,"share_mode":true}"#).unwrap();
    assert_eq!(old, Request::share(30, 8));
    assert_eq!(
        p.to_string(),
        "shares of GPU0,GPU1: 40 cores, 80 memory units on each"
    );
    assert_eq!(p.on_gpu(2), None);
    assert_eq!(
        Placement::Exclusive { gpus: vec![2] }.on_gpu(2),
        Some((100, None))
    );
}
