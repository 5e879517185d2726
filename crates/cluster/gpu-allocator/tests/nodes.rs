//! Sequences on the simulated node descriptions (config/nodes/*.toml), the
//! NVLink best-bandwidth property, and randomized invariants.

use gpu_allocator::{AllocError, Allocator, ErrorKind, PcieLevel, Placement, Request};
use test_support::allocator::node;
use test_support::sets::subsets;

/// NVLink links inside `set` on `a`'s topology.
fn links(a: &Allocator, set: &[usize]) -> u32 {
    test_support::sets::links(set, |x, y| a.topology().nvlink_count(x, y))
}

/// Allocates and returns the GPUs, or the error.
fn alloc(a: &mut Allocator, id: &str, req: Request) -> Result<Vec<usize>, AllocError> {
    a.allocate(id, &req).map(|p| p.gpus().to_vec())
}

fn share(cores: u32, units: u64) -> Request {
    Request::share(cores, units)
}

fn whole(n: u32) -> Request {
    Request::whole(n)
}

fn insufficient(r: Result<Vec<usize>, AllocError>) {
    match r {
        Err(e) => assert_eq!(e.kind(), ErrorKind::Insufficient, "{e}"),
        Ok(g) => panic!("expected insufficient, got {g:?}"),
    }
}

#[test]
fn sequence_4gpu_pcie() {
    // SYS { PIX {0,1}, PIX {2,3} }, 15 GiB (60 units) each.
    let mut a = node("sim-4gpu-pcie.toml");
    assert_eq!(a.usage(0).total_memory_units, 60);
    assert_eq!(alloc(&mut a, "s1", share(30, 8)), Ok(vec![0]));
    assert_eq!(
        alloc(&mut a, "s2", share(50, 8)),
        Ok(vec![0]),
        "fullest that fits"
    );
    assert_eq!(
        alloc(&mut a, "w1", whole(1)),
        Ok(vec![1]),
        "pair {{0,1}} is broken already"
    );
    assert_eq!(alloc(&mut a, "w2", whole(2)), Ok(vec![2, 3]));
    insufficient(alloc(&mut a, "s3", share(30, 8)));
    assert_eq!(
        alloc(&mut a, "s4", share(20, 44)),
        Ok(vec![0]),
        "exactly the rest of GPU0"
    );
    insufficient(alloc(&mut a, "s5", share(1, 1)));
    a.release("w2").unwrap();
    assert_eq!(alloc(&mut a, "s6", share(10, 1)), Ok(vec![2]));
    assert_eq!(alloc(&mut a, "s7", share(10, 1)), Ok(vec![2]));
    insufficient(alloc(&mut a, "w3", whole(2)));
    assert_eq!(alloc(&mut a, "w4", whole(1)), Ok(vec![3]));
    a.release("w1").unwrap();
    a.release("w4").unwrap();
    // GPUs 1 and 3 are free but in different pairs: the node-wide SYS set.
    assert_eq!(alloc(&mut a, "w5", whole(2)), Ok(vec![1, 3]));
    assert_eq!(
        a.evaluate(&share(10, 61)).unwrap_err(),
        AllocError::MemoryTooLarge {
            requested: 61,
            largest: 60
        }
    );
}

