//! Dynamic MIG in device-plugin mode (issue 36, pure): the GPUs named in
//! `--mig-dynamic` are re-partitioned toward the MIG devices pods need.
//! Device plugins cannot publish possible placements the way DRA's
//! partitionable devices do: the kubelet and the scheduler only ever see
//! instances that exist. So the manager makes them ahead of the scheduler:
//! a pod no node can take for want of a `<prefix><profile>` device
//! ([`super::demand`]) gets an instance made in free memory slices of an
//! idle part of a dynamic GPU, the plugin advertises it, and the
//! scheduler's next try places the pod.
//!
//! Nothing in use moves: only instances vcuda made, that no pod holds and
//! no process runs on, and that have been free for a grace period (a pod
//! bound but not yet admitted holds nothing yet) are destroyed, and only
//! when more of their profile exist than pods need. Instances are never
//! moved to defragment: a profile that fits nowhere waits for instances
//! to be freed.

use std::collections::BTreeMap;

use gpu_allocator::mig::{self as plan, MigShape, Slices};
use node_agent::geometry::GiProfile;

/// A `--mig-dynamic` GPU as it is now.
#[derive(Debug, Clone)]
pub struct DynGpu {
    pub index: usize,
    pub profiles: Vec<GiProfile>,
    pub instances: Vec<DynInstance>,
}

/// A GPU instance on a dynamic GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynInstance {
    pub gi: u32,
    pub profile: u32,
    pub slices: Slices,
    /// A pod holds it or a process runs on it.
    pub in_use: bool,
    /// vcuda made it (the record beside the state).
    pub ours: bool,
    /// Free for longer than the grace period.
    pub settled: bool,
}

/// One step toward the demand, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Destroy {
        gpu: usize,
        gi: u32,
        profile: String,
    },
    Create {
        gpu: usize,
        profile: u32,
        name: String,
        slices: Slices,
    },
}

/// What [`decide`] found: the steps, and each profile still short
/// (needed, fitting nowhere now).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    pub actions: Vec<Action>,
    pub unplaced: BTreeMap<String, usize>,
}

fn name_of(g: &DynGpu, id: u32) -> Option<&str> {
    g.profiles
        .iter()
        .find(|p| p.id == id)
        .map(|p| p.name.as_str())
}

