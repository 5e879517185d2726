//! H100 80GB's GPU-instance placements, from NVIDIA's MIG user guide
//! (docs.nvidia.com/datacenter/tesla/mig-user-guide, "H100 MIG Profiles":
//! 1g.10gb {0..6}:1, 1g.20gb {0,2,4,6}:2, 2g.20gb {0,2,4}:2,
//! 3g.40gb {0,4}:4, 4g.40gb {0}:4, 7g.80gb {0}:8); the profile ids are
//! NVML's `NVML_GPU_INSTANCE_PROFILE_*` indices (nvml.h).

use super::*;

const G1: u32 = 0; // 1g.10gb
const G1X2: u32 = 7; // 1g.20gb (1_SLICE_REV1)
const G2: u32 = 1; // 2g.20gb
const G3: u32 = 2; // 3g.40gb
const G4: u32 = 3; // 4g.40gb
const G7: u32 = 4; // 7g.80gb

fn s(start: u32, size: u32) -> Slices {
    Slices { start, size }
}

fn h100() -> MigShape {
    let at = |starts: &[u32], size| starts.iter().map(|&st| s(st, size)).collect();
    MigShape {
        placements: BTreeMap::from([
            (G1, at(&[0, 1, 2, 3, 4, 5, 6], 1)),
            (G1X2, at(&[0, 2, 4, 6], 2)),
            (G2, at(&[0, 2, 4], 2)),
            (G3, at(&[0, 4], 4)),
            (G4, at(&[0], 4)),
            (G7, at(&[0], 8)),
        ]),
    }
}

fn inst(profile: u32, slices: Slices, in_use: bool, ours: bool) -> Instance {
    Instance {
        profile,
        slices,
        in_use,
        ours,
    }
}

fn created(steps: &[Step]) -> Vec<(u32, Slices)> {
    steps
        .iter()
        .filter_map(|st| match st {
            Step::Create { profile, slices } => Some((*profile, *slices)),
            Step::Destroy(_) => None,
        })
        .collect()
}

#[test]
fn geometries_the_guide_lists_fit_on_an_empty_gpu() {
    let g = h100();
    assert_eq!(
        created(&converge(&g, &[], &[G3, G3]).unwrap()),
        [(G3, s(0, 4)), (G3, s(4, 4))]
    );
    assert_eq!(
        created(&converge(&g, &[], &[G3, G4]).unwrap()),
        [(G4, s(0, 4)), (G3, s(4, 4))]
    );
    let seven = converge(&g, &[], &[G1; 7]).unwrap();
    assert_eq!(
        created(&seven)
            .iter()
            .map(|c| c.1.start)
            .collect::<Vec<_>>(),
        [0, 1, 2, 3, 4, 5, 6]
    );
    // The first choice (3g at 0) leaves the two 1g no room: backtracked.
    assert_eq!(
        created(&converge(&g, &[], &[G1, G2, G3, G1]).unwrap()),
        [(G3, s(4, 4)), (G2, s(0, 2)), (G1, s(2, 1)), (G1, s(3, 1))]
    );
}

#[test]
fn what_does_not_fit_is_refused_with_what_was_asked() {
    let g = h100();
    // Eight 1g: slice 7 takes no 1g.
    assert!(matches!(
        converge(&g, &[], &[G1; 8]),
        Err(MigPlanError::NoFit { .. })
    ));
    assert!(converge(&g, &[], &[G7, G1]).is_err());
    let e = converge(&g, &[], &[42]).unwrap_err();
    assert!(e.to_string().contains("profile 42"), "{e}");
}

#[test]
fn instances_in_use_or_not_ours_are_never_destroyed() {
    let g = h100();
    // A running pod's 1g at 0 blocks the only 4g placement.
    let busy = [inst(G1, s(0, 1), true, true)];
    let e = converge(&g, &busy, &[G4]).unwrap_err();
    assert_eq!(
        e,
        MigPlanError::NoFit {
            want: vec![G4],
            kept: vec![s(0, 1)]
        }
    );
    // An operator's idle instance: the same.
    let theirs = [inst(G1, s(0, 1), false, false)];
    assert!(converge(&g, &theirs, &[G4]).is_err());
    // ...but a geometry around it is fine, and it stays.
    let steps = converge(&g, &theirs, &[G3]).unwrap();
    assert_eq!(
        steps,
        [Step::Create {
            profile: G3,
            slices: s(4, 4)
        }]
    );
    // Ours and idle: destroyed for the 4g.
    let idle = [inst(G1, s(0, 1), false, true)];
    assert_eq!(
        converge(&g, &idle, &[G4]).unwrap(),
        [
            Step::Destroy(0),
            Step::Create {
                profile: G4,
                slices: s(0, 4)
            }
        ]
    );
}

