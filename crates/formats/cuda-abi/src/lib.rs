//! The CUDA driver ABI as plain data, shared by the simulated driver and the
//! interposer: `CUresult` codes and their names, the device attributes the
//! simulator answers, how `cuGetProcAddress` maps a base name, a requested
//! CUDA version and flags to an exported symbol, and the list of every symbol
//! the real `libcuda.so` exports.
//!
//! `src/table.rs`, `src/results.rs` and `symbols/libcuda.txt` are generated
//! by `symbols/gen.py` from NVIDIA's headers (cudaTypedefs.h, cuda.h of the
//! CUDA 12.9 and 13.5 runtime wheels).

mod results;
mod table;

pub use results::RESULT_NAMES;

/// `CUresult`.
pub type CUresult = i32;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_CONTEXT_ALREADY_CURRENT: CUresult = 202;
pub const CUDA_ERROR_FILE_NOT_FOUND: CUresult = 301;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
pub const CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: CUresult = 705;
pub const CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE: CUresult = 708;
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = 709;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CUresult` name, as `cuGetErrorName` reports it.
pub fn error_name(code: CUresult) -> Option<&'static str> {
    RESULT_NAMES
        .binary_search_by_key(&code, |&(v, _)| v)
        .ok()
        .map(|i| RESULT_NAMES[i].1)
}

/// Description, as `cuGetErrorString` reports it (the real driver's wording
/// for the common codes; a plain rendering of the name otherwise).
pub fn error_string(code: CUresult) -> Option<&'static str> {
    let s = match code {
        0 => "no error",
        1 => "invalid argument",
        2 => "out of memory",
        3 => "initialization error",
        4 => "driver shutting down",
        34 => "CUDA driver is a stub library",
        46 => "CUDA-capable device(s) is/are busy or unavailable",
        100 => "no CUDA-capable device is detected",
        101 => "invalid device ordinal",
        200 => "device kernel image is invalid",
        201 => "invalid device context",
        202 => "context already current",
        209 => "no kernel image is available for execution on the device",
        218 => "a PTX JIT compilation failed",
        300 => "invalid source",
        301 => "file not found",
        400 => "invalid resource handle",
        401 => "the provided resource handle is not in a valid state",
        500 => "named symbol not found",
        600 => "device not ready",
        700 => "an illegal memory access was encountered",
        701 => "too many resources requested for launch",
        702 => "the launch timed out and was terminated",
        704 => "peer access is already enabled",
        705 => "peer access has not been enabled",
        708 => "primary context active",
        709 => "context is destroyed",
        719 => "unspecified launch failure",
        800 => "operation not permitted",
        801 => "operation not supported",
        803 => "system has unsupported display driver / cuda driver combination",
        804 => "forward compatibility was attempted on non supported HW",
        999 => "unknown error",
        _ => return error_name(code).map(describe),
    };
    Some(s)
}

/// "CUDA_ERROR_LAUNCH_TIMEOUT" -> "launch timeout", leaked once per code
/// (bounded: there are ~100 codes).
fn describe(name: &'static str) -> &'static str {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<&'static str, &'static str>>> = OnceLock::new();
    let mut map = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    map.entry(name).or_insert_with(|| {
        let s = name
            .trim_start_matches("CUDA_ERROR_")
            .to_ascii_lowercase()
            .replace('_', " ");
        Box::leak(s.into_boxed_str())
    })
}

/// `CUdevice_attribute` values the simulator answers.
pub mod attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 1;
    pub const MAX_BLOCK_DIM_X: i32 = 2;
    pub const MAX_BLOCK_DIM_Y: i32 = 3;
    pub const MAX_BLOCK_DIM_Z: i32 = 4;
    pub const MAX_GRID_DIM_X: i32 = 5;
    pub const MAX_GRID_DIM_Y: i32 = 6;
    pub const MAX_GRID_DIM_Z: i32 = 7;
    pub const MAX_SHARED_MEMORY_PER_BLOCK: i32 = 8;
    pub const TOTAL_CONSTANT_MEMORY: i32 = 9;
    pub const WARP_SIZE: i32 = 10;
    pub const MAX_PITCH: i32 = 11;
    pub const MAX_REGISTERS_PER_BLOCK: i32 = 12;
    pub const CLOCK_RATE: i32 = 13;
    pub const TEXTURE_ALIGNMENT: i32 = 14;
    pub const GPU_OVERLAP: i32 = 15;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const KERNEL_EXEC_TIMEOUT: i32 = 17;
    pub const INTEGRATED: i32 = 18;
    pub const CAN_MAP_HOST_MEMORY: i32 = 19;
    pub const COMPUTE_MODE: i32 = 20;
    pub const CONCURRENT_KERNELS: i32 = 31;
    pub const ECC_ENABLED: i32 = 32;
    pub const PCI_BUS_ID: i32 = 33;
    pub const PCI_DEVICE_ID: i32 = 34;
    pub const TCC_DRIVER: i32 = 35;
    pub const MEMORY_CLOCK_RATE: i32 = 36;
    pub const GLOBAL_MEMORY_BUS_WIDTH: i32 = 37;
    pub const L2_CACHE_SIZE: i32 = 38;
    pub const MAX_THREADS_PER_MULTIPROCESSOR: i32 = 39;
    pub const ASYNC_ENGINE_COUNT: i32 = 40;
    pub const UNIFIED_ADDRESSING: i32 = 41;
    pub const PCI_DOMAIN_ID: i32 = 50;
    pub const TEXTURE_PITCH_ALIGNMENT: i32 = 51;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 76;
    pub const STREAM_PRIORITIES_SUPPORTED: i32 = 78;
    pub const GLOBAL_L1_CACHE_SUPPORTED: i32 = 79;
    pub const LOCAL_L1_CACHE_SUPPORTED: i32 = 80;
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: i32 = 81;
    pub const MAX_REGISTERS_PER_MULTIPROCESSOR: i32 = 82;
    pub const MANAGED_MEMORY: i32 = 83;
    pub const MULTI_GPU_BOARD: i32 = 84;
    pub const MULTI_GPU_BOARD_GROUP_ID: i32 = 85;
    pub const HOST_NATIVE_ATOMIC_SUPPORTED: i32 = 86;
    pub const SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO: i32 = 87;
    pub const PAGEABLE_MEMORY_ACCESS: i32 = 88;
    pub const CONCURRENT_MANAGED_ACCESS: i32 = 89;
    pub const COMPUTE_PREEMPTION_SUPPORTED: i32 = 90;
    pub const CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: i32 = 91;
    pub const COOPERATIVE_LAUNCH: i32 = 95;
    pub const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: i32 = 97;
    pub const HOST_REGISTER_SUPPORTED: i32 = 99;
    pub const VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: i32 = 102;
    pub const HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: i32 = 103;
    pub const MAX_BLOCKS_PER_MULTIPROCESSOR: i32 = 106;
    pub const MAX_PERSISTING_L2_CACHE_SIZE: i32 = 108;
    pub const MAX_ACCESS_POLICY_WINDOW_SIZE: i32 = 109;
    pub const RESERVED_SHARED_MEMORY_PER_BLOCK: i32 = 111;
    pub const MEMORY_POOLS_SUPPORTED: i32 = 115;
    pub const MEMPOOL_SUPPORTED_HANDLE_TYPES: i32 = 119;
    /// Contexts on the device are clients of an MPS server (cuda.h 12.9
    /// and 13: `CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133`).
    pub const MPS_ENABLED: i32 = 133;
}

/// `CUdriverProcAddress_flags`.
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// `CUdriverProcAddressQueryResult` for a lookup that found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum ProcStatus {
    /// The driver has no function of that name.
    SymbolNotFound = 1,
    /// The function exists but was introduced after the requested version.
    VersionNotSufficient = 2,
}

/// One base name's ABI variants.
#[derive(Debug)]
pub struct Proc {
    pub name: &'static str,
    /// (introduced in cudaVersion, exported symbol), ascending.
    pub plain: &'static [(i32, &'static str)],
    /// Per-thread-default-stream variants (`_ptds` / `_ptsz`), ascending.
    pub per_thread: &'static [(i32, &'static str)],
}

/// Every base name `cuGetProcAddress` knows, sorted by name.
pub fn procs() -> &'static [Proc] {
    table::PROCS
}

/// The exported symbol the real driver's `cuGetProcAddress(symbol, ...,
/// cuda_version, flags)` hands out: the newest variant introduced at or
/// before `cuda_version`; with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`
/// its per-thread variant if it has one (introduced by then), the legacy one
/// otherwise, as the documentation says. `symbol` is a base name
/// ("cuMemAlloc"), as clients pass it.
///
/// The caller checks `cuda_version` against the driver's version and the
/// flags for unknown bits; this is the table only.
pub fn resolve(symbol: &str, cuda_version: i32, flags: u64) -> Result<&'static str, ProcStatus> {
    let p = table::PROCS
        .binary_search_by(|p| p.name.cmp(symbol))
        .map(|i| &table::PROCS[i])
        .map_err(|_| ProcStatus::SymbolNotFound)?;
    let &(_, name) = p
        .plain
        .iter()
        .rev()
        .find(|(v, _)| *v <= cuda_version)
        .ok_or(ProcStatus::VersionNotSufficient)?;
    if flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0 {
        // Only the per-thread twin of the chosen ABI variant: an older one
        // would have another signature.
        if let Some(&(_, pt)) = p.per_thread.iter().rev().find(|(v, _)| *v <= cuda_version)
            && pt.len() == name.len() + 5
            && pt.starts_with(name)
        {
            return Ok(pt);
        }
    }
    Ok(name)
}