#[test]
fn sequence_8gpu_nvlink() {
    // SYS { NODE { PXB {0,1}, PXB {2,3} }, NODE { PXB {4,5}, PXB {6,7} } },
    // all pairs 12 NVLinks, 80 GiB (320 units) each.
    let mut a = node("sim-8gpu-nvlink.toml");
    assert_eq!(a.usage(0).total_memory_units, 320);
    assert_eq!(alloc(&mut a, "w1", whole(2)), Ok(vec![0, 1]));
    assert_eq!(
        alloc(&mut a, "s1", share(25, 40)),
        Ok(vec![2]),
        "an idle GPU in the broken half"
    );
    assert_eq!(alloc(&mut a, "w2", whole(4)), Ok(vec![4, 5, 6, 7]));
    assert_eq!(alloc(&mut a, "w3", whole(1)), Ok(vec![3]));
    insufficient(alloc(&mut a, "w4", whole(1)));
    insufficient(alloc(&mut a, "s2", share(80, 10)));
    assert_eq!(alloc(&mut a, "s3", share(75, 280)), Ok(vec![2]));
    a.release("w2").unwrap();
    assert_eq!(alloc(&mut a, "w5", whole(3)), Ok(vec![4, 5, 6]));
    assert_eq!(alloc(&mut a, "s4", share(50, 1)), Ok(vec![7]));
    a.release("w1").unwrap();
    assert_eq!(alloc(&mut a, "w6", whole(2)), Ok(vec![0, 1]));
    a.release("w3").unwrap();
    a.release("w5").unwrap();
    // Free: 3, 4, 5, 6. Best two: the PXB pair {4,5}, not 3 (whose pair
    // mate holds shares) with anything.
    assert_eq!(alloc(&mut a, "w7", whole(2)), Ok(vec![4, 5]));
    assert_eq!(alloc(&mut a, "w8", whole(2)), Ok(vec![3, 6]));
}

#[test]
fn sequence_16gpu() {
    // SYS { NODE { PXB { PIX{0,1}, PIX{2,3} }, PXB {4..7} }, NODE {8..15} },
    // all pairs 6 NVLinks, 32 GiB (128 units) each.
    let mut a = node("sim-16gpu.toml");
    assert_eq!(a.usage(0).total_memory_units, 128);
    assert_eq!(alloc(&mut a, "w8", whole(8)), Ok((0..8).collect()));
    assert_eq!(alloc(&mut a, "s1", share(50, 64)), Ok(vec![8]));
    assert_eq!(alloc(&mut a, "w4", whole(4)), Ok(vec![12, 13, 14, 15]));
    assert_eq!(alloc(&mut a, "w2", whole(2)), Ok(vec![10, 11]));
    assert_eq!(alloc(&mut a, "w1", whole(1)), Ok(vec![9]));
    assert_eq!(alloc(&mut a, "s2", share(50, 64)), Ok(vec![8]));
    insufficient(alloc(&mut a, "s3", share(1, 1)));
    insufficient(alloc(&mut a, "w1b", whole(1)));
    a.release("w8").unwrap();
    assert_eq!(alloc(&mut a, "s4", share(10, 1)), Ok(vec![0]));
    assert_eq!(alloc(&mut a, "w4b", whole(4)), Ok(vec![4, 5, 6, 7]));
    assert_eq!(alloc(&mut a, "w3", whole(3)), Ok(vec![1, 2, 3]));
    a.release("w4").unwrap();
    a.release("w2").unwrap();
    // Free: 10..15. One GPU: 10 and 11 are a pair in the broken quad
    // {8..11}; 12..15 is intact.
    assert_eq!(alloc(&mut a, "w1c", whole(1)), Ok(vec![10]));
    assert_eq!(alloc(&mut a, "w2b", whole(2)), Ok(vec![12, 13]));
    assert_eq!(
        alloc(&mut a, "w4c", whole(4)).unwrap_err().kind(),
        ErrorKind::Insufficient
    );
    assert_eq!(alloc(&mut a, "w3b", whole(3)), Ok(vec![11, 14, 15]));
    // Shares fill the fullest GPU first.
    for i in 0..9 {
        assert_eq!(alloc(&mut a, &format!("f{i}"), share(10, 1)), Ok(vec![0]));
    }
    assert_eq!(a.usage(0).allocated_cores, 100);
    insufficient(alloc(&mut a, "f9", share(10, 1)));
    a.release("w1").unwrap();
    assert_eq!(alloc(&mut a, "f10", share(10, 1)), Ok(vec![9]));
}

/// Max pairwise PCIe level of a set: its common ancestor's level.
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

