//! Kernel launches: each passes through the compute-quota hook
//! ([`crate::throttle::before_launch`]) when the process enforces quotas,
//! unless it is being captured into a graph ([`crate::graph`]); a graph
//! launch is charged its kernel nodes.
//! Hot path: one load (the bucket: null without a compute limit, and only
//! an enforcing process has one), one indirect call; with a limit also one
//! relaxed load (active captures), the cost and the bucket's ticket, and
//! for a kernel or graph one relaxed load (a launch armed to be timed on the device,
//! `throttle::timed`, whose probe the wrapper closes after the real call). Before
//! that the compute tier's check ([`crate::qos::before_launch`]): one load
//! for a process of neither tier, four for a batch one (three when a latency
//! process is registered on its first GPU). After the real call, one relaxed
//! load ([`crate::mem::launched`]: a launch ran since the memory view last
//! measured).

use crate::arg;
use crate::graph::{captured, launch_cost};
use crate::real::real_cuda;
use crate::registration::proc;
use crate::throttle::timed::Probe;
use crate::throttle::{before_launch, before_launch_on, kernel_cost};
use cuda_abi::CUresult;
use std::ffi::c_void;

type Ptr = *mut c_void;
type Params = *mut *mut c_void;
type LaunchKernel =
    unsafe extern "C" fn(Ptr, u32, u32, u32, u32, u32, u32, u32, Ptr, Params, Params) -> CUresult;
type LaunchCoop =
    unsafe extern "C" fn(Ptr, u32, u32, u32, u32, u32, u32, u32, Ptr, Params) -> CUresult;
type LaunchEx = unsafe extern "C" fn(*const LaunchConfig, Ptr, Params, Params) -> CUresult;
type GraphLaunch = unsafe extern "C" fn(Ptr, Ptr) -> CUresult;

/// The head of `CUlaunchConfig` (what the cost and the capture check need).
#[repr(C)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: Ptr,
}

/// No `ENFORCING` check: only an enforcing process gets a bucket, and the
/// hook's first load is the bucket.
#[inline(always)]
fn hook(cost: impl FnOnce() -> u64) {
    crate::qos::before_launch(std::ptr::null_mut(), false, || false);
    before_launch(cost, register);
}

/// [`hook`] for launches onto a stream: work recorded into a capture is
/// not charged (its graph's launches are). `ptsz`: a per-thread variant.
/// The compute quota may time the launch on the device: pass the real
/// launch's result through the probe.
#[inline(always)]
fn hook_on(stream: Ptr, ptsz: bool, cost: impl FnOnce() -> u64) -> Probe {
    crate::qos::before_launch(stream, ptsz, || captured(stream, ptsz));
    before_launch_on(stream, ptsz, || captured(stream, ptsz), cost, register)
}

/// After the real launch: the probe closes, and the memory view learns that
/// a launch ran (the driver may have loaded its kernel's module: `mem::launched`).
#[inline(always)]
fn done(probe: Probe, r: CUresult) -> CUresult {
    let r = probe.after(r);
    crate::mem::launched();
    r
}

/// A process that throttles but is not registered (a fork child that only
/// launches) registers when a launch first waits: the manager then lists
/// it in pids.config, so the controller counts its utilisation, and its own
/// watcher starts.
#[cold]
fn register() {
    let p = proc();
    if !p.is_registered() {
        let _ = p.ensure_registered();
    }
}

