//! When the simulated driver takes its per-process utilization samples.
//! By default on a grid of `SAMPLE_NS`, each published as its period ends.
//! A node's `[nvml_sampling]` makes it a real driver's schedule: period ends
//! that wander after their nominal time, samples published some tens of
//! milliseconds late, and now and then a period skipped, its time folded
//! into the next sample. All of it derives from the period's index, so every
//! process sees the same schedule.
//!
//! Readers that take the shortest gap between samples for the period read
//! low by the wander's share of a period, and by a period's share whenever
//! a skipped one is folded: gpu-display's sampler showed 19.7 % for a
//! process the timeline had at 25.2 % with 20 ms of wander and one period
//! in 11 skipped, until it weighted each sample by its own window. Every
//! sample node in config/nodes/ samples this way.
//!
//! Device utilization has a window of its own (`NvmlSampling::device_window`).

use crate::procs::SAMPLE_NS;
use gpu_sim_core::NvmlSampling;

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
pub(crate) fn boundary(s: &NvmlSampling, gpu: usize, k: u64) -> u64 {
    k * SAMPLE_NS + mix(gpu, k, 1).checked_rem(s.wander_ns).unwrap_or(0)
}

/// When the sample of period `k` can be read: between a fifth of the
/// configured lateness and all of it after the period ends.
pub(crate) fn published(s: &NvmlSampling, gpu: usize, k: u64) -> u64 {
    let least = s.late_ns / 5;
    let more = mix(gpu, k, 2).checked_rem(s.late_ns - least).unwrap_or(0);
    boundary(s, gpu, k) + least + more
}

/// Whether the driver skips period `k` (its time goes into the next one).
pub(crate) fn skipped(s: &NvmlSampling, gpu: usize, k: u64) -> bool {
    s.skip_one_in > 0 && mix(gpu, k, 3).is_multiple_of(s.skip_one_in)
}

/// The window the sample ending period `k` covers: back to the last
/// period not skipped (at most three back).
pub(crate) fn window(s: &NvmlSampling, gpu: usize, k: u64) -> (u64, u64) {
    let mut j = k.saturating_sub(1);
    while j + 3 > k && j > 0 && skipped(s, gpu, j) {
        j -= 1;
    }
    (boundary(s, gpu, j), boundary(s, gpu, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_a_plain_grid() {
        let s = NvmlSampling::default();
        for k in 1..100 {
            assert_eq!(window(&s, 0, k), ((k - 1) * SAMPLE_NS, k * SAMPLE_NS));
            assert_eq!(published(&s, 0, k), k * SAMPLE_NS);
            assert!(!skipped(&s, 0, k));
        }
    }

    #[test]
    fn a_drivers_periods_wander_arrive_late_and_sometimes_skip() {
        let s = NvmlSampling {
            wander_ns: 20_000_000,
            late_ns: 60_000_000,
            skip_one_in: 11,
            device_period_ns: 0,
        };
        let ks = 1000..3000u64;
        let skips = ks.clone().filter(|&k| skipped(&s, 0, k)).count();
        assert!((100..300).contains(&skips), "{skips}");
        for k in ks {
            let (from, to) = window(&s, 0, k);
            assert!(from < to && to - from <= 4 * SAMPLE_NS);
            assert!(to >= k * SAMPLE_NS && to < k * SAMPLE_NS + s.wander_ns);
            let late = published(&s, 0, k) - to;
            assert!((12_000_000..60_000_000).contains(&late), "{late}");
            assert!(published(&s, 0, k) < published(&s, 0, k + 1));
            if !skipped(&s, 0, k - 1) {
                assert_eq!(from, boundary(&s, 0, k - 1));
            }
        }
        assert_ne!(boundary(&s, 0, 5), boundary(&s, 1, 5), "GPUs sample apart");
    }

    #[test]
    fn device_utilization_covers_its_own_published_period() {
        let plain = NvmlSampling::default();
        assert_eq!(
            plain.device_window(5_000_000_000),
            (4_000_000_000, 5_000_000_000)
        );
        let s = NvmlSampling {
            late_ns: 60_000_000,
            device_period_ns: 166_666_667,
            ..plain
        };
        let d = s.device_period_ns;
        // Just after a period ends it is not published yet: the one before.
        assert_eq!(s.device_window(6 * d + 10_000_000), (4 * d, 5 * d));
        assert_eq!(s.device_window(6 * d + 31_000_000), (5 * d, 6 * d));
    }
}
