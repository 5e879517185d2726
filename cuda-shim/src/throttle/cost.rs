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

use std::sync::atomic::{AtomicPtr, Ordering};

/// Cost units of one wave (finer than 1 so partial tokens are rare).
pub const WAVE_UNITS: u64 = 16;
/// Resident blocks per SM at most (every architecture since Maxwell).
const MAX_BLOCKS_PER_SM: u64 = 32;
/// Used when the driver cannot say (no device yet): an A100.
const FALLBACK: (u64, u64) = (108, 2048);
/// Threads per block the table covers (the hardware's limit).
const MAX_BLOCK_THREADS: usize = 1024;
/// Grids up to this many blocks take the table's float path, exact there.
const FAST_BLOCKS: u64 = 1 << 50;

/// The device's shape, asked once: per threads-per-block, the blocks in
/// flight on the whole device and its reciprocal, so the launch path
/// divides by multiplying (a 64-bit division costs more than the rest of
/// the launch path together).
struct Shape {
    sms: u64,
    per_sm_threads: u64,
    /// (blocks in flight, its reciprocal): one cache line per lookup.
    by_threads: [(u64, f64); MAX_BLOCK_THREADS + 1],
}

/// Null until the driver answered.
static SHAPE: AtomicPtr<Shape> = AtomicPtr::new(std::ptr::null_mut());

/// The cost of launching `grid` blocks of `block` threads (0 dimensions
/// count as 1: the driver rejects them anyway).
#[inline(always)]
pub(crate) fn kernel_cost(grid: [u32; 3], block: [u32; 3]) -> u64 {
    // Scalars all the way (the cold call too): arrays would be built on
    // the stack on the launch path for the slow path's sake.
    let [gx, gy, gz] = grid;
    let [bx, by, bz] = block;
    let p = SHAPE.load(Ordering::Acquire);
    if p.is_null() {
        return slow_cost(gx, gy, gz, bx, by, bz);
    }
    // SAFETY: published once, never freed.
    let s = unsafe { &*p };
    let blocks = (u64::from(gx.max(1)) * u64::from(gy.max(1))).saturating_mul(u64::from(gz.max(1)));
    // One check for the table's range: each factor is below 2^32, so only
    // the last product can overflow, and saturating keeps it out of range.
    let t = (u64::from(bx.max(1)) * u64::from(by.max(1))).saturating_mul(u64::from(bz.max(1)));
    if t > MAX_BLOCK_THREADS as u64 || blocks >= FAST_BLOCKS {
        return slow_cost(gx, gy, gz, bx, by, bz);
    }
    let (c, inv) = s.by_threads[t as usize];
    if blocks <= c {
        // One wave (reductions, small kernels): no arithmetic on the path
        // to the bucket's fetch_add, which needs the cost.
        return WAVE_UNITS;
    }
    // Off by at most one below 2^50 blocks; the integer checks make it the
    // exact ceiling. Signed conversions: one instruction each.
    let mut w = ((blocks as i64) as f64 * inv) as i64 as u64;
    if w * c < blocks {
        w += 1;
    } else if w > 0 && (w - 1) * c >= blocks {
        w -= 1;
    }
    w * WAVE_UNITS
}

/// Outside the table (first launches, odd shapes): divides.
#[cold]
#[inline(never)]
fn slow_cost(gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32) -> u64 {
    let s = shape();
    let (sms, per_sm) = s.map_or(FALLBACK, |s| (s.sms, s.per_sm_threads));
    waves(sms, per_sm, [gx, gy, gz], [bx, by, bz]).saturating_mul(WAVE_UNITS)
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

/// The published shape, asking the real driver first if need be (a failed
/// query is retried at the next launch, the fallback used meanwhile).
fn shape() -> Option<&'static Shape> {
    let p = SHAPE.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: a non-NULL SHAPE came from Box::into_raw and is published once, never freed:
        // valid for 'static.
        return Some(unsafe { &*p });
    }
    let (sms, per_sm_threads) = query()?;
    let new = Box::into_raw(build(sms, per_sm_threads));
    match SHAPE.compare_exchange(
        std::ptr::null_mut(),
        new,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: `new` came from Box::into_raw above and is now published, never freed.
        Ok(_) => Some(unsafe { &*new }),
        Err(other) => {
            // Another thread published first.
            // SAFETY: `new` lost the race, so no one else has seen it: from Box::into_raw,
            // freed once, here.
            drop(unsafe { Box::from_raw(new) });
            // SAFETY: `other` is the published SHAPE: from Box::into_raw, never freed.
            Some(unsafe { &*other })
        }
    }
}