cuda_exports! {
    fn cuLaunchKernel(f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shmem: u32, stream: Ptr, params: Params, extra: Params) {
        let real = real_cuda!(cuLaunchKernel: LaunchKernel);
        let probe = hook_on(stream, false, || kernel_cost([gx, gy, gz], [bx, by, bz]));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra) })
    }

    fn cuLaunchKernel_ptsz(f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shmem: u32, stream: Ptr, params: Params, extra: Params) {
        let real = real_cuda!(cuLaunchKernel_ptsz: LaunchKernel);
        let probe = hook_on(stream, true, || kernel_cost([gx, gy, gz], [bx, by, bz]));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra) })
    }

    fn cuLaunchCooperativeKernel(f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shmem: u32, stream: Ptr, params: Params) {
        let real = real_cuda!(cuLaunchCooperativeKernel: LaunchCoop);
        let probe = hook_on(stream, false, || kernel_cost([gx, gy, gz], [bx, by, bz]));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(f, gx, gy, gz, bx, by, bz, shmem, stream, params) })
    }

    fn cuLaunchCooperativeKernel_ptsz(f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shmem: u32, stream: Ptr, params: Params) {
        let real = real_cuda!(cuLaunchCooperativeKernel_ptsz: LaunchCoop);
        let probe = hook_on(stream, true, || kernel_cost([gx, gy, gz], [bx, by, bz]));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(f, gx, gy, gz, bx, by, bz, shmem, stream, params) })
    }

    fn cuLaunchKernelEx(config: *const LaunchConfig, f: Ptr, params: Params, extra: Params) {
        let real = real_cuda!(cuLaunchKernelEx: LaunchEx);
        let stream = arg(config).map_or(std::ptr::null_mut(), |c| c.stream);
        let probe = hook_on(stream, false, || arg(config).map_or(0, |c| kernel_cost(c.grid, c.block)));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(config, f, params, extra) })
    }

    fn cuLaunchKernelEx_ptsz(config: *const LaunchConfig, f: Ptr, params: Params, extra: Params) {
        let real = real_cuda!(cuLaunchKernelEx_ptsz: LaunchEx);
        let stream = arg(config).map_or(std::ptr::null_mut(), |c| c.stream);
        let probe = hook_on(stream, true, || arg(config).map_or(0, |c| kernel_cost(c.grid, c.block)));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(config, f, params, extra) })
    }

    fn cuLaunchCooperativeKernelMultiDevice(params: Ptr, num_devices: u32, flags: u32) {
        let real = real_cuda!(cuLaunchCooperativeKernelMultiDevice: unsafe extern "C" fn(Ptr, u32, u32) -> CUresult);
        hook(|| 0);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(Probe::NONE, unsafe { real(params, num_devices, flags) })
    }

    fn cuGraphLaunch(exec: Ptr, stream: Ptr) {
        let real = real_cuda!(cuGraphLaunch: GraphLaunch);
        let _first = crate::graph::mapping(exec);
        let probe = hook_on(stream, false, || launch_cost(exec));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(exec, stream) })
    }

    fn cuGraphLaunch_ptsz(exec: Ptr, stream: Ptr) {
        let real = real_cuda!(cuGraphLaunch_ptsz: GraphLaunch);
        let _first = crate::graph::mapping(exec);
        let probe = hook_on(stream, true, || launch_cost(exec));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(exec, stream) })
    }

    fn cuLaunch(f: Ptr) {
        let real = real_cuda!(cuLaunch: unsafe extern "C" fn(Ptr) -> CUresult);
        hook(|| 0);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(Probe::NONE, unsafe { real(f) })
    }

    fn cuLaunchGrid(f: Ptr, w: i32, h: i32) {
        let real = real_cuda!(cuLaunchGrid: unsafe extern "C" fn(Ptr, i32, i32) -> CUresult);
        hook(|| kernel_cost([w.max(1) as u32, h.max(1) as u32, 1], [1, 1, 1]));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(Probe::NONE, unsafe { real(f, w, h) })
    }

    fn cuLaunchGridAsync(f: Ptr, w: i32, h: i32, stream: Ptr) {
        let real = real_cuda!(cuLaunchGridAsync: unsafe extern "C" fn(Ptr, i32, i32, Ptr) -> CUresult);
        let probe = hook_on(stream, false, || kernel_cost([w.max(1) as u32, h.max(1) as u32, 1], [1, 1, 1]));
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        done(probe, unsafe { real(f, w, h, stream) })
    }
}
