//! vcuda interposer: the `libcuda.so.1` and `libnvidia-ml.so.1` of shared
//! containers. See README.md for the design; in short:
//!
//! * every export of the real libraries exists here; the ones without a
//!   wrapper are trampolines into the real driver ([`trampoline`]);
//! * the real driver is the versioned file beside this one ([`real`]);
//! * `vcuda.config` decides the mode ([`config`]); enforcing processes
//!   register with the manager and share the container ledger
//!   ([`registration`]);
//! * every allocation path reserves in the ledger first ([`mem`]); memory
//!   queries show the quota ([`view`], [`nvml`]); entry-point lookups hand
//!   out the wrappers ([`procaddr`]); launches pass through the
//!   compute-quota hook ([`launch`], [`throttle`]).
//!
//! No export unwinds into C: each body runs under `catch_unwind`.

#![allow(non_snake_case, clippy::missing_safety_doc)]

/// Defines exported CUDA functions; the body evaluates to a `CUresult`.
macro_rules! cuda_exports {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> cuda_abi::CUresult {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                || -> cuda_abi::CUresult {
                    #[allow(unused_unsafe)]
                    unsafe { $body }
                },
            )) {
                Ok(r) => r,
                Err(_) => cuda_abi::CUDA_ERROR_UNKNOWN,
            }
        }
    )*};
}

/// Defines exported NVML functions; the body evaluates to an `nvmlReturn_t`.
macro_rules! nvml_exports {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> i32 {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                || -> i32 {
                    #[allow(unused_unsafe)]
                    unsafe { $body }
                },
            )) {
                Ok(r) => r,
                Err(_) => $crate::nvml::NVML_ERROR_UNKNOWN,
            }
        }
    )*};
}

pub mod config;
pub mod graph;
pub mod init;
pub mod launch;
pub mod log;
pub mod mem;
pub mod nvml;
pub mod procaddr;
pub mod real;
pub mod registration;
pub mod table;
pub mod throttle;
pub mod trampoline;
pub mod view;
