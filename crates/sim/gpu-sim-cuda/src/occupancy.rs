//! Occupancy queries, answered from the timing model (`gpu_sim_core::law`)
//! so that what a program is told and how its launches are timed agree:
//! blocks per multiprocessor are the tightest of threads, registers and
//! shared memory of the function's law. cudart asks for PyTorch's CUB scans
//! (`torch.cumsum`), cuBLASLt for its half-precision matmuls.

use crate::ctx::current;
use crate::module::law_of;
use crate::{R, drv, put};
use cuda_abi::*;
use gpu_sim_core::law::Launch;
use std::ffi::c_void;

/// Resident blocks of `block` threads and `shared` dynamic bytes per SM.
fn blocks_per_sm(f: *mut c_void, block: i32, shared: usize) -> R<i32> {
    let d = drv()?;
    let c = current()?;
    // SAFETY: `f` is our caller's handle, checked by its magic below (a
    // stale or foreign handle fails, as the real driver's does).
    unsafe { crate::module::func_handle(f) }?;
    if block <= 0 || block > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let shared = u32::try_from(shared).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let g = d.gpu_spec(c.gpu);
    let law = law_of(f as usize, d.node().kernel_wave_ns);
    // One block per SM occupies 1/(blocks per SM) of the device.
    let l = Launch::new([g.sm_count.max(1), 1, 1], [block as u32, 1, 1], shared);
    let share = law.occupancy(g, l);
    Ok((1.0 / share).round() as i32)
}

cuda_fn! {
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(n: *mut i32, f: *mut c_void, block: i32, shared: usize) {
        put(n, blocks_per_sm(f, block, shared)?)
    }

    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
        n: *mut i32, f: *mut c_void, block: i32, shared: usize, _flags: u32,
    ) {
        put(n, blocks_per_sm(f, block, shared)?)
    }
}