/// Every symbol the real `libcuda.so` exports, one per line.
pub const LIBCUDA_SYMBOLS: &str = include_str!("../symbols/libcuda.txt");

/// Iterator over [`LIBCUDA_SYMBOLS`].
pub fn libcuda_symbols() -> impl Iterator<Item = &'static str> {
    LIBCUDA_SYMBOLS.lines().filter(|l| !l.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTDS: u64 = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

    #[test]
    fn picks_newest_variant_not_after_the_version() {
        assert_eq!(resolve("cuMemAlloc", 3020, 0), Ok("cuMemAlloc_v2"));
        assert_eq!(resolve("cuMemAlloc", 13000, 0), Ok("cuMemAlloc_v2"));
        assert_eq!(resolve("cuMemAlloc", 2000, 0), Ok("cuMemAlloc"));
        assert_eq!(
            resolve("cuMemAlloc", 1000, 0),
            Err(ProcStatus::VersionNotSufficient)
        );
        assert_eq!(resolve("cuCtxCreate", 3020, 0), Ok("cuCtxCreate_v2"));
        assert_eq!(resolve("cuCtxCreate", 11040, 0), Ok("cuCtxCreate_v3"));
        assert_eq!(resolve("cuCtxCreate", 12050, 0), Ok("cuCtxCreate_v4"));
        assert_eq!(resolve("cuDeviceGetUuid", 9020, 0), Ok("cuDeviceGetUuid"));
        assert_eq!(
            resolve("cuDeviceGetUuid", 11040, 0),
            Ok("cuDeviceGetUuid_v2")
        );
        assert_eq!(
            resolve("cuGetProcAddress", 12000, 0),
            Ok("cuGetProcAddress_v2")
        );
        assert_eq!(
            resolve("cuGetProcAddress", 11030, 0),
            Ok("cuGetProcAddress")
        );
        assert_eq!(resolve("cuInit", 2000, PTDS), Ok("cuInit"));
        assert_eq!(
            resolve("cuGraphInstantiate", 12000, 0),
            Ok("cuGraphInstantiateWithFlags")
        );
        assert_eq!(
            resolve("cuGraphInstantiate", 11000, 0),
            Ok("cuGraphInstantiate_v2")
        );
    }

    #[test]
    fn unknown_names() {
        assert_eq!(
            resolve("cuNoSuchThing", 12000, 0),
            Err(ProcStatus::SymbolNotFound)
        );
        // Clients pass base names; a versioned name is not one.
        assert_eq!(
            resolve("cuMemAlloc_v2", 12000, 0),
            Err(ProcStatus::SymbolNotFound)
        );
        assert_eq!(resolve("", 12000, 0), Err(ProcStatus::SymbolNotFound));
    }

    #[test]
    fn per_thread_variants() {
        assert_eq!(resolve("cuLaunchKernel", 4000, 0), Ok("cuLaunchKernel"));
        assert_eq!(
            resolve("cuLaunchKernel", 7000, PTDS),
            Ok("cuLaunchKernel_ptsz")
        );
        assert_eq!(
            resolve("cuLaunchKernel", 7000, CU_GET_PROC_ADDRESS_LEGACY_STREAM),
            Ok("cuLaunchKernel")
        );
        // Introduced per-thread only at 7000: legacy below it.
        assert_eq!(resolve("cuMemcpyHtoD", 3020, PTDS), Ok("cuMemcpyHtoD_v2"));
        assert_eq!(
            resolve("cuMemcpyHtoD", 7000, PTDS),
            Ok("cuMemcpyHtoD_v2_ptds")
        );
        assert_eq!(resolve("cuMemcpyHtoD", 7000, 0), Ok("cuMemcpyHtoD_v2"));
        assert_eq!(
            resolve("cuMemsetD32", 7000, PTDS),
            Ok("cuMemsetD32_v2_ptds")
        );
        assert_eq!(
            resolve("cuMemAllocAsync", 11020, PTDS),
            Ok("cuMemAllocAsync_ptsz")
        );
        assert_eq!(
            resolve("cuStreamGetCtx", 12050, PTDS),
            Ok("cuStreamGetCtx_v2_ptsz")
        );
        assert_eq!(
            resolve("cuStreamGetCtx", 11000, PTDS),
            Ok("cuStreamGetCtx_ptsz")
        );
        assert_eq!(resolve("cuMemAlloc", 12000, PTDS), Ok("cuMemAlloc_v2"));
    }

    #[test]
    fn every_resolved_symbol_is_exported() {
        let exports: std::collections::HashSet<_> = libcuda_symbols().collect();
        assert!(exports.len() > 600, "{}", exports.len());
        for p in procs() {
            for &(_, n) in p.plain.iter().chain(p.per_thread) {
                assert!(exports.contains(n), "{n} resolved but not exported");
            }
        }
        for must in [
            "cuInit",
            "cuGetProcAddress_v2",
            "cuMemcpyHtoD_v2_ptds",
            "cuLaunchKernel_ptsz",
        ] {
            assert!(exports.contains(must), "{must}");
        }
        assert!(procs().windows(2).all(|w| w[0].name < w[1].name), "sorted");
    }

    #[test]
    fn debugger_functions_are_exported_but_not_its_variables() {
        let exports: std::collections::HashSet<_> = libcuda_symbols().collect();
        for f in ["cudbgGetAPI", "cudbgApiInit", "cudbgReportDriverApiError"] {
            assert!(exports.contains(f), "{f}");
        }
        for v in ["cudbgDebuggerInitialized", "cudbgIpcFlag", "cudbgSessionId"] {
            assert!(!exports.contains(v), "{v} is a data object");
        }
    }

    #[test]
    fn error_names_and_strings() {
        assert_eq!(error_name(0), Some("CUDA_SUCCESS"));
        assert_eq!(error_name(2), Some("CUDA_ERROR_OUT_OF_MEMORY"));
        assert_eq!(error_name(801), Some("CUDA_ERROR_NOT_SUPPORTED"));
        assert_eq!(error_name(12345), None);
        assert_eq!(error_string(1), Some("invalid argument"));
        assert_eq!(
            error_string(702),
            Some("the launch timed out and was terminated")
        );
        assert!(error_string(710).is_some());
        assert_eq!(error_string(-5), None);
    }
}

