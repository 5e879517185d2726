//! Modules, libraries and functions. Any image is accepted (there is no GPU
//! to run it); functions are looked up by name and are what launches take.
//! A loaded image takes its size in device memory (charged to the current
//! context, see `charge.rs`) until unloaded. A text image may declare each
//! kernel's timing law (`gpu_sim_core::law`); a kernel it does not name
//! follows the node's default law, and every kernel of a binary image (a
//! real fatbinary or cubin) a law drawn from its name (`Law::undeclared`).

use crate::charge;
use crate::ctx::current;
use crate::launch::FUNC_MAGIC;
use crate::{R, cstr, drv, lock, put};
use cuda_abi::*;
use gpu_sim_core::law::{self, Law};
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;

const MODULE_MAGIC: u64 = 0x5349_4d4d_4f44_0001;
const CUDA_ERROR_INVALID_PTX: CUresult = 218;

/// A function (also used as `CUkernel`, which the real driver lets callers
/// pass where a `CUfunction` is expected). `magic` first: launches check it.
#[repr(C)]
pub(crate) struct Func {
    magic: u64,
    name: Box<str>,
    /// How long its launches run (the device's secret).
    pub(crate) law: Law,
}

struct Module {
    magic: u64,
    funcs: Mutex<HashMap<Box<str>, Box<Func>>>,
    /// Laws a text image declared, by kernel name; `None`: a binary image.
    laws: Option<HashMap<Box<str>, Law>>,
}

/// The laws a text image declares; a malformed declaration makes the image
/// invalid, as malformed PTX is. Binary images (fatbinary, ELF; `None`
/// from [`image_text`]) declare none: `None`.
fn laws_of(image: Option<&[u8]>) -> R<Option<HashMap<Box<str>, Law>>> {
    let Some(image) = image else {
        return Ok(None);
    };
    let magic = image.first_chunk::<4>().map(|m| u32::from_le_bytes(*m));
    if magic.is_some_and(|m| BINARY.contains(&m)) {
        return Ok(None);
    }
    let (laws, errors) = law::declared(&String::from_utf8_lossy(image));
    if let Some(e) = errors.first() {
        eprintln!("gpu-sim: module image: {e}");
        return Err(CUDA_ERROR_INVALID_PTX);
    }
    Ok(Some(laws.into_iter().map(|(n, l)| (n.into(), l)).collect()))
}

/// Magic words of binary images: fatbinary wrapper, fatbinary, ELF.
const BINARY: [u32; 3] = [0x466243b1, 0xba55ed50, 0x464c457f];

/// The text of an in-memory image up to its NUL; `None` for a binary
/// image (a fatbinary, its wrapper, an ELF cubin: known by their magic).
///
/// # Safety
/// `image` points to a module image as `cuModuleLoadData` accepts it.
unsafe fn image_text<'a>(image: *const u8) -> Option<&'a [u8]> {
    let mut head = [0u8; 4];
    for (i, b) in head.iter_mut().enumerate() {
        // SAFETY: the contract: a binary image has its 4-byte magic and a text image is
        // NUL-terminated; reading stops at the first NUL.
        *b = unsafe { *image.add(i) };
        if *b == 0 {
            return Some(&[]);
        }
    }
    if BINARY.contains(&u32::from_le_bytes(head)) {
        return None;
    }
    // SAFETY: not binary, so NUL-terminated text (the contract).
    Some(unsafe { CStr::from_ptr(image.cast()) }.to_bytes())
}

/// The law of a `CUfunction` a graph node kept (the default once its module
/// is gone).
pub(crate) fn law_of(f: usize, default_block_ns: u64) -> Law {
    // SAFETY: `f` was a CUfunction this driver handed out; `func` checks its magic, and a
    // function's Box lives until its module is unloaded (its magic zeroed then).
    unsafe { func(f as *mut c_void) }.map_or(Law::default_for(default_block_ns), |f| f.law)
}

