//! Entry-point lookups. CUDA 12 programs (and cuda-bindings, for every
//! function) get driver functions from cuGetProcAddress, not from the
//! dynamic linker: each enforced function must come back as our wrapper,
//! in the ABI variant the caller asked for, or the quota is bypassed.
//!
//! The real driver answers first (its checks on version and flags, its
//! status codes stay exact). Then, if cuda-abi's table maps (name, version,
//! flags) to an exported symbol we wrap, and the real answer is that
//! symbol's function, the pointer is replaced by our wrapper. A real answer
//! that is some other function for an enforced name (a driver newer than our
//! table) is refused rather than let through unenforced.

use crate::config::{self, Mode};
use crate::log::log;
use crate::real::{self, Lib, real_cuda};
use cuda_abi::{CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, CUresult};
use std::ffi::{CStr, CString, c_char, c_void};

type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64) -> CUresult;
type GetProcV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> CUresult;

/// Substitutes our wrapper into `*pfn` where one applies. Returns the
/// status to give the caller.
unsafe fn substitute(
    r: CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    if r != CUDA_SUCCESS || symbol.is_null() || pfn.is_null() || unsafe { *pfn }.is_null() {
        return r;
    }
    if matches!(config::mode(), Mode::PassThrough) {
        return r;
    }
    let name = unsafe { CStr::from_ptr(symbol) };
    let Ok(exported) = name
        .to_str()
        .map_err(drop)
        .and_then(|n| cuda_abi::resolve(n, version, flags).map_err(drop))
    else {
        return r;
    };
    let Some(ours) = crate::trampoline::wrapper(exported.as_bytes()) else {
        return r;
    };
    let got = unsafe { *pfn } as *const c_void;
    if got == ours {
        return r;
    }
    let expected = CString::new(exported)
        .map(|c| real::sym(Lib::Cuda, &c))
        .unwrap_or(0);
    if expected != 0 && expected == got as usize {
        unsafe { *pfn = ours as *mut c_void };
        return r;
    }
    log!(
        Warn,
        "cuGetProcAddress({name:?}, {version}, {flags}) returned a function that is not {exported}; \
         refusing it (the interposer's ABI table is older than the driver)"
    );
    unsafe { *pfn = std::ptr::null_mut() };
    if !status.is_null() {
        unsafe { *status = cuda_abi::ProcStatus::SymbolNotFound as i32 };
    }
    CUDA_ERROR_NOT_FOUND
}

cuda_exports! {
    fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64, status: *mut i32) {
        let f = real_cuda!(cuGetProcAddress_v2: GetProcV2);
        let r = f(symbol, pfn, version, flags, status);
        substitute(r, symbol, pfn, version, flags, status)
    }

    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64) {
        let f = real_cuda!(cuGetProcAddress: GetProcV1);
        let r = f(symbol, pfn, version, flags);
        substitute(r, symbol, pfn, version, flags, std::ptr::null_mut())
    }
}
