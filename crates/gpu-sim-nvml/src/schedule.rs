//! When the simulated driver takes its per-process utilization samples,
//! as a real one does: a nominal period (`SAMPLE_NS`) whose boundaries
//! wander by up to a fifth of it, each sample published some tens of
//! milliseconds after its period ends, and now and then a period skipped,
//! its time folded into the next sample. All of it derives from the period's
//! index, so every process sees the same schedule.

use crate::procs::SAMPLE_NS;

/// Most a boundary comes after its nominal time.
const JITTER_NS: u64 = SAMPLE_NS / 5;
/// A sample is published this long after its period ends, plus up to
/// `LATE_SPREAD_NS` more.
const LATE_NS: u64 = 10_000_000;
const LATE_SPREAD_NS: u64 = 50_000_000;
/// One period in this many is skipped.
const SKIP_ONE_IN: u64 = 11;

fn mix(gpu: usize, k: u64, salt: u64) -> u64 {
    // splitmix64 of (period, GPU, what is asked).
    let mut z = k
        .wrapping_add((gpu as u64) << 48)
        .wrapping_add(salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// End of period `k` (CLOCK_MONOTONIC ns).
pub(crate) fn boundary(gpu: usize, k: u64) -> u64 {
    k * SAMPLE_NS + mix(gpu, k, 1) % JITTER_NS
}

/// When the sample of period `k` can be read.
pub(crate) fn published(gpu: usize, k: u64) -> u64 {
    boundary(gpu, k) + LATE_NS + mix(gpu, k, 2) % LATE_SPREAD_NS
}

/// Whether the driver skips period `k` (its time goes into the next one).
pub(crate) fn skipped(gpu: usize, k: u64) -> bool {
    mix(gpu, k, 3).is_multiple_of(SKIP_ONE_IN)
}

/// The window the sample ending period `k` covers: back to the last
/// period not skipped (at most three back).
pub(crate) fn window(gpu: usize, k: u64) -> (u64, u64) {
    let mut j = k.saturating_sub(1);
    while j + 3 > k && j > 0 && skipped(gpu, j) {
        j -= 1;
    }
    (boundary(gpu, j), boundary(gpu, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_wander_arrive_late_and_sometimes_skip() {
        let ks = 1000..3000u64;
        let skips = ks.clone().filter(|&k| skipped(0, k)).count();
        assert!((100..300).contains(&skips), "{skips}");
        for k in ks {
            let (from, to) = window(0, k);
            assert!(from < to && to - from <= 4 * SAMPLE_NS);
            assert!(to >= k * SAMPLE_NS && to < k * SAMPLE_NS + JITTER_NS);
            let late = published(0, k) - to;
            assert!((LATE_NS..LATE_NS + LATE_SPREAD_NS).contains(&late));
            if !skipped(0, k - 1) {
                assert_eq!(from, boundary(0, k - 1));
            }
        }
        assert_ne!(boundary(0, 5), boundary(1, 5), "GPUs sample apart");
    }
}