/// Loads a module of `bytes` device bytes with the kernel laws `laws`
/// (charged to the current context, if any: libraries load without one).
unsafe fn load(out: *mut *mut c_void, bytes: u64, laws: Option<HashMap<Box<str>, Law>>) -> R {
    let d = drv()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let m = Box::into_raw(Box::new(Module {
        magic: MODULE_MAGIC,
        funcs: Mutex::new(HashMap::new()),
        laws,
    }));
    if current().is_ok()
        && let Err(e) = charge::charge_module(d, m as usize, bytes)
    {
        // SAFETY: `m` came from Box::into_raw just above and was never handed out: freed once,
        // here.
        drop(unsafe { Box::from_raw(m) });
        return Err(e);
    }
    put(out, m.cast())?;
    Ok(())
}

unsafe fn module<'a>(h: *mut c_void) -> R<&'a Module> {
    let m = h as *const Module;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if m.is_null() || unsafe { (*m).magic } != MODULE_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: checked just above: the live object this driver leaked for the handle; it stays
    // until its destroy call (use after that is the caller's bug, as with the real driver).
    Ok(unsafe { &*m })
}

/// Checks a module or library handle (for `globals.rs`).
///
/// # Safety
/// `h` is a handle our caller was passed (CUDA ABI); see [`module`].
pub(crate) unsafe fn module_handle(h: *mut c_void) -> R {
    // SAFETY: forwarded contract.
    unsafe { module(h) }.map(|_| ())
}

/// Checks a function (or kernel) handle (for `occupancy.rs`).
///
/// # Safety
/// `f` is a handle our caller was passed (CUDA ABI); see [`func`].
pub(crate) unsafe fn func_handle(f: *mut c_void) -> R {
    // SAFETY: forwarded contract.
    unsafe { func(f) }.map(|_| ())
}

unsafe fn get_function(out: *mut *mut c_void, m: *mut c_void, name: *const c_char) -> R {
    let d = drv()?;
    // SAFETY: `m` is our caller's module handle, passed on under this function's own contract;
    // `module` checks its magic.
    let m = unsafe { module(m)? };
    if out.is_null() || name.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `name` is non-NULL (checked above) and, per the CUDA ABI, a NUL-terminated
    // string.
    let name = unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| CUDA_ERROR_NOT_FOUND)?;
    if name.is_empty() {
        return Err(CUDA_ERROR_NOT_FOUND);
    }
    let wave_ns = d.node().kernel_wave_ns;
    let law = match &m.laws {
        Some(laws) => laws
            .get(name)
            .copied()
            .unwrap_or_else(|| Law::default_for(wave_ns)),
        None => {
            // The current context's GPU (libraries load without one: the first).
            let gpu = current().map_or(0, |c| c.gpu);
            Law::undeclared(name, d.gpu_spec(gpu), wave_ns)
        }
    };
    let mut funcs = lock(&m.funcs);
    let f = funcs.entry(name.into()).or_insert_with(|| {
        Box::new(Func {
            magic: FUNC_MAGIC,
            name: name.into(),
            law,
        })
    });
    put(out, &**f as *const Func as *mut c_void)
}

unsafe fn unload(m: *mut c_void) -> R {
    let d = drv()?;
    // SAFETY: `m` is our caller's module handle, passed on under this function's own contract;
    // `module` checks its magic.
    unsafe { module(m)? };
    d.mem.charges.drop_one(d, charge::What::Module, m as usize);
    crate::globals::drop_module(m as usize);
    let m = m as *mut Module;
    // SAFETY: the handle passed its magic check, so it is a Box this driver leaked; the magic
    // is zeroed and the Box freed once, here, under the destroy call.
    let m = unsafe {
        (*m).magic = 0;
        Box::from_raw(m)
    };
    for f in lock(&m.funcs).values_mut() {
        f.magic = 0;
    }
    Ok(())
}

unsafe fn func<'a>(f: *mut c_void) -> R<&'a Func> {
    let p = f as *const Func;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if p.is_null() || unsafe { (*p).magic } != FUNC_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: checked just above: the live object this driver leaked for the handle; it stays
    // until its destroy call (use after that is the caller's bug, as with the real driver).
    Ok(unsafe { &*p })
}

