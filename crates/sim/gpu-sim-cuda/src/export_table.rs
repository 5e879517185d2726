//! `cuGetExportTable`: the driver's private tables, asked for by UUID, that
//! NVIDIA's runtime (libcudart) needs before it does anything (it gives up
//! with cudaErrorNotSupported when the driver knows none of them).
//!
//! The UUIDs, the slots and their signatures are public reverse-engineering
//! results: ZLUDA's `dark_api/src/lib.rs` and `zluda/src/impl/driver.rs`
//! (github.com/vosen/ZLUDA, "dark API"); the table sizes are what NVIDIA's
//! 550.163.01 driver answers (the first word of a table is its byte size, where
//! it has one). Slots whose meaning is not known are filled with functions
//! that say which slot was called and fail with CUDA_ERROR_NOT_SUPPORTED, so
//! a runtime that needs one names it instead of jumping to NULL.
//!
//! What runtimes 12.4, 12.9 and 13.5 call (tests/sim_cudart.rs, traced):
//! CUDART slot 2 (and 12 from 13.x), the context-local storage, the tools
//! buffers (slots 2 and 6), the integrity check, context checks slots 2 and
//! 3; not the fatbin-loading slots (their fatbins go through
//! cuLibraryLoadData, with lazy or eager loading). CUDA 13 runtimes also
//! require `{21318C60-...}` to exist.

mod cls;
mod integrity;
mod tools;

use crate::{R, drv, put};
use cuda_abi::*;
use std::ffi::c_void;
use std::sync::Mutex;

/// A table as the runtime reads it: an array of words (a size, function
/// pointers, NULLs).
#[repr(C)]
struct Table<const N: usize>([*const c_void; N]);

// SAFETY: immutable statics of code addresses and integers; never written.
unsafe impl<const N: usize> Sync for Table<N> {}

impl<const N: usize> Table<N> {
    /// The table with slot `i` known.
    const fn with(mut self, i: usize, f: *const c_void) -> Self {
        self.0[i] = f;
        self
    }

    const fn addr(&'static self) -> *const c_void {
        self as *const Self as *const c_void
    }
}

/// The byte size word that starts most tables.
const fn size_word(slots: usize) -> *const c_void {
    (slots * size_of::<usize>()) as *const c_void
}

/// A slot of table `T` at index `S` whose use is unknown: says so once and
/// fails (a distinct function per slot).
unsafe extern "C" fn unknown<const T: usize, const S: usize>() -> CUresult {
    static SEEN: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    let mut seen = crate::lock(&SEEN);
    if !seen.contains(&(T, S)) {
        seen.push((T, S));
        eprintln!(
            "gpu-sim libcuda: export table {} slot {S} is not implemented",
            NAMES[T]
        );
    }
    CUDA_ERROR_NOT_SUPPORTED
}

macro_rules! u {
    ($t:expr, $s:expr) => {
        unknown::<$t, $s> as *const c_void
    };
}

/// A table whose slots are all of unknown use: its size word, then
/// [`unknown`] for each slot listed.
macro_rules! unknown_table {
    ($t:expr; $($s:literal)*) => {
        Table([size_word(1 + [$($s),*].len()), $(u!($t, $s)),*])
    };
}

const CUDART: usize = 0;
const TOOLS_TLS: usize = 1;
const TOOLS_HOOKS: usize = 2;
const DEVICE_EXT: usize = 5;
const INTEGRITY: usize = 6;
const CTX_CHECKS: usize = 7;
const RUNTIME13: usize = 8;

const NAMES: [&str; 9] = [
    "CUDART_INTERFACE {6BD5FB6C-5BF4-E74A-8987-D93912FD9DF9}",
    "TOOLS_TLS {42D85A81-23F6-CB47-8298-F6E78A3AECDC}",
    "TOOLS_RUNTIME_CALLBACK_HOOKS {A094798C-2E74-2E74-93F2-0800200C0A66}",
    "CONTEXT_LOCAL_STORAGE {C693336E-1121-DF11-A8C3-68F355D89593}",
    "CTX_CREATE_BYPASS {0CA50B8C-1004-929A-89A7-D0DF10E77286}",
    "DEVICE_EXTENDED_RT {B10541E1-F7C7-C74A-9F64-F223BE99F1E2}",
    "INTEGRITY_CHECK {D4082055-BDE6-704B-8D34-BA123C66E1F2}",
    "CONTEXT_CHECKS {263E8860-7CD2-6143-92F6-BBD5006DFA7E}",
    "RUNTIME13 {21318C60-9714-3248-8CA6-41FF7324C8F2}",
];

