//! vcuda interposer: the `libcuda.so.1` and `libnvidia-ml.so.1` of shared
//! containers. See README.md for the design; in short:
//!
//! * every export of the real libraries exists here; the ones without a
//!   wrapper are trampolines into the real driver ([`trampoline`]);
//! * the real driver is the versioned file beside this one ([`real`]);
//! * `vcuda.config` decides the mode ([`config`]); enforcing processes
//!   register with the manager and share the container ledger
//!   ([`registration`]); a watcher thread keeps the connection and drives
//!   the quotas' periodic work ([`watcher`]);
//! * every allocation path reserves in the ledger first ([`mem`]); memory
//!   queries show the quota ([`view`], [`nvml`]); entry-point lookups hand
//!   out the wrappers ([`procaddr`]); launches pass through the
//!   compute-quota hook ([`launch`], [`throttle`]).
//!
//! No export unwinds into C: each body runs under `catch_unwind`.

#![allow(non_snake_case, clippy::missing_safety_doc)]
#![deny(unsafe_op_in_unsafe_fn)]

/// Defines exported CUDA functions; the body evaluates to a `CUresult`.
macro_rules! cuda_exports {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> cuda_abi::CUresult {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                || -> cuda_abi::CUresult {
                    $body
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
                    $body
                },
            )) {
                Ok(r) => r,
                Err(_) => $crate::nvml::NVML_ERROR_UNKNOWN,
            }
        }
    )*};
}

/// Reads what the real driver stored through an out-pointer of our caller's;
/// call only once the driver returned success for it. `None` on NULL.
#[inline]
pub(crate) fn written<T: Copy>(p: *const T) -> Option<T> {
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is an out-parameter the caller handed to a driver call that
    // returned success, so (CUDA/NVML ABI) it points to a T the driver just
    // initialized; NULL is excluded above. `read_unaligned`: no alignment
    // assumption about the caller's memory.
    Some(unsafe { p.read_unaligned() })
}

/// Stores `v` through an out-pointer of our caller; false on NULL.
#[inline]
pub(crate) fn out<T>(p: *mut T, v: T) -> bool {
    if p.is_null() {
        return false;
    }
    // SAFETY: the caller (CUDA/NVML ABI) passes a pointer to writable storage
    // for a T, or NULL; checked for NULL above.
    unsafe { p.write_unaligned(v) };
    true
}

/// A struct argument of our caller's (a descriptor, a config), borrowed for
/// the call; `None` on NULL.
#[inline]
pub(crate) fn arg<'a, T>(p: *const T) -> Option<&'a T> {
    // SAFETY: the caller (CUDA/NVML ABI) passes a valid, aligned pointer to an
    // initialized T that stays alive and unmodified for the duration of the
    // call, or NULL (`as_ref` maps NULL to None); the borrow is used only
    // inside the export that received it.
    unsafe { p.as_ref() }
}

/// Like [`arg`], for a struct the driver filled and we adjust in place.
#[inline]
pub(crate) fn arg_mut<'a, T>(p: *mut T) -> Option<&'a mut T> {
    // SAFETY: as for [`arg`]: a valid, aligned pointer to a T that the caller
    // lent us exclusively for the call, or NULL (mapped to None).
    unsafe { p.as_mut() }
}

pub mod config;
pub mod devices;
mod events;
pub mod graph;
pub mod init;
pub mod launch;
pub mod lending;
pub mod log;
pub mod mem;
pub mod nvml;
pub mod procaddr;
pub mod qos;
pub mod real;
pub mod registration;
pub mod table;
pub mod throttle;
pub mod trampoline;
pub mod view;
pub mod watcher;
