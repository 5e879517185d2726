//! Entry-point lookups. CUDA 12 programs (and cuda-bindings, for every
//! function) get driver functions from cuGetProcAddress, not from the
//! dynamic linker: each enforced function must come back as our wrapper,
//! in the ABI variant the caller asked for, or the quota is bypassed.
//!
//! The real driver answers first (its checks on version and flags, its
//! status codes stay exact). A successful answer is then replaced by our
//! wrapper of *the variant the driver handed out*. Which variant that is:
//! first, the exported symbol the driver's pointer equals — NVIDIA's 535 and
//! 550 drivers hand out their own exports for every name, version and flag
//! (tests/nvidia_oracle.rs asks them all), and that answer beats any table:
//! a 12.2 driver asked at 12.8 hands out `cuCtxCreate_v3`, not the `_v4` a
//! table of CUDA 12.8's headers names, and `cuGraphInstantiate` at 12.0 is
//! `cuGraphInstantiate_v2`, not `cuGraphInstantiateWithFlags`. Only a pointer
//! that is no export (a driver handing out internal entry points) falls
//! back to cuda-abi's table, at the driver's own CUDA version at most. A
//! base name we enforce whose variant we do not wrap (or a request newer
//! than our table whose answer differs from the newest variant we know: the
//! driver may have added one) is refused — NULL, `CUDA_ERROR_NOT_FOUND` —
//! never let through unenforced.

use crate::config::{self, Mode};
use crate::log::log;
use crate::real::{Lib, real_cuda};
use cuda_abi::{CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, CUresult};
use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::OnceLock;

type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64) -> CUresult;
type GetProcV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> CUresult;

/// Base names with at least one wrapped ABI variant, each with every
/// variant the table knows and our wrapper of it (None: not wrapped).
struct Entries {
    bases: HashMap<&'static str, Vec<(&'static str, Option<usize>)>>,
    /// Every variant of those base names, wrapped or not.
    variants: HashSet<&'static str>,
    /// The newest CUDA version any entry of the table was introduced in:
    /// above it the driver may hand out a variant we do not know.
    newest: i32,
}

fn entries() -> &'static Entries {
    static E: OnceLock<Entries> = OnceLock::new();
    E.get_or_init(|| {
        let mut bases = HashMap::new();
        let mut newest = 0;
        for p in cuda_abi::procs() {
            let variants: Vec<(&'static str, Option<usize>)> = p
                .plain
                .iter()
                .chain(p.per_thread)
                .map(|&(v, n)| {
                    newest = newest.max(v);
                    (
                        n,
                        crate::trampoline::wrapper(n.as_bytes()).map(|f| f as usize),
                    )
                })
                .collect();
            if variants.iter().any(|(_, w)| w.is_some()) {
                bases.insert(p.name, variants);
            }
        }
        let variants = bases.values().flatten().map(|&(n, _)| n).collect();
        Entries {
            bases,
            variants,
            newest,
        }
    })
}

/// What to do with a successful answer of the real driver.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Not a function we enforce: the driver's pointer stands.
    Keep,
    /// Our wrapper of the requested entry.
    Ours(usize),
    /// Ours, if the driver's answer at `known` (the newest version our
    /// table knows) is the same entry as its answer at the requested one.
    OursIfSameAs { ours: usize, known: i32 },
    /// Enforced, but we have no wrapper for what was asked.
    Refuse(&'static str),
}

/// The answer for a driver pointer that is the real library's export
/// `exported`: our wrapper of it; refused if it is a variant of an enforced
/// base we do not wrap; the driver's own pointer otherwise.
fn decide_export(exported: &str) -> Decision {
    match crate::trampoline::wrapper(exported.as_bytes()) {
        Some(w) => Decision::Ours(w as usize),
        None if entries().variants.contains(exported) => {
            Decision::Refuse("no wrapper for the variant the driver handed out")
        }
        None => Decision::Keep,
    }
}

/// The real libcuda's exported function at address `p`, if any.
fn exported_at(p: usize) -> Option<&'static str> {
    static BY_ADDRESS: OnceLock<HashMap<usize, &'static str>> = OnceLock::new();
    BY_ADDRESS
        .get_or_init(|| {
            cuda_abi::libcuda_symbols()
                .filter_map(|n| {
                    let a = crate::real::sym(Lib::Cuda, &CString::new(n).ok()?);
                    (a != 0).then_some((a, n))
                })
                .collect()
        })
        .get(&p)
        .copied()
}

