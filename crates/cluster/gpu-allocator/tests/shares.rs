//! Shares on several GPUs on the simulated node descriptions
//! (config/nodes/*.toml): a tensor-parallel sequence on the 8-GPU NVSwitch
//! node, the best-set property on the 16-GPU node, and a PCIe-only node.

use gpu_allocator::{Allocator, ErrorKind, PcieLevel, Placement, Request};
use test_support::allocator::node;
use test_support::sets::subsets;

fn place(a: &mut Allocator, id: &str, req: Request) -> Vec<usize> {
    a.allocate(id, &req)
        .unwrap_or_else(|e| panic!("{id}: {e}"))
        .gpus()
        .to_vec()
}

#[test]
fn sequence_8gpu_nvswitch() {
    // SYS { NODE { PXB {0,1}, PXB {2,3} }, NODE { PXB {4,5}, PXB {6,7} } },
    // all pairs 12 NVLinks, 320 units each.
    let mut a = node("sim-8gpu-nvlink.toml");
    let idle = a.usages().to_vec();
    // A TP=2 server: half of two GPUs behind one switch.
    assert_eq!(place(&mut a, "tp2a", Request::shares(2, 40, 80)), [0, 1]);
    // A second one packs onto the same pair (fullest set that fits).
    assert_eq!(place(&mut a, "tp2b", Request::shares(2, 40, 80)), [0, 1]);
    // No room left there for 30: the pair beside it in the broken half.
    assert_eq!(place(&mut a, "tp2c", Request::shares(2, 30, 80)), [2, 3]);
    assert_eq!(place(&mut a, "w2", Request::whole(2)), [4, 5]);
    // TP=4: the half holding shares, not one spanning both halves.
    assert_eq!(
        place(&mut a, "tp4", Request::shares(4, 10, 8)),
        [0, 1, 2, 3]
    );
    // Only GPUs 6 and 7 have 70 cores free: refused, saying so.
    let e = a.evaluate(&Request::shares(3, 70, 8)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient);
    let text = e.to_string();
    for want in [
        "shares of 70 cores and 8 memory units (2048 MiB) on each of 3 GPUs requested",
        "2 GPU(s) have room (GPU6, GPU7)",
        "GPU0 10 cores/152 units",
        "GPU2 60 cores/232 units",
        "GPU4 held whole",
        "GPU7 100 cores/320 units",
    ] {
        assert!(text.contains(want), "{want:?} not in: {text}");
    }
    assert_eq!(place(&mut a, "tp2d", Request::shares(2, 70, 8)), [6, 7]);
    for id in ["tp2a", "tp2b", "tp2c", "w2", "tp4", "tp2d"] {
        a.release(id).unwrap();
    }
    assert_eq!(a.usages(), idle.as_slice());
}

#[test]
fn pcie_4gpu_pairs_before_the_node_wide_set() {
    // SYS { PIX {0,1}, PIX {2,3} }, 60 units each, no NVLink.
    let mut a = node("sim-4gpu-pcie.toml");
    a.allocate("s", &Request::share(50, 20)).unwrap();
    assert_eq!(a.allocation("s").unwrap().gpus(), [0]);
    // The switch pair holding a share, fuller than the idle pair.
    assert_eq!(place(&mut a, "tp2", Request::shares(2, 40, 30)), [0, 1]);
    assert_eq!(place(&mut a, "s2", Request::share(70, 10)), [2]);
    // 50 cores: GPU0 and GPU2 have no room, so neither switch pair does;
    // then the node-wide set.
    assert_eq!(place(&mut a, "tp2b", Request::shares(2, 50, 10)), [1, 3]);
}

/// Largest pairwise PCIe level of a set: its common ancestor's level.
fn span(a: &Allocator, set: &[usize]) -> PcieLevel {
    let t = a.topology();
    let mut m = PcieLevel::Internal;
    for &x in set {
        for &y in set {
            if x != y {
                m = m.max(t.pcie_level(x, y));
            }
        }
    }
    m
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// On random 16-GPU states (GPUs held whole, holding 30- or 80-core
/// shares, or idle), 2- and 4-GPU shares of 40 cores land on GPUs with
/// room, in the closest PCIe subtree any set with room has (every pair has
/// 6 NVLinks, so links tie).
#[test]
fn sim_16gpu_shares_take_the_tightest_subtree_with_room() {
    let mut a = node("sim-16gpu.toml");
    let idle = a.usages().to_vec();
    let mut rng = Rng(0x5eed_0016);
    for _ in 0..150 {
        let mut ids = Vec::new();
        for g in 0..16 {
            let p = match rng.next() % 4 {
                0 => Placement::Exclusive { gpus: vec![g] },
                1 => Placement::Share {
                    gpu: g,
                    cores: 30,
                    memory_units: 8,
                },
                2 => Placement::Share {
                    gpu: g,
                    cores: 80,
                    memory_units: 8,
                },
                _ => continue,
            };
            a.commit(format!("busy{g}"), &p).unwrap();
            ids.push(format!("busy{g}"));
        }
        let room: Vec<usize> = (0..16).filter(|&g| a.usage(g).free_cores() >= 40).collect();
        for k in [2usize, 4] {
            let result = a.evaluate(&Request::shares(k as u32, 40, 8));
            let Some(best) = subsets(&room, k).iter().map(|s| span(&a, s)).min() else {
                assert_eq!(result.unwrap_err().kind(), ErrorKind::Insufficient);
                continue;
            };
            let got = result.unwrap();
            assert!(got.gpus().iter().all(|g| room.contains(g)), "{got}");
            assert_eq!(span(&a, got.gpus()), best, "{got}, room {room:?}");
        }
        for id in ids {
            a.release(&id).unwrap();
        }
        assert_eq!(a.usages(), idle.as_slice());
    }
}
