//! Module globals (`__device__` / `__constant__` variables) by name:
//! `cuModuleGetGlobal_v2`, `cuLibraryGetGlobal`. cuBLAS(Lt) asks for its
//! `cublas::internal::deviceConstants` at `cublasCreate` and copies into it.
//!
//! The simulator does not read images (their cubins are zstd-compressed in
//! CUDA 13 fatbins), so it cannot know a variable's size: each global is a
//! fixed [`GLOBAL_BYTES`] of zeroed, lazily committed memory per (module,
//! name), reported as that size. Copies and memsets accept it as device
//! memory. It is not counted: a real driver holds globals inside the module's
//! image, which `charge.rs` already counts. Freed when its module is unloaded.

use crate::mem::map_anon;
use crate::{R, cstr, drv, lock, put, put_opt};
use cuda_abi::*;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void};
use std::sync::Mutex;

/// Bytes reserved (not committed) for each global: more than any variable
/// the libraries we run ask for, so their copies stay inside it.
pub(crate) const GLOBAL_BYTES: usize = 16 << 20;

struct Globals {
    /// (module handle, name) -> base address.
    by_name: BTreeMap<(usize, Box<str>), u64>,
    /// Base addresses, for range checks.
    bases: BTreeMap<u64, usize>,
}

static GLOBALS: Mutex<Globals> = Mutex::new(Globals {
    by_name: BTreeMap::new(),
    bases: BTreeMap::new(),
});

/// Whether [ptr, end) lies inside one global.
pub(crate) fn contains(ptr: u64, end: u64) -> bool {
    let g = lock(&GLOBALS);
    g.bases
        .range(..=ptr)
        .next_back()
        .is_some_and(|(&base, &len)| end <= base + len as u64)
}

/// Unmaps the globals of module `m` (at its unload).
pub(crate) fn drop_module(m: usize) {
    let mut g = lock(&GLOBALS);
    let gone: Vec<(usize, Box<str>)> = g
        .by_name
        .range((m, Box::from(""))..)
        .take_while(|((k, _), _)| *k == m)
        .map(|(k, _)| k.clone())
        .collect();
    for k in gone {
        if let Some(base) = g.by_name.remove(&k)
            && let Some(len) = g.bases.remove(&base)
        {
            // SAFETY: `base`/`len` is a mapping `get` made and recorded once;
            // removing the records above makes this its only unmap.
            unsafe { libc::munmap(base as *mut c_void, len) };
        }
    }
}

/// The global `name` of the module or library `m` (a handle `module.rs`
/// checked), mapped at its first request.
fn get(m: usize, name: &str) -> R<u64> {
    let mut g = lock(&GLOBALS);
    if let Some(&p) = g.by_name.get(&(m, name.into())) {
        return Ok(p);
    }
    // SAFETY: a fresh anonymous mapping; see map_anon.
    let p = unsafe { map_anon(GLOBAL_BYTES, libc::PROT_READ | libc::PROT_WRITE) }? as u64;
    g.by_name.insert((m, name.into()), p);
    g.bases.insert(p, GLOBAL_BYTES);
    Ok(p)
}

/// The shared body: checks the handle and the name, writes the address and
/// (optionally) the size.
unsafe fn get_global(dptr: *mut u64, bytes: *mut usize, m: *mut c_void, name: *const c_char) -> R {
    drv()?;
    // SAFETY: `m` is our caller's handle; `module_handle` checks its magic.
    unsafe { crate::module::module_handle(m) }?;
    let name = cstr(name)?.to_str().map_err(|_| CUDA_ERROR_NOT_FOUND)?;
    if name.is_empty() {
        return Err(CUDA_ERROR_NOT_FOUND);
    }
    let p = get(m as usize, name)?;
    if !dptr.is_null() {
        put(dptr, p)?;
    }
    put_opt(bytes, GLOBAL_BYTES);
    Ok(())
}

cuda_fn! {
    fn cuModuleGetGlobal_v2(dptr: *mut u64, bytes: *mut usize, m: *mut c_void, name: *const c_char) {
        // SAFETY: the pointers and handle our caller passed (CUDA ABI): out-pointers are
        // optional (NULL skipped), the handle is checked by its magic.
        unsafe { get_global(dptr, bytes, m, name) }
    }

    fn cuLibraryGetGlobal(dptr: *mut u64, bytes: *mut usize, lib: *mut c_void, name: *const c_char) {
        // SAFETY: as cuModuleGetGlobal_v2 (a library is loaded as one module here).
        unsafe { get_global(dptr, bytes, lib, name) }
    }
}