/// The real driver's CUDA version (cuDriverGetVersion), 0 if it will not say.
fn driver_cuda_version() -> i32 {
    static V: OnceLock<i32> = OnceLock::new();
    *V.get_or_init(|| {
        type DriverGetVersion = unsafe extern "C" fn(*mut i32) -> CUresult;
        let f = real_cuda!(cuDriverGetVersion: DriverGetVersion);
        let mut v = 0;
        // SAFETY: the real driver's function of this exact signature, resolved by name;
        // `v` is our local.
        if unsafe { f(&mut v) } == CUDA_SUCCESS {
            v
        } else {
            0
        }
    })
}

/// The table's answer, for a driver pointer that is no export of the real
/// library. A driver answers a version above its own with its newest
/// variant (NVIDIA 535/550): so does the table, capped at that version.
fn decide(name: &str, version: i32, flags: u64) -> Decision {
    let e = entries();
    let Some(variants) = e.bases.get(name) else {
        // Not a base name we enforce. A driver that accepts a full symbol
        // name ("cuMemAlloc_v2") means that symbol: ours if we wrap it.
        return match crate::trampoline::wrapper(name.as_bytes()) {
            Some(w) if cuda_abi::build::is_api_name(name, "cu") => Decision::Ours(w as usize),
            _ => Decision::Keep,
        };
    };
    let Ok(exported) = cuda_abi::resolve(name, version, flags) else {
        // The driver found it, our table does not (at this version): we
        // cannot tell which variant that is.
        return Decision::Refuse("the table has no variant at this version");
    };
    match variants.iter().find(|(n, _)| *n == exported) {
        Some(&(_, Some(ours))) if version > e.newest => Decision::OursIfSameAs {
            ours,
            known: e.newest,
        },
        Some(&(_, Some(ours))) => Decision::Ours(ours),
        _ => Decision::Refuse("no wrapper for this variant"),
    }
}

/// Applies [`decide`] to the real driver's answer. `ask(version)` asks the
/// real driver again (for the newer-than-the-table check). Returns the
/// status to give the caller.
unsafe fn substitute(
    r: CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
    ask: impl Fn(i32) -> Option<usize>,
) -> CUresult {
    // SAFETY: `pfn` is non-NULL (checked just before) and the caller's out-pointer, which the
    // real driver filled.
    if r != CUDA_SUCCESS || symbol.is_null() || pfn.is_null() || unsafe { *pfn }.is_null() {
        return r;
    }
    if matches!(config::mode(), Mode::PassThrough) {
        return r;
    }
    // SAFETY: `symbol` is non-NULL (checked above) and the caller's NUL-terminated name (CUDA
    // ABI).
    let name = unsafe { CStr::from_ptr(symbol) };
    let Ok(n) = name.to_str() else {
        return r;
    };
    // SAFETY: `pfn` is non-NULL (checked above) and the caller's out-pointer.
    let given = unsafe { *pfn } as usize;
    let decision = match exported_at(given) {
        Some(exported) => decide_export(exported),
        None => match driver_cuda_version() {
            0 => decide(n, version, flags),
            driver => decide(n, version.min(driver), flags),
        },
    };
    let why = match decision {
        Decision::Keep => return r,
        Decision::Ours(w) => {
            // SAFETY: `pfn` is non-NULL (checked above) and the caller's out-pointer.
            unsafe { *pfn = w as *mut c_void };
            return r;
        }
        Decision::OursIfSameAs { ours, known } => {
            // SAFETY: `pfn` is non-NULL (checked above) and the caller's out-pointer.
            if ask(known) == Some(unsafe { *pfn } as usize) {
                // SAFETY: `pfn` is non-NULL (checked above) and the caller's out-pointer.
                unsafe { *pfn = ours as *mut c_void };
                return r;
            }
            "the driver hands out a variant newer than the interposer's table"
        }
        Decision::Refuse(why) => why,
    };
    log!(
        Warn,
        "cuGetProcAddress({name:?}, {version}, {flags}): {why}; refusing it rather than \
         handing out an unenforced function"
    );
    // SAFETY: `pfn` is non-NULL (checked on entry) and the caller's out-pointer.
    unsafe { *pfn = std::ptr::null_mut() };
    if !status.is_null() {
        // SAFETY: `status` is non-NULL (checked just above) and the caller's out-pointer.
        unsafe { *status = cuda_abi::ProcStatus::SymbolNotFound as i32 };
    }
    CUDA_ERROR_NOT_FOUND
}

