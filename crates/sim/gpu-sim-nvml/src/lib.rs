//! Simulated `libnvidia-ml.so.1`: the NVML C API over the simulated node's
//! shared state (`gpu-sim-core`).
//!
//! Exports the functions listed in README.md with NVML's real names, struct
//! layouts and return-code conventions; every other NVML symbol (see
//! `cuda-abi/symbols/libnvidia-ml.txt`) is a stub returning NVML_ERROR_NOT_SUPPORTED.
//! No export panics across the FFI boundary: each body runs under
//! `catch_unwind` and a panic becomes NVML_ERROR_UNKNOWN.

#![allow(non_snake_case, non_camel_case_types)]
// Every export takes raw pointers from C callers and checks them for null;
// they are `unsafe extern "C"` by nature, documented once here.
#![allow(clippy::missing_safety_doc)]
#![deny(unsafe_op_in_unsafe_fn)]

mod accounting;
mod device;
mod events;
mod gpm;
mod health;
mod info;
mod memory;
mod mig;
mod mig_ci;
mod mig_device;
mod mig_handles;
mod procs;
mod schedule;
mod system;
mod topology;

use gpu_sim_core::node::MAX_GPUS;
use gpu_sim_core::{SharedState, SimRoot, StateError};
use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

pub type nvmlReturn_t = std::ffi::c_int;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
pub const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
pub const NVML_ERROR_IN_USE: nvmlReturn_t = 19;
pub const NVML_ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// Result of an export body: `Err` carries the NVML error code.
type R = Result<(), nvmlReturn_t>;

/// One per simulated GPU; an `nvmlDevice_t` points at one of these, so
/// handles stay valid and comparable across init/shutdown cycles.
#[repr(C)]
pub struct DeviceSlot {
    _opaque: u64,
}

static DEVICES: [DeviceSlot; MAX_GPUS] = [const { DeviceSlot { _opaque: 0 } }; MAX_GPUS];

pub type nvmlDevice_t = *const DeviceSlot;

/// Handle of simulated GPU `sim` (index in the node description).
fn handle_of(sim: usize) -> nvmlDevice_t {
    &DEVICES[sim] as *const DeviceSlot
}

/// What `nvmlInit` set up; shared by all calls until the last shutdown.
pub(crate) struct Ctx {
    pub state: SharedState,
    /// NVML index -> simulated GPU index: only GPUs whose device node this
    /// process could open at init, as the real driver only enumerates those.
    pub visible: Vec<usize>,
}

impl Ctx {
    /// Simulated index of a handle this process may use.
    pub fn dev(&self, h: nvmlDevice_t) -> Result<usize, nvmlReturn_t> {
        if h.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let base = DEVICES.as_ptr() as usize;
        let off = (h as usize).wrapping_sub(base);
        let size = std::mem::size_of::<DeviceSlot>();
        let sim = off / size;
        if sim >= MAX_GPUS || sim * size != off {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if self.visible.contains(&sim) {
            Ok(sim)
        } else {
            Err(NVML_ERROR_INVALID_ARGUMENT)
        }
    }

    /// NVML index of a visible simulated GPU.
    pub fn index_of(&self, sim: usize) -> Option<usize> {
        self.visible.iter().position(|&s| s == sim)
    }

    pub fn gpu(&self, sim: usize) -> &gpu_sim_core::GpuSpec {
        &self.state.node().gpus[sim]
    }
}

struct Global {
    refs: u32,
    ctx: Option<Arc<Ctx>>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global { refs: 0, ctx: None });

fn global() -> std::sync::MutexGuard<'static, Global> {
    // A panic while holding the lock must not disable the library.
    GLOBAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The initialized context, or NVML_ERROR_UNINITIALIZED.
pub(crate) fn ctx() -> Result<Arc<Ctx>, nvmlReturn_t> {
    global().ctx.clone().ok_or(NVML_ERROR_UNINITIALIZED)
}

/// Anchor for locating the root this library was installed into.
extern "C" fn anchor() {}

fn open_state() -> Result<Ctx, StateError> {
    let lib = gpu_sim_core::state::object_path_of(anchor as *const () as usize);
    let root = SimRoot::locate(lib.as_deref())?;
    let state = SharedState::open(&root)?;
    let visible = state.visible_gpus();
    Ok(Ctx { state, visible })
}

/// nvmlInit* body: reference-counted like the real library.
pub(crate) fn init() -> R {
    let mut g = global();
    if g.ctx.is_some() {
        g.refs += 1;
        return Ok(());
    }
    match open_state() {
        Ok(c) => {
            g.ctx = Some(Arc::new(c));
            g.refs = 1;
            Ok(())
        }
        Err(e) => {
            eprintln!("libnvidia-ml (gpu-sim): driver not loaded: {e}");
            Err(NVML_ERROR_DRIVER_NOT_LOADED)
        }
    }
}

pub(crate) fn shutdown() -> R {
    let mut g = global();
    if g.ctx.is_none() {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    g.refs -= 1;
    if g.refs == 0 {
        g.ctx = None;
    }
    Ok(())
}

/// Runs an export body, turning errors and panics into NVML codes.
pub(crate) fn ffi(body: impl FnOnce() -> R) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// Writes `v` through a caller's out-pointer; null is INVALID_ARGUMENT.
pub(crate) fn put<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: the caller passed a pointer to a T, as the NVML API demands.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Copies `s` and a NUL into a caller's buffer of `len` bytes.
pub(crate) fn put_str(buf: *mut c_char, len: std::ffi::c_uint, s: &str) -> R {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (len as usize) < s.len() + 1 {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds `len` bytes, checked above to fit.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

/// Fixed-size C string field.
pub(crate) fn c_field<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}

/// Reads a NUL-terminated string argument.
pub(crate) fn arg_str<'a>(p: *const c_char) -> Result<&'a str, nvmlReturn_t> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: C callers pass NUL-terminated strings.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| NVML_ERROR_INVALID_ARGUMENT)
}

pub(crate) const NVML_FEATURE_DISABLED: std::ffi::c_uint = 0;
pub(crate) const NVML_FEATURE_ENABLED: std::ffi::c_uint = 1;

/// Runs `f` with the context and the simulated index of `device`.
pub(crate) fn with_dev(device: nvmlDevice_t, f: impl FnOnce(&Ctx, usize) -> R) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        f(&c, sim)
    })
}

/// A versioned struct from the caller: non-null, and its leading `version`
/// word is `want`.
pub(crate) fn check_version<T>(p: *mut T, want: std::ffi::c_uint) -> R {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null pointer to the caller's struct, which starts with
    // its c_uint version (asserted beside each struct passed here).
    if unsafe { *p.cast::<std::ffi::c_uint>() } != want {
        return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    Ok(())
}

/// Device utilization in whole percents over the node's device sampling
/// window (`NvmlSampling::device_window`: the last published period of
/// `[nvml_sampling] device_period_ns`, else the last second).
pub(crate) fn recent_util(c: &Ctx, sim: usize) -> u32 {
    let now = gpu_sim_core::state::now_ns();
    let (from, to) = c.state.node().nvml_sampling.device_window(now);
    c.state.utilization(sim, from, to).round() as u32
}

mod stubs {
    use crate::{NVML_ERROR_NOT_SUPPORTED, nvmlReturn_t};
    include!(concat!(env!("OUT_DIR"), "/stubs.rs"));
}
