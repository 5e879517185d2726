//! Choosing GPUs: the ranking of GPU sets (whole GPUs, and shares on
//! several GPUs) and the fragmentation measure that shares also use to
//! break ties.

use std::cmp::Reverse;

use crate::topology::{PcieLevel, Topology};

/// Above this many candidate sets the exhaustive search gives way to a
/// greedy one (C(16,8) = 12,870 is still exhaustive, so every node up to
/// 16 GPUs gets the exact best set).
pub(crate) const EXHAUSTIVE_LIMIT: u64 = 20_000;

/// Free counts of the groups holding something, one per PCIe level
/// (closest first); see [`Fragmentation::of_group`].
pub(crate) type Chain = [usize; 6];

/// Free whole GPUs per tree group, for the fragmentation tie-breakers.
pub(crate) struct Fragmentation<'a> {
    topo: &'a Topology,
    group_free: Vec<usize>,
}

impl<'a> Fragmentation<'a> {
    pub(crate) fn new(topo: &'a Topology, free: &[bool]) -> Self {
        let group_free = topo
            .tree()
            .groups()
            .iter()
            .map(|g| g.gpus.iter().filter(|&&i| free[i]).count())
            .collect();
        Fragmentation { topo, group_free }
    }

    /// For each level at or above the group's own: how many whole GPUs are
    /// free in the cluster at that level holding the group. Smaller means a
    /// more fragmented neighbourhood; taking GPUs there keeps intact groups
    /// intact. Levels below the group's own are 0 (equal for all groups of
    /// one level, which is all this is compared between).
    pub(crate) fn of_group(&self, group: usize) -> Chain {
        let tree = self.topo.tree();
        let mut chain = [0; 6];
        let mut g = group;
        for (slot, level) in chain.iter_mut().zip(PcieLevel::ALL) {
            if level < tree.group(group).level {
                continue;
            }
            while let Some(p) = tree.group(g).parent {
                if tree.group(p).level > level {
                    break;
                }
                g = p;
            }
            *slot = self.group_free[g];
        }
        chain
    }

    /// The same for one (free) GPU: below its parent's level it stands alone.
    pub(crate) fn of_gpu(&self, gpu: usize) -> Chain {
        let tree = self.topo.tree();
        let parent = tree.parent_of_gpu(gpu);
        let mut chain = self.of_group(parent);
        for (slot, level) in chain.iter_mut().zip(PcieLevel::ALL) {
            if level < tree.group(parent).level {
                *slot = 1;
            }
        }
        chain
    }
}

/// Free capacity a GPU would keep (cores, memory units), summed over a
/// set: the fullest set packs shares tightest. All zero for whole GPUs,
/// where it must not rank anything.
pub(crate) type Fill = (u64, u64);

/// Ranking of a GPU set; smaller is better:
/// most NVLink links inside the set, then the closest PCIe common ancestor,
/// then the smallest sum of pairwise PCIe levels, then the least free
/// capacity left (shares only), then the most fragmented neighbourhood.
/// Equal keys go to the lowest indices (enumeration order).
type Key = (Reverse<u64>, usize, u64, Fill, Chain);

fn fill_of(fill: &[Fill], set: &[usize]) -> Fill {
    set.iter()
        .fold((0, 0), |(c, u), &g| (c + fill[g].0, u + fill[g].1))
}

fn key(topo: &Topology, frag: &Fragmentation<'_>, fill: &[Fill], set: &[usize]) -> Key {
    if let [gpu] = set {
        return (Reverse(0), 0, 0, fill[*gpu], frag.of_gpu(*gpu));
    }
    let tree = topo.tree();
    let mut links = 0u64;
    let mut pcie = 0u64;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            links += u64::from(topo.nvlink_count(a, b));
            pcie += topo.pcie_level(a, b) as u64;
        }
    }
    let lca = set[1..].iter().fold(tree.parent_of_gpu(set[0]), |acc, &g| {
        tree.lca(acc, tree.parent_of_gpu(g))
    });
    (
        Reverse(links),
        tree.group(lca).level.rank() + 1,
        pcie,
        fill_of(fill, set),
        frag.of_group(lca),
    )
}

/// The best `n` GPUs out of the fully free ones (`free[i]`), or `None` when
/// fewer than `n` are free.
pub(crate) fn whole_gpus(topo: &Topology, free: &[bool], n: usize) -> Option<Vec<usize>> {
    let pool: Vec<usize> = (0..free.len()).filter(|&i| free[i]).collect();
    best_set(topo, free, &pool, &vec![(0, 0); free.len()], n)
}

/// The best `n` GPUs out of `pool`. Whole GPUs: the fully free ones, no
/// fill. Shares on several GPUs: the GPUs with room for one, `fill[i]` what
/// GPU `i` keeps free after its share, so among equally connected sets the
/// fullest wins. `free`: the fully free GPUs, for the fragmentation
/// tie-breaker.
pub(crate) fn best_set(
    topo: &Topology,
    free: &[bool],
    pool: &[usize],
    fill: &[Fill],
    n: usize,
) -> Option<Vec<usize>> {
    if n == 0 || pool.len() < n {
        return None;
    }
    let frag = Fragmentation::new(topo, free);
    let ctx = Ctx {
        topo,
        frag: &frag,
        fill,
    };
    if combinations(pool.len() as u64, n as u64) <= EXHAUSTIVE_LIMIT {
        Some(exhaustive(&ctx, pool, n))
    } else {
        Some(greedy(&ctx, pool, n))
    }
}

