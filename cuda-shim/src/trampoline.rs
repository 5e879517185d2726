//! Forwarding of every export this crate does not wrap (x86_64 only).
//!
//! build.rs generates, per forwarded symbol, a naked function that jumps
//! through a slot. Each slot starts at a stub that calls [`resolve_slot`]
//! with the registers that may carry arguments saved; the stub stores the
//! real address in the slot, so later calls cost one indirect jump.

#[cfg(not(target_arch = "x86_64"))]
compile_error!("cuda-shim's forwarding trampolines are x86_64-only (aarch64 is a follow-up)");

include!(concat!(env!("OUT_DIR"), "/exports.rs"));

use crate::real::{self, Lib};

/// What an unresolvable CUDA function returns: CUDA_ERROR_NOT_FOUND.
extern "C" fn missing_cuda() -> i32 {
    cuda_abi::CUDA_ERROR_NOT_FOUND
}

/// What an unresolvable NVML function returns: NVML_ERROR_FUNCTION_NOT_FOUND.
extern "C" fn missing_nvml() -> i32 {
    crate::nvml::NVML_ERROR_FUNCTION_NOT_FOUND
}

/// Called by the resolver stub with the slot's index; returns the address to
/// store and jump to. Never unwinds.
pub extern "C" fn resolve_slot(index: u32) -> usize {
    let i = index as usize;
    std::panic::catch_unwind(|| {
        let lib = if i < NVML_START { Lib::Cuda } else { Lib::Nvml };
        let name = NAMES[i];
        let p = real::sym(lib, name);
        crate::log::log!(Trace, "forwarding {name:?} -> {p:#x}");
        if p != 0 {
            p
        } else {
            crate::log::log!(Warn, "{name:?} is not in the real driver");
            missing(lib)
        }
    })
    .unwrap_or_else(|_| missing(if i < NVML_START { Lib::Cuda } else { Lib::Nvml }))
}

fn missing(lib: Lib) -> usize {
    match lib {
        Lib::Cuda => missing_cuda as *const () as usize,
        Lib::Nvml => missing_nvml as *const () as usize,
    }
}
