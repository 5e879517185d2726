//! Kernel launches: the simulated timeline's hot path.
//!
//! Each launch takes its duration from its kernel's law (declared in the
//! module image, `gpu_sim_core::law`), queues on the device's shared
//! timeline (behind every process's kernels, or at the holder's timeslice
//! boundary: `gpu_sim_core` slice.rs) and records the simulated end as its
//! stream's tail. Synchronising sleeps until the tail, resolved against the
//! preemptions made since.
//! The launch path is atomics, thread-locals and a vDSO clock read: no lock,
//! no allocation, no syscall, unless the context's pending-launch queue is
//! full (`queue.rs`): then the launch sleeps until the device drains one.

use crate::ctx::Ctx;
use crate::module::Func;
use crate::stream::Target;
use crate::{R, arg, drv};
use cuda_abi::*;
use gpu_sim_core::law::Launch;
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::Ordering::{AcqRel, Acquire};

pub(crate) const FUNC_MAGIC: u64 = 0x5349_4d46_554e_0001;

thread_local! {
    /// xorshift64* state for kernel-time jitter, seeded per thread.
    static RNG: Cell<u64> = Cell::new(
        (gpu_sim_core::state::now_ns() ^ (std::process::id() as u64) << 32) | 1,
    );
}

/// A uniformly random word (kernel-time jitter: data the shape hides).
pub(crate) fn random() -> u64 {
    RNG.with(|r| {
        let mut x = r.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        r.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

/// A kernel launch: the hot path.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch(
    f: *mut c_void,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: *mut c_void,
    ptsz: bool,
    params: *mut *mut c_void,
) -> R {
    let d = drv()?;
    let func = f as *const u64;
    // SAFETY: `f` is non-NULL here and, per the CUDA ABI, a CUfunction this driver handed out,
    // whose first word is its magic (checked).
    if func.is_null() || unsafe { *func } != FUNC_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if block[0] > 1024 || block[1] > 1024 || block[2] > 64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if block[0] as u64 * block[1] as u64 * block[2] as u64 > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if grid[1] > 65535 || grid[2] > 65535 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    if crate::capture::kernel(t, f, grid, block, shared)? {
        return Ok(());
    }
    let ctx = t.ctx();
    // SAFETY: checked above: a live Func this driver handed out.
    let law = unsafe { &*(f as *const Func) }.law;
    let l = Launch::new(grid, block, shared);
    // Read only for a law that declares its first parameter an integer.
    let l = if law.arg_ns > 0.0 {
        // SAFETY: `params` is the caller's kernelParams (CUDA ABI: NULL or an array whose
        // first entry points at the first argument).
        l.with_arg(unsafe { first_param(params) })
    } else {
        l
    };
    let gpu = d.gpu_spec(ctx.gpu);
    let dur = law.duration_ns(gpu, l, random());
    // The legacy default stream orders itself against every other blocking
    // stream: its kernels neither run beside others nor let others beside.
    let share = match t {
        Target::Legacy(_) => 1.0,
        _ => law.occupancy(gpu, l),
    };
    // A full launch queue blocks the caller until the device drains one.
    let slot = ctx.queue.admit(ctx.gpu);
    let end = match t.priority() {
        0 => d.state.launch_with(d.me, ctx.gpu, dur, t.tail(), share).1,
        p => raised(d, ctx, t, p, dur, share),
    };
    ctx.queue.record(slot, end);
    t.set_tail(end);
    Ok(())
}

/// A launch on a stream of raised priority `p` (-1 to -5): after the
/// stream's own work and the context's work of priority `p` or above,
/// ahead of the rest (`SharedState::launch_ahead`). Its end.
#[cold]
fn raised(d: &crate::Driver, ctx: &Ctx, t: Target, p: i32, dur: u64, share: f64) -> u64 {
    let level = p.unsigned_abs().min(5) as usize;
    let after = ctx.raised_tails[level..]
        .iter()
        .map(|a| a.load(Acquire))
        .fold(t.tail(), u64::max);
    let wave = d.node().kernel_wave_ns;
    let (_, end) = d.state.launch_ahead(d.me, ctx.gpu, dur, after, share, wave);
    ctx.raised_tails[level].fetch_max(end, AcqRel);
    end
}

/// The first kernel parameter as a 32-bit integer; 0 without parameters.
///
/// # Safety
/// `params` is NULL or, per the CUDA ABI, an array whose first entry is NULL
/// or points at the kernel's first argument (at least 4 bytes for a kernel
/// whose law reads it).
unsafe fn first_param(params: *mut *mut c_void) -> u32 {
    if params.is_null() {
        return 0;
    }
    // SAFETY: the contract above.
    let p = unsafe { *params } as *const u32;
    if p.is_null() {
        0
    } else {
        // SAFETY: the contract above; arguments need not be aligned for us.
        unsafe { p.read_unaligned() }
    }
}

/// `CUlaunchConfig` (x86_64 layout).
#[repr(C)]
pub struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: *mut c_void,
    attrs: *mut c_void,
    num_attrs: u32,
}

cuda_fn! {
    fn cuLaunchKernel(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        shared: u32, stream: *mut c_void, params: *mut *mut c_void, _extra: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], shared, stream, false, params) }
    }

    fn cuLaunchKernel_ptsz(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        shared: u32, stream: *mut c_void, params: *mut *mut c_void, _extra: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], shared, stream, true, params) }
    }

    fn cuLaunchCooperativeKernel(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        shared: u32, stream: *mut c_void, params: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], shared, stream, false, params) }
    }

    fn cuLaunchCooperativeKernel_ptsz(
        f: *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        shared: u32, stream: *mut c_void, params: *mut *mut c_void,
    ) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, [gx, gy, gz], [bx, by, bz], shared, stream, true, params) }
    }

    fn cuLaunchKernelEx(config: *const LaunchConfig, f: *mut c_void, params: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = arg(config).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, c.grid, c.block, c.shared, c.stream, false, params) }
    }

    fn cuLaunchKernelEx_ptsz(config: *const LaunchConfig, f: *mut c_void, params: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = arg(config).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(f, c.grid, c.block, c.shared, c.stream, true, params) }
    }
}