/// The steps that bring the dynamic GPUs toward `needed` (profile name →
/// MIG devices pods need on this node), given `existing` (profile name →
/// instances of it on the node, dynamic GPUs or not): surplus instances
/// that may go are destroyed first, then each missing one is made where it
/// first fits, the largest profiles first (they have the fewest places).
pub fn decide(
    gpus: &[DynGpu],
    needed: &BTreeMap<String, usize>,
    existing: &BTreeMap<String, usize>,
) -> Decision {
    let mut gpus: Vec<DynGpu> = gpus.to_vec();
    let mut d = Decision::default();
    let mut count = existing.clone();
    // Surplus: more of a profile than pods need, idle, ours, settled.
    for g in &mut gpus {
        let mut kept = Vec::with_capacity(g.instances.len());
        for i in std::mem::take(&mut g.instances) {
            let name = name_of(g, i.profile).unwrap_or_default().to_string();
            let have = count.get(&name).copied().unwrap_or(0);
            let want = needed.get(&name).copied().unwrap_or(0);
            if i.ours && i.settled && !i.in_use && have > want {
                count.insert(name.clone(), have - 1);
                d.actions.push(Action::Destroy {
                    gpu: g.index,
                    gi: i.gi,
                    profile: name,
                });
            } else {
                kept.push(i);
            }
        }
        g.instances = kept;
    }
    let mut short: Vec<(String, usize)> = needed
        .iter()
        .map(|(p, n)| {
            (
                p.clone(),
                n.saturating_sub(count.get(p).copied().unwrap_or(0)),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    let size = |p: &str| {
        gpus.iter()
            .flat_map(|g| &g.profiles)
            .find(|q| q.name == p)
            .and_then(|q| q.placements.first())
            .map_or(0, |s| s.size)
    };
    short.sort_by_key(|(p, _)| (std::cmp::Reverse(size(p)), p.clone()));
    for (name, n) in short {
        for placed in 0..n {
            if !place(&mut gpus, &name, &mut d.actions) {
                d.unplaced.insert(name.clone(), n - placed);
                break;
            }
        }
    }
    d
}

/// Makes one `name` on the first dynamic GPU it fits; false when none.
fn place(gpus: &mut [DynGpu], name: &str, actions: &mut Vec<Action>) -> bool {
    for g in gpus.iter_mut() {
        let Some(p) = g.profiles.iter().find(|p| p.name == name) else {
            continue;
        };
        // Every profile's placements: where it goes is judged by what it
        // leaves for the others.
        let shape = MigShape {
            placements: g
                .profiles
                .iter()
                .map(|q| (q.id, q.placements.clone()))
                .collect(),
        };
        let existing: Vec<plan::Instance> = g
            .instances
            .iter()
            .map(|i| plan::Instance {
                profile: i.profile,
                slices: i.slices,
                in_use: true,
                ours: false,
            })
            .collect();
        if let Some(slices) = plan::place_one(&shape, &existing, p.id) {
            let profile = p.id;
            actions.push(Action::Create {
                gpu: g.index,
                profile,
                name: name.to_string(),
                slices,
            });
            g.instances.push(DynInstance {
                gi: u32::MAX,
                profile,
                slices,
                in_use: true,
                ours: true,
                settled: false,
            });
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// H100 80GB's GPU-instance profiles and placements (NVIDIA's MIG user
    /// guide, "H100 MIG Profiles"; ids as `nvmlDeviceGetGpuInstanceProfileInfo`
    /// gives them, the simulator's table).
    fn h100(index: usize) -> DynGpu {
        let p = |id, name: &str, size, starts: &[u32]| GiProfile {
            id,
            name: name.into(),
            placements: starts.iter().map(|&start| Slices { start, size }).collect(),
        };
        DynGpu {
            index,
            profiles: vec![
                p(19, "1g.10gb", 1, &[0, 1, 2, 3, 4, 5, 6]),
                p(14, "2g.20gb", 2, &[0, 2, 4]),
                p(9, "3g.40gb", 4, &[0, 4]),
                p(5, "4g.40gb", 4, &[0]),
                p(0, "7g.80gb", 8, &[0]),
            ],
            instances: Vec::new(),
        }
    }

    fn inst(gi: u32, profile: u32, start: u32, size: u32) -> DynInstance {
        DynInstance {
            gi,
            profile,
            slices: Slices { start, size },
            in_use: false,
            ours: true,
            settled: true,
        }
    }

    fn map(v: &[(&str, usize)]) -> BTreeMap<String, usize> {
        v.iter().map(|(p, n)| (p.to_string(), *n)).collect()
    }

    fn creates(d: &Decision) -> Vec<(usize, &str, u32)> {
        d.actions
            .iter()
            .filter_map(|a| match a {
                Action::Create {
                    gpu, name, slices, ..
                } => Some((*gpu, name.as_str(), slices.start)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_needed_profile_is_made_where_it_leaves_most_and_overlaps_nothing() {
        // The first 3g.40gb at slice 4 (the 4g.40gb, which starts only at
        // 0, still fits beside it), the second at 0, a third nowhere.
        let d = decide(&[h100(0)], &map(&[("3g.40gb", 3)]), &map(&[]));
        assert_eq!(creates(&d), [(0, "3g.40gb", 4), (0, "3g.40gb", 0)]);
        assert_eq!(d.unplaced, map(&[("3g.40gb", 1)]));
        // The two made already count: nothing more to do, nothing to undo.
        let mut g = h100(0);
        g.instances = vec![inst(1, 9, 0, 4), inst(2, 9, 4, 4)];
        let d = decide(&[g], &map(&[("3g.40gb", 2)]), &map(&[("3g.40gb", 2)]));
        assert_eq!(d, Decision::default());
    }

    #[test]
    fn the_largest_profile_is_placed_first_and_the_next_gpu_takes_what_does_not_fit() {
        let d = decide(
            &[h100(0), h100(1)],
            &map(&[("1g.10gb", 1), ("7g.80gb", 1)]),
            &map(&[]),
        );
        assert_eq!(creates(&d), [(0, "7g.80gb", 0), (1, "1g.10gb", 6)]);
        assert!(d.unplaced.is_empty());
    }

    #[test]
    fn an_instance_in_use_or_an_operators_or_a_fresh_one_is_never_destroyed() {
        let mut held = inst(1, 9, 0, 4);
        held.in_use = true;
        let mut foreign = inst(2, 19, 4, 1);
        foreign.ours = false;
        let mut fresh = inst(3, 19, 5, 1);
        fresh.settled = false;
        let mut g = h100(0);
        g.instances = vec![held, foreign, fresh];
        // Nobody needs any of them, and a 7g.80gb is wanted: it waits.
        let d = decide(
            &[g],
            &map(&[("7g.80gb", 1)]),
            &map(&[("3g.40gb", 1), ("1g.10gb", 2)]),
        );
        assert!(d.actions.is_empty(), "{d:?}");
        assert_eq!(d.unplaced, map(&[("7g.80gb", 1)]));
    }

    #[test]
    fn idle_surplus_of_ours_is_destroyed_and_its_room_given_to_what_is_needed() {
        let mut g = h100(0);
        g.instances = vec![inst(1, 9, 0, 4), inst(2, 9, 4, 4)];
        // One 3g.40gb still needed (a pod holds none yet), the other not;
        // a 2g.20gb wanted goes into the surplus one's (the first's) room.
        let d = decide(
            &[g],
            &map(&[("3g.40gb", 1), ("2g.20gb", 1)]),
            &map(&[("3g.40gb", 2)]),
        );
        assert_eq!(
            d.actions,
            [
                Action::Destroy {
                    gpu: 0,
                    gi: 1,
                    profile: "3g.40gb".into()
                },
                Action::Create {
                    gpu: 0,
                    profile: 14,
                    name: "2g.20gb".into(),
                    slices: Slices { start: 2, size: 2 }
                }
            ]
        );
    }

    #[test]
    fn instances_elsewhere_on_the_node_count_toward_the_need() {
        // A static GPU's free 1g.10gb serves the one pod needing one.
        let d = decide(&[h100(0)], &map(&[("1g.10gb", 1)]), &map(&[("1g.10gb", 1)]));
        assert_eq!(d, Decision::default());
    }

    #[test]
    fn a_profile_a_gpu_does_not_offer_is_unplaced() {
        let d = decide(&[h100(0)], &map(&[("1g.12gb", 1)]), &map(&[]));
        assert!(d.actions.is_empty());
        assert_eq!(d.unplaced, map(&[("1g.12gb", 1)]));
    }
}