/// The runtime's interface: module loading from its registered fatbins and
/// the primary context. 13 slots (550 has 12; CUDA 13 runtimes also call
/// slot 12); slot 10 is NULL in NVIDIA's drivers too.
static CUDART_TABLE: Table<13> = Table([
    size_word(13),
    get_module_from_cubin as *const c_void,
    primary_context as *const c_void,
    u!(CUDART, 3),
    u!(CUDART, 4),
    u!(CUDART, 5),
    get_module_from_cubin_ext1 as *const c_void,
    cudart_fn7 as *const c_void,
    get_module_from_cubin_ext2 as *const c_void,
    u!(CUDART, 9),
    std::ptr::null(),
    u!(CUDART, 11),
    load_compilers as *const c_void,
]);

/// Slot 2: the current context (cuBLASLt 13, `tools.rs`).
static TOOLS_TLS_TABLE: Table<3> = Table([
    size_word(3),
    u!(TOOLS_TLS, 1),
    tools::current_context as *const c_void,
]);

static TOOLS_HOOKS_TABLE: Table<7> = Table([
    size_word(7),
    u!(TOOLS_HOOKS, 1),
    tools_buffer1 as *const c_void,
    u!(TOOLS_HOOKS, 3),
    u!(TOOLS_HOOKS, 4),
    u!(TOOLS_HOOKS, 5),
    tools_buffer2 as *const c_void,
]);

/// No size word: three functions and a NULL.
static CLS_TABLE: Table<4> = Table([
    cls::put_value as *const c_void,
    cls::delete_value as *const c_void,
    cls::get_value as *const c_void,
    std::ptr::null(),
]);

static CTX_BYPASS_TABLE: Table<2> = Table([size_word(2), ctx_create_bypass as *const c_void]);

/// 28 slots as in 550; none known to be needed by the runtime on Linux.
static DEVICE_EXT_TABLE: Table<28> = unknown_table!(DEVICE_EXT;
    1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27);

/// Unknown to ZLUDA; CUDA 13 runtimes give up (cudaErrorInvalidValue from
/// everything) when the driver lacks it, but called none of its slots in
/// our tests; cuBLASLt 13 calls slot 4, a context's id (`tools.rs`). 86
/// slots as in 550 (535 has 77).
static RUNTIME13_TABLE: Table<86> = unknown_table!(RUNTIME13;
    1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30
    31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58
    59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85)
.with(4, tools::context_id as *const c_void);

static INTEGRITY_TABLE: Table<3> = Table([
    size_word(3),
    integrity_check as *const c_void,
    u!(INTEGRITY, 2),
]);

static CTX_CHECKS_TABLE: Table<5> = Table([
    size_word(5),
    u!(CTX_CHECKS, 1),
    context_check as *const c_void,
    context_check_flags as *const c_void,
    u!(CTX_CHECKS, 4),
]);

/// UUID (bytes in the order they are written) -> table.
fn lookup(id: &[u8; 16]) -> Option<*const c_void> {
    const fn uuid(s: u128) -> [u8; 16] {
        s.to_be_bytes()
    }
    let tables: [([u8; 16], *const c_void); 9] = [
        (
            uuid(0x6BD5FB6C_5BF4_E74A_8987_D93912FD9DF9),
            CUDART_TABLE.addr(),
        ),
        (
            uuid(0x42D85A81_23F6_CB47_8298_F6E78A3AECDC),
            TOOLS_TLS_TABLE.addr(),
        ),
        (
            uuid(0xA094798C_2E74_2E74_93F2_0800200C0A66),
            TOOLS_HOOKS_TABLE.addr(),
        ),
        (
            uuid(0xC693336E_1121_DF11_A8C3_68F355D89593),
            CLS_TABLE.addr(),
        ),
        (
            uuid(0x0CA50B8C_1004_929A_89A7_D0DF10E77286),
            CTX_BYPASS_TABLE.addr(),
        ),
        (
            uuid(0xB10541E1_F7C7_C74A_9F64_F223BE99F1E2),
            DEVICE_EXT_TABLE.addr(),
        ),
        (
            uuid(0xD4082055_BDE6_704B_8D34_BA123C66E1F2),
            INTEGRITY_TABLE.addr(),
        ),
        (
            uuid(0x263E8860_7CD2_6143_92F6_BBD5006DFA7E),
            CTX_CHECKS_TABLE.addr(),
        ),
        (
            uuid(0x21318C60_9714_3248_8CA6_41FF7324C8F2),
            RUNTIME13_TABLE.addr(),
        ),
    ];
    tables.iter().find(|(u, _)| u == id).map(|&(_, t)| t)
}

