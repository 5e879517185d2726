//! Context-local storage (table `C693336E-1121-DF11-A8C3-68F355D89593`): the
//! runtime keeps its per-context state in the driver, one value per (context,
//! key), and finds it again by the context current on the calling thread.
//! Slots and signatures as ZLUDA documents them (`dark_api/src/lib.rs`,
//! `CONTEXT_LOCAL_STORAGE_INTERFACE_V0301`, github.com/vosen/ZLUDA).

use crate::ctx::{Ctx, current};
use crate::{R, lock, put};
use cuda_abi::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// Called by the real driver when a context holding the value goes away.
pub(crate) type Dtor = Option<extern "C" fn(*mut c_void, *mut c_void, *mut c_void)>;

struct Entry {
    value: usize,
    _dtor: Dtor,
}

/// (context, key) -> value. Contexts are never freed here (tombstones), so
/// their addresses are stable keys.
static STORE: Mutex<Option<HashMap<(usize, usize), Entry>>> = Mutex::new(None);

/// The context named by the caller, or the current one for NULL.
unsafe fn context(ctx: *mut c_void) -> R<usize> {
    let c = if ctx.is_null() {
        current()?
    } else {
        // SAFETY: a context handle of our caller's; `from_handle` checks its magic.
        unsafe { Ctx::from_handle(ctx)? }
    };
    Ok(c as *const Ctx as usize)
}

pub(crate) unsafe extern "C" fn put_value(
    ctx: *mut c_void,
    key: *mut c_void,
    value: *mut c_void,
    dtor: Dtor,
) -> CUresult {
    // SAFETY: `ctx` is the caller's context handle or NULL, checked by `context`.
    let c = match unsafe { context(ctx) } {
        Ok(c) => c,
        Err(e) => return e,
    };
    let entry = Entry {
        value: value as usize,
        _dtor: dtor,
    };
    lock(&STORE)
        .get_or_insert_with(HashMap::new)
        .insert((c, key as usize), entry);
    CUDA_SUCCESS
}

pub(crate) unsafe extern "C" fn delete_value(ctx: *mut c_void, key: *mut c_void) -> CUresult {
    // SAFETY: `ctx` is the caller's context handle or NULL, checked by `context`.
    let c = match unsafe { context(ctx) } {
        Ok(c) => c,
        Err(e) => return e,
    };
    if let Some(m) = lock(&STORE).as_mut() {
        m.remove(&(c, key as usize));
    }
    CUDA_SUCCESS
}

/// A key never put is INVALID_HANDLE: the runtime takes that as "no state
/// for this context yet" and creates it.
pub(crate) unsafe extern "C" fn get_value(
    out: *mut *mut c_void,
    ctx: *mut c_void,
    key: *mut c_void,
) -> CUresult {
    // SAFETY: `ctx` is the caller's context handle or NULL, checked by `context`.
    let c = match unsafe { context(ctx) } {
        Ok(c) => c,
        Err(e) => return e,
    };
    let value = lock(&STORE)
        .as_ref()
        .and_then(|m| m.get(&(c, key as usize)).map(|e| e.value));
    match value {
        Some(v) => match put(out, v as *mut c_void) {
            Ok(()) => CUDA_SUCCESS,
            Err(e) => e,
        },
        None => CUDA_ERROR_INVALID_HANDLE,
    }
}
