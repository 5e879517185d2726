//! Modules, libraries and functions. Any image is accepted (there is no GPU
//! to run it); functions are looked up by name and are what launches take.
//! A loaded image takes its size in device memory (charged to the current
//! context, see `charge.rs`) until unloaded.

use crate::charge;
use crate::ctx::current;
use crate::launch::FUNC_MAGIC;
use crate::{R, cstr, drv, lock, put};
use cuda_abi::*;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;

const MODULE_MAGIC: u64 = 0x5349_4d4d_4f44_0001;

/// A function (also used as `CUkernel`, which the real driver lets callers
/// pass where a `CUfunction` is expected). `magic` first: launches check it.
#[repr(C)]
pub(crate) struct Func {
    magic: u64,
    name: Box<str>,
}

struct Module {
    magic: u64,
    funcs: Mutex<HashMap<Box<str>, Box<Func>>>,
}

/// Loads a module of `bytes` device bytes (charged to the current context,
/// if any: libraries load without one).
unsafe fn load(out: *mut *mut c_void, bytes: u64) -> R {
    let d = drv()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let m = Box::into_raw(Box::new(Module {
        magic: MODULE_MAGIC,
        funcs: Mutex::new(HashMap::new()),
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

unsafe fn get_function(out: *mut *mut c_void, m: *mut c_void, name: *const c_char) -> R {
    drv()?;
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
    let mut funcs = lock(&m.funcs);
    let f = funcs.entry(name.into()).or_insert_with(|| {
        Box::new(Func {
            magic: FUNC_MAGIC,
            name: name.into(),
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
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, meta.len().div_ceil(4096) * 4096) }
    }

    fn cuModuleLoadData(out: *mut *mut c_void, image: *const c_void) {
        current()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, charge::image_bytes(image.cast())) }
    }

    fn cuModuleLoadDataEx(out: *mut *mut c_void, image: *const c_void, _n: u32, _opts: *mut c_void, _vals: *mut *mut c_void) {
        current()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, charge::image_bytes(image.cast())) }
    }

    fn cuModuleLoadFatBinary(out: *mut *mut c_void, image: *const c_void) {
        current()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `load` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { load(out, charge::image_bytes(image.cast())) }
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
        unsafe { load(out, charge::image_bytes(code.cast())) }
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
        unsafe { func(f) }?;
        // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK 0, NUM_REGS 4, PTX/BINARY_VERSION 5/6.
        let v = match attr {
            0 => 1024,
            4 => 32,
            5 | 6 => 80,
            1..=10 => 0,
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
