//! MIG geometry decisions (pure): where GPU instances go on one GPU.
//!
//! The driver says which memory-slice ranges each GPU-instance profile may
//! take (NVML's `nvmlDeviceGetGpuInstancePossiblePlacements_v2`); two
//! instances never share a slice. A node's configuration names a geometry
//! (a multiset of profiles) per GPU, and a dynamic node asks for one more
//! instance at a time. Both go through here, over what exists now:
//! instances are never destroyed while in use or when vcuda did not create
//! them, so an operator's own instances and a running pod's are safe.
//!
//! The search is exhaustive (a GPU has 8 memory slices, so at most a few
//! hundred states): a geometry that fits is always found, the profiles
//! with the fewest placements first, lowest starts first, so the same input
//! always gives the same placements.

use std::collections::BTreeMap;

/// A range of memory slices: `[start, start + size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slices {
    pub start: u32,
    pub size: u32,
}

impl Slices {
    fn mask(self) -> u64 {
        (((1u128 << self.size) - 1) << self.start) as u64
    }
}

/// One GPU's MIG shape: every profile's possible placements, by the
/// profile's id (NVML's `NVML_GPU_INSTANCE_PROFILE_*` index or the
/// driver's id: the caller's choice, used consistently).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigShape {
    pub placements: BTreeMap<u32, Vec<Slices>>,
}

/// A GPU instance that exists on the GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    pub profile: u32,
    pub slices: Slices,
    /// A process or an allocation holds it.
    pub in_use: bool,
    /// vcuda created it (an instance made by hand is never destroyed).
    pub ours: bool,
}

/// What to do to reach a geometry, in order: destroy first, then create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The existing instance at this index goes.
    Destroy(usize),
    Create {
        profile: u32,
        slices: Slices,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigPlanError {
    #[error("GPU-instance profile {0} is not one this GPU offers (it offers {1:?})")]
    UnknownProfile(u32, Vec<u32>),
    #[error(
        "profiles {want:?} do not fit beside the instances vcuda may not destroy \
         (in use or not created by vcuda: {kept:?})"
    )]
    NoFit { want: Vec<u32>, kept: Vec<Slices> },
}

/// The steps that make the GPU hold exactly `want` (profile ids, any
/// order), plus any instance that may not be destroyed. Existing instances
/// of wanted profiles are kept where the geometry allows; only idle
/// instances vcuda created are destroyed, and only when needed.
pub fn converge(
    shape: &MigShape,
    existing: &[Instance],
    want: &[u32],
) -> Result<Vec<Step>, MigPlanError> {
    for p in want {
        if !shape.placements.contains_key(p) {
            return Err(MigPlanError::UnknownProfile(
                *p,
                shape.placements.keys().copied().collect(),
            ));
        }
    }
    let movable = |i: &Instance| i.ours && !i.in_use;
    // First try: keep every existing instance a wanted profile matches.
    let mut left: Vec<u32> = want.to_vec();
    let mut keep = vec![false; existing.len()];
    for (k, inst) in existing.iter().enumerate() {
        if !movable(inst) {
            keep[k] = true;
            if let Some(at) = left.iter().position(|p| *p == inst.profile) {
                left.remove(at);
            }
        }
    }
    for (k, inst) in existing.iter().enumerate() {
        if !keep[k]
            && let Some(at) = left.iter().position(|p| *p == inst.profile)
        {
            keep[k] = true;
            left.remove(at);
        }
    }
    if let Some(steps) = plan(shape, existing, &keep, &left) {
        return Ok(steps);
    }
    // Fragmented: re-place every idle instance of ours from scratch.
    let fixed: Vec<bool> = existing.iter().map(|i| !movable(i)).collect();
    let mut left: Vec<u32> = want.to_vec();
    for inst in existing.iter().filter(|i| !movable(i)) {
        if let Some(at) = left.iter().position(|p| *p == inst.profile) {
            left.remove(at);
        }
    }
    plan(shape, existing, &fixed, &left).ok_or_else(|| MigPlanError::NoFit {
        want: want.to_vec(),
        kept: existing
            .iter()
            .filter(|i| !movable(i))
            .map(|i| i.slices)
            .collect(),
    })
}

/// Where one more instance of `profile` goes beside the existing ones
/// (none destroyed); `None` when it does not fit. Of the free placements,
/// the one that leaves the most placements of every profile in `shape`
/// free (then the highest start): instances made one at a time would
/// otherwise fill a GPU from slice 0 and shut out the large profiles that
/// can only start there (on an H100, a 1g.10gb at slice 0 rules out the
/// 4g.40gb and the 7g.80gb; at slice 6, only the 7g.80gb and the second
/// 3g.40gb).
pub fn place_one(shape: &MigShape, existing: &[Instance], profile: u32) -> Option<Slices> {
    let used = existing.iter().fold(0, |m, i| m | i.slices.mask());
    let free_after = |taken: u64| {
        let all = shape.placements.values().flatten();
        all.filter(|s| s.mask() & taken == 0).count()
    };
    let mut best: Option<(usize, Slices)> = None;
    for &s in shape.placements.get(&profile)? {
        if s.mask() & used != 0 {
            continue;
        }
        let left = free_after(used | s.mask());
        // Ties: the highest start (large profiles start low).
        if best.is_none_or(|(b, _)| left >= b) {
            best = Some((left, s));
        }
    }
    best.map(|(_, s)| s)
}

/// Steps keeping the instances `keep` marks and placing `left` around them.
fn plan(shape: &MigShape, existing: &[Instance], keep: &[bool], left: &[u32]) -> Option<Vec<Step>> {
    let used = existing
        .iter()
        .zip(keep)
        .filter(|(_, k)| **k)
        .fold(0, |m, (i, _)| m | i.slices.mask());
    // The most constrained first: the fewest placements, the largest.
    let mut order = left.to_vec();
    let ways = |p: &u32| shape.placements[p].len();
    let size = |p: &u32| shape.placements[p].first().map_or(0, |s| s.size);
    order.sort_by_key(|p| (ways(p), std::cmp::Reverse(size(p)), *p));
    let mut chosen = Vec::with_capacity(order.len());
    if !search(shape, &order, used, &mut chosen) {
        return None;
    }
    let mut steps: Vec<Step> = keep
        .iter()
        .enumerate()
        .filter(|(_, k)| !**k)
        .map(|(i, _)| Step::Destroy(i))
        .collect();
    steps.extend(
        order
            .iter()
            .zip(chosen)
            .map(|(&profile, slices)| Step::Create { profile, slices }),
    );
    Some(steps)
}

/// Depth-first: a placement for each of `order` in turn, none overlapping
/// `used` or each other.
fn search(shape: &MigShape, order: &[u32], used: u64, chosen: &mut Vec<Slices>) -> bool {
    let Some((first, rest)) = order.split_first() else {
        return true;
    };
    for &s in &shape.placements[first] {
        if s.mask() & used != 0 {
            continue;
        }
        chosen.push(s);
        if search(shape, rest, used | s.mask(), chosen) {
            return true;
        }
        chosen.pop();
    }
    false
}

#[cfg(test)]
mod tests;