fn build(sms: u64, per_sm_threads: u64) -> Box<Shape> {
    let mut s = Box::new(Shape {
        sms,
        per_sm_threads,
        by_threads: [(0, 0.0); MAX_BLOCK_THREADS + 1],
    });
    for t in 0..=MAX_BLOCK_THREADS {
        let per_sm = (per_sm_threads / t.max(1) as u64).clamp(1, MAX_BLOCKS_PER_SM);
        let c = sms.max(1).saturating_mul(per_sm);
        s.by_threads[t] = (c, 1.0 / c as f64);
    }
    s
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
        // SAFETY: `ctx_dev` is the non-zero address of the real cuCtxGetDevice, whose C
        // signature this is.
        let f: CtxGetDevice = unsafe { std::mem::transmute::<usize, CtxGetDevice>(ctx_dev) };
        // SAFETY: the real driver's function of this C signature, resolved by name; its pointer
        // arguments are our own live locals.
        if unsafe { f(&mut dev) } != 0 {
            dev = 0;
        }
    }
    let attr = |a: i32| {
        let mut v = 0i32;
        // SAFETY: the real driver's function of this C signature, resolved by name; its pointer
        // arguments are our own live locals.
        (unsafe { get(&mut v, a, dev) } == 0 && v > 0).then_some(v as u64)
    };
    let sms = attr(cuda_abi::attr::MULTIPROCESSOR_COUNT)?;
    let threads = attr(cuda_abi::attr::MAX_THREADS_PER_MULTIPROCESSOR)?;
    // Older drivers do not know the attribute (an error): not MPS.
    MPS.store(
        if attr(cuda_abi::attr::MPS_ENABLED).is_some() {
            2
        } else {
            1
        },
        Ordering::Release,
    );
    Some((sms, threads))
}

/// 0 not asked yet, 1 no, 2 the launching context is an MPS client.
static MPS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether this process's contexts are MPS clients, once a launch asked
/// the driver (with the device's shape). Under MPS the server runs every
/// client's kernels under its own PID: NVML never names the container's.
pub fn mps() -> Option<bool> {
    match MPS.load(Ordering::Acquire) {
        0 => None,
        v => Some(v == 2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table's float path equals the integer reference.
    #[test]
    fn the_fast_path_is_exact() {
        let s = build(108, 2048);
        SHAPE.store(Box::into_raw(s), Ordering::Release);
        let shapes = [
            1u32, 2, 31, 32, 33, 63, 64, 255, 256, 257, 1000, 1024, 1025, 4096,
        ];
        let grids = [
            0u32,
            1,
            2,
            863,
            864,
            865,
            3455,
            3456,
            3457,
            86_400,
            100_000,
            (1 << 31) - 1,
        ];
        for &b in &shapes {
            for &g in &grids {
                for &gy in &[1u32, 3, 65_535] {
                    let want = waves(108, 2048, [g, gy, 1], [b, 1, 1]) * WAVE_UNITS;
                    assert_eq!(kernel_cost([g, gy, 1], [b, 1, 1]), want, "{g}x{gy} x {b}");
                    assert_eq!(
                        kernel_cost([g, 1, gy], [1, b, 1]),
                        waves(108, 2048, [g, 1, gy], [1, b, 1]) * WAVE_UNITS
                    );
                }
            }
        }
        let huge = [u32::MAX, 65_535, 65_535];
        assert_eq!(
            kernel_cost(huge, [1, 1, 1]),
            waves(108, 2048, huge, [1, 1, 1]) * WAVE_UNITS
        );
    }

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