cuda_exports! {
    fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64, status: *mut i32) {
        let f = real_cuda!(cuGetProcAddress_v2: GetProcV2);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(symbol, pfn, version, flags, status) };
        let ask = |v: i32| {
            let mut p = std::ptr::null_mut();
            let mut s = 0;
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            (unsafe { f(symbol, &mut p, v, flags, &mut s) } == CUDA_SUCCESS).then_some(p as usize)
        };
        // SAFETY: `symbol`, `pfn` and `status` are our caller's, NULL or valid
        // (CUDA ABI), as `substitute` requires.
        unsafe { substitute(r, symbol, pfn, version, flags, status, ask) }
    }

    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64) {
        let f = real_cuda!(cuGetProcAddress: GetProcV1);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(symbol, pfn, version, flags) };
        let ask = |v: i32| {
            let mut p = std::ptr::null_mut();
            // SAFETY: the real driver's function of this exact signature, resolved by
            // name; pointers are our caller's (passed on unchanged) or our own locals.
            (unsafe { f(symbol, &mut p, v, flags) } == CUDA_SUCCESS).then_some(p as usize)
        };
        // SAFETY: `symbol`, `pfn` and `status` are our caller's, NULL or valid
        // (CUDA ABI), as `substitute` requires.
        unsafe { substitute(r, symbol, pfn, version, flags, std::ptr::null_mut(), ask) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_abi::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM as PTDS;

    fn ours(name: &str) -> usize {
        crate::trampoline::wrapper(name.as_bytes()).unwrap() as usize
    }

    /// `name` asked for at `version` with `flags` is our wrapper `symbol`.
    fn assert_ours(name: &str, version: i32, flags: u64, symbol: &str) {
        assert_eq!(
            decide(name, version, flags),
            Decision::Ours(ours(symbol)),
            "{name} {version} {flags:#x}"
        );
    }

    #[test]
    fn enforced_entries_map_to_the_wrapper_of_the_requested_variant() {
        assert_ours("cuMemAlloc", 12000, 0, "cuMemAlloc_v2");
        assert_ours("cuMemAlloc", 2000, 0, "cuMemAlloc");
        assert_ours("cuLaunchKernel", 12000, PTDS, "cuLaunchKernel_ptsz");
        assert_ours("cuLaunchKernel", 12000, 0, "cuLaunchKernel");
        assert_ours("cuStreamQuery", 12000, PTDS, "cuStreamQuery_ptsz");
        assert_ours("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
        // A full symbol name, if a driver accepts it, is that symbol.
        assert_ours("cuMemAlloc_v2", 12000, 0, "cuMemAlloc_v2");
    }

    #[test]
    fn unenforced_entries_keep_the_drivers_pointer() {
        assert_eq!(decide("cuMemcpyHtoD", 12000, PTDS), Decision::Keep);
        assert_eq!(decide("cuStreamGetPriority", 12000, 0), Decision::Keep);
        assert_eq!(decide("cuNoSuchThing", 12000, 0), Decision::Keep);
    }

    #[test]
    fn newer_than_the_table_is_checked_against_the_newest_known_answer() {
        let newest = entries().newest;
        assert!(newest >= 12000, "{newest}");
        assert_eq!(
            decide("cuMemAlloc", newest + 10, 0),
            Decision::OursIfSameAs {
                ours: ours("cuMemAlloc_v2"),
                known: newest
            }
        );
    }

    #[test]
    fn an_enforced_base_without_a_wrapped_variant_is_refused() {
        // Every enforced base: every variant the table knows is wrapped, or
        // asking for it is refused (never Keep).
        for (base, variants) in &entries().bases {
            for (name, w) in variants {
                if w.is_none() {
                    eprintln!("{base}: {name} not wrapped");
                }
            }
        }
        assert!(matches!(decide("cuMemAlloc", 1000, 0), Decision::Refuse(_)));
    }
}
