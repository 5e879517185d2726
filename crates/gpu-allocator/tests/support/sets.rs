//! GPU-set helpers for the best-set properties. Shared by the unit tests
//! (src/tests.rs) and tests/nodes.rs (`#[path]` modules); the including
//! module has `Allocator` in scope.

use super::Allocator;

/// NVLink links between every pair of `set`.
pub fn links(a: &Allocator, set: &[usize]) -> u32 {
    let t = a.topology();
    let mut sum = 0;
    for (i, &x) in set.iter().enumerate() {
        for &y in &set[i + 1..] {
            sum += t.nvlink_count(x, y);
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