/// For the busy set given by `mask` (half the busy GPUs hold shares, half
/// are held whole), 2- and 4-GPU requests get a set with the most links
/// any free set has, and among those one with the closest PCIe ancestor.
fn check_best_sets(a: &mut Allocator, mask: u64) {
    let n = a.topology().len();
    for g in 0..n {
        if mask & (1 << g) != 0 {
            let p = if g % 2 == 0 {
                Placement::Exclusive { gpus: vec![g] }
            } else {
                Placement::Share {
                    gpu: g,
                    cores: 10,
                    memory_units: 1,
                }
            };
            a.commit(format!("busy{g}"), &p).unwrap();
        }
    }
    let free: Vec<usize> = (0..n).filter(|g| mask & (1 << g) == 0).collect();
    for k in [2usize, 4] {
        let sets = subsets(&free, k);
        let result = a.evaluate(&whole(k as u32));
        let Some(best_links) = sets.iter().map(|s| links(a, s)).max() else {
            assert_eq!(result.unwrap_err().kind(), ErrorKind::Insufficient);
            continue;
        };
        let best_span = sets
            .iter()
            .filter(|s| links(a, s) == best_links)
            .map(|s| span(a, s))
            .min()
            .unwrap();
        let got = result.unwrap();
        let got = got.gpus();
        assert!(
            got.iter().all(|g| free.contains(g)),
            "mask {mask:b}: {got:?}"
        );
        assert_eq!(
            links(a, got),
            best_links,
            "mask {mask:b}, {k} GPUs: {got:?}"
        );
        assert_eq!(span(a, got), best_span, "mask {mask:b}, {k} GPUs: {got:?}");
    }
    for g in 0..n {
        if mask & (1 << g) != 0 {
            a.release(&format!("busy{g}")).unwrap();
        }
    }
}

#[test]
fn nvlink_8gpu_every_2_and_4_request_gets_best_bandwidth() {
    let mut a = node("sim-8gpu-nvlink.toml");
    let idle = a.usages().to_vec();
    for mask in 0..256 {
        check_best_sets(&mut a, mask);
        assert_eq!(a.usages(), idle.as_slice());
    }
}