cuda_fn! {
    fn cuModuleLoad(out: *mut *mut c_void, fname: *const c_char) {
        drv()?;
        current()?;
        if fname.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let path = std::ffi::OsStr::from_bytes(cstr(fname)?.to_bytes());
        let meta = std::fs::metadata(path)
            .ok()
            .filter(|m| m.is_file())
            .ok_or(CUDA_ERROR_FILE_NOT_FOUND)?;
        let laws = laws_of(Some(&std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?))?;
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, meta.len().div_ceil(4096) * 4096, laws) }
    }

    fn cuModuleLoadData(out: *mut *mut c_void, image: *const c_void) {
        current()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, charge::image_bytes(image.cast()), laws_of(image_text(image.cast()))?) }
    }

    fn cuModuleLoadDataEx(out: *mut *mut c_void, image: *const c_void, _n: u32, _opts: *mut c_void, _vals: *mut *mut c_void) {
        current()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, charge::image_bytes(image.cast()), laws_of(image_text(image.cast()))?) }
    }

    fn cuModuleLoadFatBinary(out: *mut *mut c_void, image: *const c_void) {
        current()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, charge::image_bytes(image.cast()), laws_of(image_text(image.cast()))?) }
    }

    fn cuModuleUnload(m: *mut c_void) {
        // SAFETY: `unload` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { unload(m) }
    }

    fn cuModuleGetFunction(out: *mut *mut c_void, m: *mut c_void, name: *const c_char) {
        // SAFETY: `get_function` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { get_function(out, m, name) }
    }

    fn cuLibraryLoadData(
        out: *mut *mut c_void, code: *const c_void, _jo: *mut c_void, _jv: *mut *mut c_void,
        _nj: u32, _lo: *mut c_void, _lv: *mut *mut c_void, _nl: u32,
    ) {
        if code.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, charge::image_bytes(code.cast()), laws_of(image_text(code.cast()))?) }
    }

    fn cuLibraryUnload(lib: *mut c_void) {
        // SAFETY: `unload` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { unload(lib) }
    }

    fn cuLibraryGetKernel(out: *mut *mut c_void, lib: *mut c_void, name: *const c_char) {
        // SAFETY: `get_function` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { get_function(out, lib, name) }
    }

    fn cuLibraryGetModule(out: *mut *mut c_void, lib: *mut c_void) {
        drv()?;
        // SAFETY: `module` checks the magic of our caller's library handle.
        unsafe { module(lib) }?;
        // A library is loaded as one module here: the runtime (lazy loading)
        // gets its module this way.
        put(out, lib)
    }

    fn cuKernelGetFunction(out: *mut *mut c_void, kernel: *mut c_void) {
        drv()?;
        // SAFETY: `func` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { func(kernel) }?;
        put(out, kernel)
    }

    fn cuFuncGetName(out: *mut *const c_char, f: *mut c_void) {
        drv()?;
        // SAFETY: `func` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let f = unsafe { func(f) }?;
        // Names are stored without NUL; keep a C copy per function, leaked
        // once (bounded by the number of functions).
        static NAMES: Mutex<Option<HashMap<usize, std::ffi::CString>>> = Mutex::new(None);
        let mut g = lock(&NAMES);
        let map = g.get_or_insert_with(HashMap::new);
        let c = map
            .entry(f as *const Func as usize)
            .or_insert_with(|| std::ffi::CString::new(&*f.name).unwrap_or_default());
        put(out, c.as_ptr())
    }

    fn cuFuncGetAttribute(value: *mut i32, attr: i32, f: *mut c_void) {
        drv()?;
        // SAFETY: `func` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let f = unsafe { func(f) }?;
        // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK 0, SHARED_SIZE_BYTES 1,
        // NUM_REGS 4, PTX/BINARY_VERSION 5/6: what the image declared.
        let v = match attr {
            0 => 1024,
            1 => f.law.smem as i32,
            4 => f.law.regs as i32,
            5 | 6 => 80,
            2 | 3 | 7..=10 => 0,
            // Cluster attributes (CUDA 11.8): no cluster required, none
            // allowed beyond the portable size (cudaFuncGetAttributes asks).
            11..=15 => 0,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        put(value, v)
    }

    fn cuFuncSetAttribute(f: *mut c_void, _attr: i32, _value: i32) {
        drv()?;
        // SAFETY: `func` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { func(f) }?;
        Ok(())
    }

    fn cuFuncSetCacheConfig(f: *mut c_void, _config: i32) {
        drv()?;
        // SAFETY: `func` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { func(f) }?;
        Ok(())
    }
}