/// For build scripts that generate exports from the lists in `symbols/`
/// (the simulated libcuda and libnvidia-ml, and the interposer): one reading
/// of a list and one scan of a crate's sources for the exports it defines.
pub mod build {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// The symbols of an export list, sorted and unique (blank lines and
    /// `#` comments skipped). Tells cargo to rerun when the list changes.
    pub fn symbol_list(path: &Path) -> Vec<String> {
        println!("cargo:rerun-if-changed={}", path.display());
        let text =
            std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let set: BTreeSet<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_string)
            .collect();
        set.into_iter().collect()
    }

    /// Functions defined in `src_dir/*.rs` whose names satisfy `is_export`,
    /// each with the module path that holds it (`crate` for lib.rs,
    /// `crate::<file stem>` otherwise). A definition is a line `fn name(`,
    /// possibly behind `pub`, `unsafe` and `extern "C"` (inside an export
    /// macro or written out). A name defined twice is a build error.
    pub fn exported_fns(
        src_dir: &Path,
        is_export: impl Fn(&str) -> bool,
    ) -> BTreeMap<String, String> {
        println!("cargo:rerun-if-changed={}", src_dir.display());
        let mut found = BTreeMap::new();
        let mut files: Vec<_> = std::fs::read_dir(src_dir)
            .unwrap_or_else(|e| panic!("{}: {e}", src_dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect();
        files.sort();
        for path in files {
            let stem = path.file_stem().unwrap().to_str().unwrap();
            let module = if stem == "lib" {
                "crate".to_string()
            } else {
                format!("crate::{stem}")
            };
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                let mut t = line.trim_start();
                for prefix in ["pub ", "unsafe ", "extern \"C\" "] {
                    t = t.strip_prefix(prefix).unwrap_or(t);
                }
                let Some(rest) = t.strip_prefix("fn ") else {
                    continue;
                };
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !is_export(&name) || !rest[name.len()..].starts_with('(') {
                    continue;
                }
                let previous = found.insert(name.clone(), module.clone());
                assert!(
                    previous.is_none(),
                    "{name} defined twice (in {} and {module})",
                    previous.unwrap()
                );
            }
        }
        found
    }

    /// `prefix` followed by an upper-case letter: `cuInit` for "cu",
    /// `nvmlInit_v2` for "nvml", but not `cuda_fn` or `nvml_error`.
    pub fn is_api_name(name: &str, prefix: &str) -> bool {
        name.strip_prefix(prefix)
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_uppercase()))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn finds_exports_in_every_form() {
            let dir = std::env::temp_dir().join(format!("cuda-abi-build-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("lib.rs"),
                "cuda_fn! {\n    fn cuInit(flags: u32) -> CUresult { 0 }\n}\nfn cuda_helper() {}\n",
            )
            .unwrap();
            std::fs::write(
                dir.join("mem.rs"),
                "pub unsafe extern \"C\" fn nvmlInit_v2() -> u32 { 0 }\npub extern \"C\" fn cuMemAlloc_v2(p: *mut u64) -> i32 { 0 }\n",
            )
            .unwrap();
            let found = exported_fns(&dir, |n| is_api_name(n, "cu") || is_api_name(n, "nvml"));
            std::fs::remove_dir_all(&dir).unwrap();
            let want: Vec<(&str, &str)> = vec![
                ("cuInit", "crate"),
                ("cuMemAlloc_v2", "crate::mem"),
                ("nvmlInit_v2", "crate::mem"),
            ];
            assert_eq!(
                found
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect::<Vec<_>>(),
                want
            );
        }
    }
}