#[test]
fn nvlink_16gpu_2_and_4_requests_get_best_sets() {
    let mut a = node("sim-16gpu.toml");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..200 {
        let mask = rng.next() & 0xffff;
        check_best_sets(&mut a, mask);
    }
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
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Per-GPU (cores, units, shares, exclusive) recomputed from the allocations.
fn recount(a: &Allocator) -> Vec<(u32, u64, u32, bool)> {
    let mut v = vec![(0, 0, 0, false); a.topology().len()];
    for (_, p) in a.allocations() {
        match p {
            Placement::Share {
                gpu,
                cores,
                memory_units,
            } => {
                v[*gpu].0 += cores;
                v[*gpu].1 += memory_units;
                v[*gpu].2 += 1;
            }
            Placement::Shares {
                gpus,
                cores,
                memory_units,
            } => {
                for &g in gpus {
                    v[g].0 += cores;
                    v[g].1 += memory_units;
                    v[g].2 += 1;
                }
            }
            Placement::Exclusive { gpus } => {
                for &g in gpus {
                    assert!(!v[g].3, "GPU{g} held whole twice");
                    v[g] = (
                        v[g].0 + 100,
                        v[g].1 + a.usage(g).total_memory_units,
                        v[g].2,
                        true,
                    );
                }
            }
            Placement::InMig { .. } => unreachable!("no shared instances on these nodes"),
        }
    }
    v
}

fn check_invariants(a: &Allocator) {
    for (g, (cores, units, shares, excl)) in recount(a).into_iter().enumerate() {
        let u = a.usage(g);
        assert!(cores <= 100, "GPU{g}: {cores} cores");
        assert!(units <= u.total_memory_units, "GPU{g}: {units} units");
        assert!(!(excl && shares > 0), "GPU{g}: whole and shared");
        assert_eq!(
            (
                u.allocated_cores,
                u.allocated_memory_units,
                u.shares,
                u.exclusive
            ),
            (cores, units, shares, excl),
            "GPU{g}: aggregates drifted from the allocations"
        );
    }
}

#[test]
fn random_sequences_keep_invariants() {
    for file in [
        "sim-4gpu-pcie.toml",
        "sim-8gpu-nvlink.toml",
        "sim-16gpu.toml",
    ] {
        let mut a = node(file);
        let idle = a.usages().to_vec();
        let n = a.topology().len() as u64;
        let max_units = a.usage(0).total_memory_units;
        let mut rng = Rng(0x1234_5678 ^ n);
        let mut live: Vec<String> = Vec::new();
        let (mut placed, mut refused) = (0, 0);
        for step in 0..3000 {
            if !live.is_empty() && rng.below(100) < 40 {
                let id = live.swap_remove(rng.below(live.len() as u64) as usize);
                let before_release = a.usages().to_vec();
                let p = a.release(&id).unwrap();
                // Putting it back lands exactly where it was.
                a.commit(id.clone(), &p).unwrap();
                a.release(&id).unwrap();
                assert_ne!(a.usages(), before_release.as_slice());
            } else {
                let req = match rng.below(12) {
                    0..=6 => share(1 + rng.below(99) as u32, 1 + rng.below(max_units / 2)),
                    7 | 8 => whole(1 + rng.below(2) as u32),
                    9 => whole(1 + rng.below(n.min(8)) as u32),
                    _ => Request::shares(
                        2 + rng.below(n.min(4) - 1) as u32,
                        1 + rng.below(60) as u32,
                        1 + rng.below(max_units / 3),
                    ),
                };
                let before = a.usages().to_vec();
                let id = format!("a{step}");
                match a.evaluate(&req) {
                    Ok(p) => {
                        assert_eq!(a.usages(), before.as_slice(), "evaluate changed state");
                        a.commit(id.clone(), &p).unwrap();
                        live.push(id.clone());
                        placed += 1;
                        // Release restores exactly.
                        a.release(&id).unwrap();
                        assert_eq!(a.usages(), before.as_slice(), "{file}: release of {p}");
                        a.commit(id, &p).unwrap();
                    }
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::Insufficient, "{file}: {req:?}: {e}");
                        assert_eq!(a.usages(), before.as_slice());
                        refused += 1;
                    }
                }
            }
            check_invariants(&a);
        }
        assert!(
            placed > 500 && refused > 50,
            "{file}: {placed} placed, {refused} refused"
        );
        for id in live {
            a.release(&id).unwrap();
        }
        assert_eq!(a.usages(), idle.as_slice(), "{file}: all released");
        assert_eq!(a.allocations().count(), 0);
    }
}

#[test]
fn render_16gpu() {
    let mut a = node("sim-16gpu.toml");
    alloc(&mut a, "w", whole(2)).unwrap();
    alloc(&mut a, "s", share(30, 16)).unwrap();
    let text = a.render();
    let uuid = |i: usize| a.topology().gpus()[i].uuid.clone();
    let first: Vec<String> = text.lines().take(6).map(String::from).collect();
    assert_eq!(
        first,
        [
            "SYS (16 GPUs, 13 whole free)".to_string(),
            "├─ NODE (8 GPUs, 5 whole free)".into(),
            "│  ├─ PXB (4 GPUs, 1 whole free)".into(),
            "│  │  ├─ PIX (2 GPUs, 0 whole free)".into(),
            format!(
                "│  │  │  ├─ GPU0 /dev/nvidia0 {}: cores 100/100 used 0 free, memory 32768/32768 MiB used 0 MiB free [whole]",
                uuid(0)
            ),
            format!(
                "│  │  │  └─ GPU1 /dev/nvidia1 {}: cores 100/100 used 0 free, memory 32768/32768 MiB used 0 MiB free [whole]",
                uuid(1)
            ),
        ],
        "{text}"
    );
    assert!(text.contains("GPU2 /dev/nvidia2"), "{text}");
    assert!(
        text.contains(
            "cores 30/100 used 70 free, memory 4096/32768 MiB used 28672 MiB free [1 share]"
        ),
        "{text}"
    );
}