/// What ranking a set needs besides the set.
struct Ctx<'a> {
    topo: &'a Topology,
    frag: &'a Fragmentation<'a>,
    fill: &'a [Fill],
}

fn exhaustive(ctx: &Ctx<'_>, pool: &[usize], n: usize) -> Vec<usize> {
    let (topo, frag, fill) = (ctx.topo, ctx.frag, ctx.fill);
    if n == 1 {
        // Strictly better only, so ties stay with the lowest index.
        let mut best = (key(topo, frag, fill, &pool[..1]), pool[0]);
        for &g in &pool[1..] {
            let k = key(topo, frag, fill, &[g]);
            if k < best.0 {
                best = (k, g);
            }
        }
        return vec![best.1];
    }
    let mut search = Search {
        topo,
        pool,
        fill,
        n,
        chains: (0..topo.tree().groups().len())
            .map(|g| frag.of_group(g))
            .collect(),
        set: Vec::with_capacity(n),
        best: None,
    };
    search.descend(0, (0, 0), (0, 0), None);
    search.best.expect("pool holds at least n GPUs").1
}

/// Depth-first over all n-subsets in lexicographic order, carrying the
/// link, PCIe and fill sums and the common ancestor of the prefix, so each
/// set costs O(n) instead of O(n^2).
struct Search<'a> {
    topo: &'a Topology,
    pool: &'a [usize],
    fill: &'a [Fill],
    n: usize,
    chains: Vec<Chain>,
    set: Vec<usize>,
    best: Option<(Key, Vec<usize>)>,
}

impl Search<'_> {
    /// `sums`: (links, PCIe levels) of the prefix; `fill`: its free capacity.
    fn descend(&mut self, start: usize, sums: (u64, u64), fill: Fill, lca: Option<usize>) {
        let tree = self.topo.tree();
        let (links, pcie) = sums;
        if self.set.len() == self.n {
            let lca = lca.expect("n >= 1");
            let k = (
                Reverse(links),
                tree.group(lca).level.rank() + 1,
                pcie,
                fill,
                self.chains[lca],
            );
            // Strictly better only, so ties stay with the lowest indices.
            if self.best.as_ref().is_none_or(|(b, _)| k < *b) {
                self.best = Some((k, self.set.clone()));
            }
            return;
        }
        let last = self.pool.len() - (self.n - self.set.len());
        for i in start..=last {
            let g = self.pool[i];
            let (mut dl, mut dp) = (0u64, 0u64);
            for &s in &self.set {
                dl += u64::from(self.topo.nvlink_count(s, g));
                dp += self.topo.pcie_level(s, g) as u64;
            }
            let parent = tree.parent_of_gpu(g);
            let lca = Some(lca.map_or(parent, |l| tree.lca(l, parent)));
            let f = (fill.0 + self.fill[g].0, fill.1 + self.fill[g].1);
            self.set.push(g);
            self.descend(i + 1, (links + dl, pcie + dp), f, lca);
            self.set.pop();
        }
    }
}

/// For large nodes: grow a set from every free GPU, each step adding the
/// GPU with the most links to the set (then the closest by PCIe), and keep
/// the best-ranked result.
fn greedy(ctx: &Ctx<'_>, pool: &[usize], n: usize) -> Vec<usize> {
    let (topo, frag, fill) = (ctx.topo, ctx.frag, ctx.fill);
    let mut best: Option<(Key, Vec<usize>)> = None;
    for &seed in pool {
        let mut set = vec![seed];
        while set.len() < n {
            let next = pool
                .iter()
                .copied()
                .filter(|c| !set.contains(c))
                .min_by_key(|&c| {
                    let links: u64 = set
                        .iter()
                        .map(|&s| u64::from(topo.nvlink_count(s, c)))
                        .sum();
                    let pcie: u64 = set.iter().map(|&s| topo.pcie_level(s, c) as u64).sum();
                    (Reverse(links), pcie, c)
                })
                .expect("pool holds at least n GPUs");
            set.push(next);
        }
        set.sort_unstable();
        let k = key(topo, frag, fill, &set);
        if best.as_ref().is_none_or(|(bk, bs)| (&k, &set) < (bk, bs)) {
            best = Some((k, set));
        }
    }
    best.expect("pool is not empty").1
}

fn combinations(n: u64, k: u64) -> u64 {
    let k = k.min(n - k);
    let mut c: u64 = 1;
    for i in 0..k {
        c = c.saturating_mul(n - i) / (i + 1);
        if c > EXHAUSTIVE_LIMIT {
            return u64::MAX;
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combination_counts() {
        assert_eq!(combinations(16, 8), 12_870);
        assert_eq!(combinations(4, 4), 1);
        assert_eq!(combinations(5, 0), 1);
        assert_eq!(combinations(64, 32), u64::MAX);
    }
}