#[test]
fn a_geometry_already_there_takes_no_step_and_fragmentation_is_undone() {
    let g = h100();
    let there = [
        inst(G3, s(0, 4), true, true),
        inst(G3, s(4, 4), false, true),
    ];
    assert_eq!(converge(&g, &there, &[G3, G3]).unwrap(), []);
    // An idle 3g at 0 kept would leave the 4g no room: re-placed.
    let frag = [inst(G3, s(0, 4), false, true)];
    assert_eq!(
        converge(&g, &frag, &[G3, G4]).unwrap(),
        [
            Step::Destroy(0),
            Step::Create {
                profile: G4,
                slices: s(0, 4)
            },
            Step::Create {
                profile: G3,
                slices: s(4, 4)
            },
        ]
    );
    // In use, it stays where it is, and the 4g cannot be had.
    let held = [inst(G3, s(0, 4), true, true)];
    assert!(converge(&g, &held, &[G3, G4]).is_err());
}

/// One more instance goes where it shuts out the fewest placements: on an
/// empty H100 a 1g.10gb at slice 6 (leaving the 4g.40gb and a 3g.40gb at
/// 0, which the first free placement, slice 0, would not), the next ones
/// filling from the end; beside a 3g.40gb at 0, slice 6 again (a 2g.20gb
/// still fits at 4).
#[test]
fn one_more_instance_goes_where_it_shuts_out_the_fewest_placements() {
    let g = h100();
    assert_eq!(place_one(&g, &[], G1), Some(s(6, 1)));
    let mut there = vec![];
    for want in [6, 5, 4] {
        let at = place_one(&g, &there, G1).unwrap();
        assert_eq!(at, s(want, 1), "{there:?}");
        there.push(inst(G1, at, true, true));
    }
    assert_eq!(place_one(&g, &there, G4), Some(s(0, 4)));
    assert_eq!(place_one(&g, &there, G3), Some(s(0, 4)));

    let there = [inst(G3, s(0, 4), true, true)];
    assert_eq!(place_one(&g, &there, G1), Some(s(6, 1)));
    let with_1g = [there[0].clone(), inst(G1, s(6, 1), true, true)];
    assert_eq!(place_one(&g, &with_1g, G2), Some(s(4, 2)));
    assert_eq!(place_one(&g, &there, G3), Some(s(4, 4)));
    assert_eq!(place_one(&g, &there, G4), None);
    assert_eq!(place_one(&g, &there, 42), None);
    let full = [inst(G7, s(0, 8), false, true)];
    assert_eq!(place_one(&g, &full, G1), None);
}

/// Every multiset of up to four H100 profiles: `converge` finds placements
/// exactly when some choice of one placement per instance has no overlap
/// (checked by trying every combination), and what it finds never
/// overlaps.
#[test]
fn the_search_is_complete_and_never_overlaps() {
    let g = h100();
    let ids: Vec<u32> = g.placements.keys().copied().collect();
    // Non-decreasing sequences of ids: each multiset once.
    let mut wants: Vec<Vec<u32>> = vec![vec![]];
    let mut frontier = wants.clone();
    for _ in 0..4 {
        frontier = frontier
            .iter()
            .flat_map(|w| {
                ids.iter()
                    .filter(|&&p| w.last().is_none_or(|&l| p >= l))
                    .map(move |&p| [w.as_slice(), &[p]].concat())
            })
            .collect();
        wants.extend(frontier.iter().cloned());
    }
    let fits = |w: &[u32]| -> bool {
        // Every combination of placements, by counting in mixed radix.
        let lens: Vec<usize> = w.iter().map(|p| g.placements[p].len()).collect();
        let total: usize = lens.iter().product();
        (0..total).any(|mut n| {
            let mut used = 0u64;
            w.iter().zip(&lens).all(|(p, &len)| {
                let sl = g.placements[p][n % len];
                n /= len;
                let m = ((1u64 << sl.size) - 1) << sl.start;
                let free = used & m == 0;
                used |= m;
                free
            })
        })
    };
    let mut checked = 0;
    for w in &wants {
        match converge(&g, &[], w) {
            Ok(steps) => {
                let c = created(&steps);
                assert_eq!(c.len(), w.len(), "{w:?}");
                let mut used = 0u64;
                for (p, sl) in c {
                    assert!(g.placements[&p].contains(&sl), "{w:?}: {sl:?}");
                    assert_eq!(used & sl.mask(), 0, "{w:?}: overlap at {sl:?}");
                    used |= sl.mask();
                }
                assert!(fits(w), "{w:?} placed but no combination fits");
            }
            Err(_) => assert!(!fits(w), "{w:?} refused but a combination fits"),
        }
        checked += 1;
    }
    assert!(checked > 100, "{checked}");
}