fn result(r: R) -> CUresult {
    r.err().unwrap_or(CUDA_SUCCESS)
}

const FATBIN_WRAPPER_MAGIC: u32 = 0x466243b1;
const FATBIN_MAGIC: u32 = 0xba55ed50;

/// Loads a registered fatbinary (`__fatBinC_Wrapper_t` or the fatbin
/// itself) into the current context, as cuModuleLoadData would.
unsafe fn load_fatbin(out: *mut *mut c_void, image: *const c_void) -> R {
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a non-NULL image of the runtime's starts with a 4-byte magic.
    let magic = unsafe { image.cast::<u32>().read_unaligned() };
    if magic != FATBIN_WRAPPER_MAGIC && magic != FATBIN_MAGIC {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    // SAFETY: `out` and `image` as our caller passed them; the load checks
    // `out` and reads the image's headers.
    match unsafe { crate::module::cuModuleLoadData(out, image) } {
        CUDA_SUCCESS => Ok(()),
        e => Err(e),
    }
}

/// Slot 1: (module out, fatbin wrapper).
unsafe extern "C" fn get_module_from_cubin(
    out: *mut *mut c_void,
    wrapper: *const c_void,
) -> CUresult {
    // SAFETY: the runtime's pointers, passed on; see `load_fatbin`.
    result(unsafe { load_fatbin(out, wrapper) })
}

/// Slot 6: as slot 1, with three more arguments (NULL, NULL, 0 from the
/// runtime on Linux).
unsafe extern "C" fn get_module_from_cubin_ext1(
    out: *mut *mut c_void,
    wrapper: *const c_void,
    _a3: *mut c_void,
    _a4: *mut c_void,
    _a5: u32,
) -> CUresult {
    // SAFETY: the runtime's pointers, passed on; see `load_fatbin`.
    result(unsafe { load_fatbin(out, wrapper) })
}

/// Slot 8: the fatbin itself first, then the module out.
unsafe extern "C" fn get_module_from_cubin_ext2(
    fatbin: *const c_void,
    out: *mut *mut c_void,
    _a3: *mut c_void,
    _a4: *mut c_void,
    _a5: u32,
) -> CUresult {
    // SAFETY: the runtime's pointers, passed on; see `load_fatbin`.
    result(unsafe { load_fatbin(out, fatbin) })
}

/// Slot 2: the device's primary context, without retaining it (the runtime
/// retains it itself through cuDevicePrimaryCtxRetain).
unsafe extern "C" fn primary_context(out: *mut *mut c_void, dev: i32) -> CUresult {
    result(drv().and_then(|d| put(out, d.device(dev)?.primary.handle())))
}

/// Slot 7: takes a word, returns nothing; nothing to do here.
unsafe extern "C" fn cudart_fn7(_arg: usize) {}

/// Slot 12 (CUDA 13 runtimes): loads the PTX JIT and libnvvm; none here.
unsafe extern "C" fn load_compilers() -> CUresult {
    CUDA_SUCCESS
}

/// Two buffers the runtime's tool callbacks write into (sizes as ZLUDA
/// found them: 1024 and 14 words).
struct Buffer<const N: usize>(std::cell::UnsafeCell<[u32; N]>);
// SAFETY: the memory is handed to the runtime, which owns its use; Rust never
// reads or writes it after initialisation.
unsafe impl<const N: usize> Sync for Buffer<N> {}
static BUFFER1: Buffer<1024> = Buffer(std::cell::UnsafeCell::new([0; 1024]));
static BUFFER2: Buffer<14> = Buffer(std::cell::UnsafeCell::new([0; 14]));

unsafe fn hand_out<const N: usize>(b: &'static Buffer<N>, ptr: *mut *mut c_void, size: *mut usize) {
    let _ = put(ptr, b.0.get().cast());
    let _ = put(size, N);
}

unsafe extern "C" fn tools_buffer1(ptr: *mut *mut c_void, size: *mut usize) {
    // SAFETY: out-pointers of the runtime's, NULL-checked by `put`.
    unsafe { hand_out(&BUFFER1, ptr, size) }
}

unsafe extern "C" fn tools_buffer2(ptr: *mut *mut c_void, size: *mut usize) {
    // SAFETY: out-pointers of the runtime's, NULL-checked by `put`.
    unsafe { hand_out(&BUFFER2, ptr, size) }
}

/// cuCtxCreate_v2 by another door.
unsafe extern "C" fn ctx_create_bypass(out: *mut *mut c_void, flags: u32, dev: i32) -> CUresult {
    // SAFETY: the runtime's arguments, passed on unchanged.
    unsafe { crate::ctx::cuCtxCreate_v2(out, flags, dev) }
}

/// Context checks (550): no flags set on any context.
unsafe extern "C" fn context_check(
    _ctx: *mut c_void,
    flags: *mut u32,
    _other: *mut *const c_void,
) -> CUresult {
    result(put(flags, 0))
}

unsafe extern "C" fn context_check_flags() -> u32 {
    0
}

/// Slot 1 of INTEGRITY_CHECK: (version, unix time, 16 bytes out).
unsafe extern "C" fn integrity_check(
    version: u32,
    unix_seconds: u64,
    out: *mut [u64; 2],
) -> CUresult {
    result(integrity(version, unix_seconds).and_then(|h| put(out, h)))
}

fn integrity(version: u32, unix_seconds: u64) -> R<[u64; 2]> {
    let d = drv()?;
    let devices: Vec<integrity::DeviceInfo> = d
        .devices
        .iter()
        .map(|dev| {
            let g = dev.spec;
            let (domain, bus, device, _) = g.pci_location();
            integrity::DeviceInfo {
                uuid: crate::device::uuid_bytes(&g.uuid),
                pci: [domain as i32, bus as i32, device as i32],
            }
        })
        .collect();
    let inputs = integrity::Inputs {
        driver_version: crate::driver_version().unwrap_or(0) as u32,
        version,
        process: std::process::id(),
        // SAFETY: pthread_self has no preconditions.
        thread: unsafe { libc::pthread_self() } as u32,
        cudart_table: CUDART_TABLE.addr() as usize,
        integrity_table: INTEGRITY_TABLE.addr() as usize,
        check_fn: INTEGRITY_TABLE.0[1] as usize,
        unix_seconds,
    };
    Ok(integrity::check(&inputs, &devices))
}

cuda_fn! {
    fn cuGetExportTable(out: *mut *const c_void, id: *const [u8; 16]) {
        put(out, std::ptr::null())?;
        let id = crate::get(id)?;
        // The real drivers answer INVALID_VALUE for a UUID they do not know.
        let table = lookup(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        put(out, table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(uuid: u128) -> Result<*const usize, CUresult> {
        let mut out: *const c_void = std::ptr::dangling();
        let id = uuid.to_be_bytes();
        // SAFETY: a valid out-pointer and a 16-byte UUID.
        match unsafe { cuGetExportTable(&mut out, &id) } {
            CUDA_SUCCESS => Ok(out.cast()),
            e => {
                assert!(out.is_null(), "a refused table is NULL");
                Err(e)
            }
        }
    }

    /// The size words NVIDIA's 550 driver answers (CUDART: 550 has 12
    /// slots, CUDA 13 runtimes use a 13th).
    #[test]
    fn tables_carry_their_size_and_unknown_ids_are_refused() {
        for (uuid, bytes) in [
            (0x6BD5FB6C_5BF4_E74A_8987_D93912FD9DF9, 104),
            (0x42D85A81_23F6_CB47_8298_F6E78A3AECDC, 24),
            (0xA094798C_2E74_2E74_93F2_0800200C0A66, 56),
            (0x0CA50B8C_1004_929A_89A7_D0DF10E77286, 16),
            (0xB10541E1_F7C7_C74A_9F64_F223BE99F1E2, 224),
            (0xD4082055_BDE6_704B_8D34_BA123C66E1F2, 24),
            (0x263E8860_7CD2_6143_92F6_BBD5006DFA7E, 40),
            (0x21318C60_9714_3248_8CA6_41FF7324C8F2, 688),
        ] {
            let t = table(uuid).unwrap();
            // SAFETY: the tables are statics of at least one word.
            assert_eq!(unsafe { *t }, bytes, "{uuid:032X}");
        }
        // Context-local storage: functions from the first word, no size.
        let cls = table(0xC693336E_1121_DF11_A8C3_68F355D89593).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { *cls }, cls::put_value as *const () as usize);
        // What NVIDIA's Linux drivers do not know either (ZLUDA's heap and
        // Windows hybrid-runtime tables).
        for uuid in [
            0x195BCBF4_D67D_024A_ACC5_1D29CEA631AE,
            0xDD9E98A4_F410_4844_99B0_E2AEB7B432B5,
        ] {
            assert_eq!(table(uuid), Err(CUDA_ERROR_INVALID_VALUE));
        }
    }
}
