//! GPU sets, for the allocator's best-set properties (its unit tests and
//! tests/nodes.rs): every k-subset of a pool, and the NVLinks inside a set.

/// NVLink links between every pair of `set`; `count(a, b)`: the links
/// between GPUs `a` and `b` (`Topology::nvlink_count`).
pub fn links(set: &[usize], count: impl Fn(usize, usize) -> u32) -> u32 {
    let mut sum = 0;
    for (i, &x) in set.iter().enumerate() {
        for &y in &set[i + 1..] {
            sum += count(x, y);
        }
    }
    sum
}

/// Every k-subset of `pool`.
pub fn subsets(pool: &[usize], k: usize) -> Vec<Vec<usize>> {
    if k == 0 {
        return vec![vec![]];
    }
    if pool.len() < k {
        return vec![];
    }
    let mut out = subsets(&pool[1..], k - 1);
    for s in &mut out {
        s.insert(0, pool[0]);
    }
    out.extend(subsets(&pool[1..], k));
    out
}
