//! What a launch costs: an estimate of the device time it occupies, in
//! waves. Blocks run in waves of `SMs x blocks per SM`; a wave holds the
//! device busy (NVML counts time with any kernel running) whether it runs
//! one block or thousands, so a 1-block reduction costs one wave and a
//! 10,000-block GEMM many. Thread counts would price a 1-thread kernel at a
//! millionth of a GEMM while it occupies the device for a whole wave; the
//! controller's learned ns-per-unit would then be off by orders of
//! magnitude between kernel sizes.
//!
//! Blocks per SM: the SM's thread limit over the block's threads, at least
//! one and at most 32 (the hardware's resident-block limit); registers and
//! shared memory can lower it further, which the learned scale absorbs.
//! The SM count and threads per SM are asked of the real driver once.

use std::sync::atomic::{AtomicU64, Ordering};

/// Cost units of one wave (finer than 1 so partial tokens are rare).
pub const WAVE_UNITS: u64 = 16;
/// Resident blocks per SM at most (every architecture since Maxwell).
const MAX_BLOCKS_PER_SM: u64 = 32;
/// Used when the driver cannot say (no device yet): an A100.
const FALLBACK: (u64, u64) = (108, 2048);

/// `sm_count << 32 | max_threads_per_sm`; 0 until asked.
static DEVICE: AtomicU64 = AtomicU64::new(0);

/// The cost of launching `grid` blocks of `block` threads (0 dimensions
/// count as 1: the driver rejects them anyway).
#[inline(always)]
pub fn kernel_cost(grid: [u32; 3], block: [u32; 3]) -> u64 {
    let d = match DEVICE.load(Ordering::Relaxed) {
        0 => device(),
        d => d,
    };
    waves(d >> 32, d & 0xffff_ffff, grid, block).saturating_mul(WAVE_UNITS)
}

/// Waves of `grid` x `block` on a device of `sms` SMs of `per_sm_threads`.
#[inline(always)]
pub fn waves(sms: u64, per_sm_threads: u64, grid: [u32; 3], block: [u32; 3]) -> u64 {
    let blocks = grid
        .iter()
        .fold(1u64, |a, &x| a.saturating_mul(u64::from(x.max(1))));
    let threads = block
        .iter()
        .fold(1u64, |a, &x| a.saturating_mul(u64::from(x.max(1))));
    let per_sm = (per_sm_threads / threads).clamp(1, MAX_BLOCKS_PER_SM);
    blocks.div_ceil(sms.max(1) * per_sm)
}

/// Asks the real driver for the current device's shape, once (a failed
/// query is retried at the next launch, the fallback used meanwhile).
#[cold]
#[inline(never)]
fn device() -> u64 {
    match query() {
        Some((sms, threads)) => {
            let d = (sms << 32) | threads;
            DEVICE.store(d, Ordering::Relaxed);
            d
        }
        None => (FALLBACK.0 << 32) | FALLBACK.1,
    }
}

type GetAttr = unsafe extern "C" fn(*mut i32, i32, i32) -> i32;
type CtxGetDevice = unsafe extern "C" fn(*mut i32) -> i32;

fn query() -> Option<(u64, u64)> {
    use crate::real::{Lib, sym};
    let get = sym(Lib::Cuda, c"cuDeviceGetAttribute");
    let ctx_dev = sym(Lib::Cuda, c"cuCtxGetDevice");
    if get == 0 {
        return None;
    }
    // SAFETY: the real driver's symbols, with their C signatures.
    let get: GetAttr = unsafe { std::mem::transmute::<usize, GetAttr>(get) };
    let mut dev = 0i32;
    if ctx_dev != 0 {
        let f: CtxGetDevice = unsafe { std::mem::transmute::<usize, CtxGetDevice>(ctx_dev) };
        if unsafe { f(&mut dev) } != 0 {
            dev = 0;
        }
    }
    let attr = |a: i32| {
        let mut v = 0i32;
        (unsafe { get(&mut v, a, dev) } == 0 && v > 0).then_some(v as u64)
    };
    let sms = attr(cuda_abi::attr::MULTIPROCESSOR_COUNT)?;
    let threads = attr(cuda_abi::attr::MAX_THREADS_PER_MULTIPROCESSOR)?;
    Some((sms, threads))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_follows_waves_not_threads() {
        // An A100: 108 SMs of 2048 threads.
        let w = |g, b| waves(108, 2048, [g, 1, 1], [b, 1, 1]);
        assert_eq!(w(1, 1), 1, "one thread occupies a wave");
        assert_eq!(w(1, 1024), 1);
        assert_eq!(w(864, 256), 1, "108 SMs x 8 blocks");
        assert_eq!(w(865, 256), 2);
        assert_eq!(w(86_400, 256), 100);
        assert_eq!(w(3456, 1), 1, "at most 32 blocks per SM");
        assert_eq!(w(3457, 1), 2);
        assert_eq!(w(100_000, 1024), 100_000u64.div_ceil(216));
        assert_eq!(waves(108, 2048, [0, 0, 0], [0, 0, 0]), 1);
        let huge = waves(1, 1, [u32::MAX; 3], [1, 1, 1]);
        assert_eq!(huge, u64::MAX, "saturates, never wraps");
    }
}
