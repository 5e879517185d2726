//! cuInit: decide the mode, check what the quotas need, register, then
//! initialise the real driver.

use crate::config::{self, Mode};
use crate::log;
use crate::real::real_cuda;
use crate::registration::{REFUSED, proc};
use cuda_abi::CUresult;

cuda_exports! {
    fn cuInit(flags: u32) {
        match config::mode() {
            Mode::PassThrough => {}
            Mode::Closed(reason) => {
                log::fail_closed(reason);
                return REFUSED;
            }
            Mode::Enforce(e) => {
                // Fail closed before the device is touched.
                if let Err(reason) = compute_feedback(e) {
                    log::fail_closed(&reason);
                    return REFUSED;
                }
                if let Err(e) = proc().ensure_registered() {
                    return e;
                }
            }
        }
        if let Err(e) = crate::real::handle(crate::real::Lib::Cuda) {
            log::fail_closed(e);
            return cuda_abi::CUDA_ERROR_NO_DEVICE;
        }
        let f = real_cuda!(cuInit: unsafe extern "C" fn(u32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        unsafe { f(flags) }
    }
}

/// A compute quota is steered by the real NVML's utilisation samples
/// (`throttle::sampler`): without it the bucket never gets a rate and the
/// container would run unthrottled, so its absence fails closed like a
/// missing quota file. Loaded here, once, never on the launch path.
fn compute_feedback(e: &crate::config::Enforce) -> Result<(), String> {
    let Some(q) = e
        .gpus
        .iter()
        .find_map(|g| crate::throttle::quota_of_gpu(g, e.data.hard_limit))
    else {
        return Ok(());
    };
    match crate::real::try_handle(crate::real::Lib::Nvml) {
        Ok(_) => Ok(()),
        Err(e) => Err(format!(
            "compute quota {}% is steered by the real NVML's utilisation samples, but {e}; \
             refusing CUDA rather than running unthrottled",
            q.utilization
        )),
    }
}

/// Loads the real driver (and, for a compute quota, the real NVML) when
/// the interposer itself is loaded: where a process linked to the real
/// `libcuda.so.1` pays for loading it. `cuInit` then finds them loaded
/// instead of paying a library's load inside the call (the overhead bench
/// measured 0.5 ms of its cost there). A failure is kept and reported by
/// `cuInit`, as before.
#[used]
// SAFETY: a plain function pointer in .init_array, run once by the loader
// after this library's relocations; `prefetch` only loads libraries.
#[unsafe(link_section = ".init_array")]
static PREFETCH: extern "C" fn() = prefetch;

extern "C" fn prefetch() {
    let _ = crate::real::try_handle(crate::real::Lib::Cuda);
    if let Some(e) = config::enforce() {
        // A failure is said by cuInit, which refuses CUDA for it.
        let _ = compute_feedback(e);
    }
}
