//! The ledger side of every allocation path.
//!
//! Reserve in the container ledger (atomic against the quota, across every
//! process of the container) -> call the driver -> on failure give the
//! reservation back; on success remember the size and context, which the
//! matching free (or the context's destruction) returns. Over quota is
//! `CUDA_ERROR_OUT_OF_MEMORY` without calling the driver, counted in the
//! ledger (`refused_allocations`) once per refused call.
//!
//! `Proc::local_used` is everything this process holds in the ledger: the
//! table's allocations, pools' reservations, graph memory and the NVML
//! extra (`reconcile.rs`).
//!
//! A share on several GPUs keeps one ledger per GPU: every reservation goes
//! to the ledger of the GPU the memory lives on (the current context's
//! device for allocations, the location `cuMemCreate` names), and the table
//! remembers which, so the free gives it back there.

use crate::config;
use crate::log::log;
use crate::real::real_cuda;
use crate::registration::{Attach, Proc, REFUSED, proc};
use crate::table::{Entry, Kind};
use cuda_abi::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

/// Allocations and frees started / finished: the reconcile tick trusts a
/// measurement only if none ran while it measured (the driver's count and
/// ours differ while one is in flight).
pub(crate) static STARTED: AtomicU64 = AtomicU64::new(0);
pub(crate) static FINISHED: AtomicU64 = AtomicU64::new(0);

pub(crate) struct InFlight;

impl InFlight {
    #[inline]
    pub fn begin() -> InFlight {
        STARTED.fetch_add(1, Ordering::AcqRel);
        InFlight
    }
}

impl Drop for InFlight {
    #[inline]
    fn drop(&mut self) {
        FINISHED.fetch_add(1, Ordering::AcqRel);
    }
}

/// The calling thread's current context (0 when none or unknown).
pub(crate) fn current_ctx() -> u64 {
    fn get(out: &mut *mut c_void) -> CUresult {
        let f = real_cuda!(cuCtxGetCurrent: unsafe extern "C" fn(*mut *mut c_void) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by name; its
        // pointer arguments are to our own live locals.
        unsafe { f(out) }
    }
    let mut c = std::ptr::null_mut();
    if get(&mut c) == CUDA_SUCCESS {
        c as u64
    } else {
        0
    }
}

/// Where an allocation's memory lives.
#[derive(Debug, Clone, Copy)]
pub(crate) enum On {
    /// The calling thread's current context's device.
    Current,
    /// A device the call names (`cuMemCreate`'s location).
    Device(i32),
}

/// The position in the share (the ledger) of `on`; a device outside the
/// share is refused.
pub(crate) fn position(on: On) -> Result<usize, CUresult> {
    match on {
        // Without a current context the driver fails the call anyway.
        On::Current => Ok(crate::devices::current().unwrap_or(0)),
        On::Device(d) => crate::devices::allowed(d),
    }
}

/// Gives bytes back to GPU `gpu`'s ledger and the process's count.
pub(crate) fn give_back(a: Option<&Attach>, gpu: usize, bytes: u64) {
    if bytes == 0 {
        return;
    }
    if let Some(a) = a {
        let h = a.gpu(gpu);
        h.ledger.release(h.slot, bytes);
    }
    proc().used_on(gpu).fetch_sub(bytes, Ordering::AcqRel);
}

/// Takes bytes that already exist on GPU `gpu` (no quota check).
pub(crate) fn force_take(a: &Attach, gpu: usize, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let h = a.gpu(gpu);
    h.ledger.force_reserve(h.slot, bytes);
    proc().used_on(gpu).fetch_add(bytes, Ordering::AcqRel);
}

/// Reserves `bytes` against GPU `gpu`'s quota; counts and logs a refusal.
pub(crate) fn try_take(a: &Attach, gpu: usize, bytes: u64, what: &str) -> Result<(), CUresult> {
    if bytes == 0 {
        return Ok(());
    }
    let h = a.gpu(gpu);
    // The ledger is writable by every process of the container: one that
    // zeroed its counters must still not hold more than the share may in
    // this process alone, which our own count (process memory) says.
    let mine = proc().used_on(gpu).load(Ordering::Acquire);
    let ceiling = h.limit.max(h.quota);
    if mine.saturating_add(bytes) > ceiling {
        return refuse_own(h, mine, ceiling, bytes, what);
    }
    if let Err(over) = h.ledger.try_reserve_within(h.slot, bytes, h.quota) {
        // Above the quota a borrower asks the manager, which reserves in
        // our slot only from memory no share is guaranteed.
        if h.limit <= h.quota || !crate::lending::borrow(bytes) {
            log!(Info, "{what} refused: {over}");
            h.ledger.count_refused_allocation();
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    proc().used_on(gpu).fetch_add(bytes, Ordering::AcqRel);
    Ok(())
}

/// A reservation past what this process alone may hold (its ledger's
/// counters were lowered under it).
#[cold]
fn refuse_own(
    h: &crate::registration::Held,
    mine: u64,
    ceiling: u64,
    bytes: u64,
    what: &str,
) -> Result<(), CUresult> {
    log!(
        Info,
        "{what} of {bytes} bytes refused: this process alone holds {mine} of the share's {ceiling} (its ledger says less)"
    );
    h.ledger.count_refused_allocation();
    Err(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Allocations the driver refuses for memory while the share is within
/// its quota: the manager may have lent that memory out. Asks it back and
/// calls again while the ended borrowers' memory returns.
#[cold]
fn reclaim_and_retry(
    a: &Attach,
    gpu: usize,
    bytes: u64,
    call: &mut impl FnMut() -> CUresult,
) -> CUresult {
    let h = a.gpu(gpu);
    if !a.reclaim || gpu != 0 || h.ledger.used() > h.quota || !crate::lending::reclaim(bytes) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    // The driver frees a dead process's memory as it tears it down.
    let mut r = call();
    for _ in 0..200 {
        if r != CUDA_ERROR_OUT_OF_MEMORY {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        r = call();
    }
    r
}

/// Runs `call` under a reservation of `bytes`; `key` names the new
/// allocation (read only after success).
#[inline]
pub(crate) fn alloc(
    bytes: u64,
    kind: Kind,
    call: impl FnMut() -> CUresult,
    key: impl FnOnce() -> u64,
) -> CUresult {
    alloc_sized(On::Current, bytes, kind, call, || (key(), bytes), |_| {})
}

/// [`alloc`] on the device `on` says.
#[inline]
pub(crate) fn alloc_on(
    on: On,
    bytes: u64,
    kind: Kind,
    call: impl FnMut() -> CUresult,
    key: impl FnOnce() -> u64,
) -> CUresult {
    alloc_sized(on, bytes, kind, call, || (key(), bytes), |_| {})
}

/// [`alloc`] for calls whose final size is known only afterwards:
/// `result` returns (key, actual bytes); if more than reserved and the
/// difference does not fit, `undo` frees the allocation and the call fails
/// with OUT_OF_MEMORY.
pub(crate) fn alloc_sized(
    on: On,
    estimate: u64,
    kind: Kind,
    mut call: impl FnMut() -> CUresult,
    result: impl FnOnce() -> (u64, u64),
    undo: impl FnOnce(u64),
) -> CUresult {
    if config::enforce().is_none() {
        return call();
    }
    attached(|p, a| {
        if estimate == 0 {
            // The driver rejects empty allocations; nothing to reserve.
            return call();
        }
        let gpu = match position(on) {
            Ok(g) => g,
            Err(e) => return e,
        };
        let _f = InFlight::begin();
        if let Err(e) = try_take(a, gpu, estimate, "allocation") {
            return e;
        }
        let mut r = call();
        if r == CUDA_ERROR_OUT_OF_MEMORY {
            r = reclaim_and_retry(a, gpu, estimate, &mut call);
        }
        if r != CUDA_SUCCESS {
            give_back(Some(a), gpu, estimate);
            return r;
        }
        let (key, actual) = result();
        if actual > estimate {
            if let Err(e) = try_take(a, gpu, actual - estimate, "allocation after padding") {
                undo(key);
                give_back(Some(a), gpu, estimate);
                return e;
            }
        } else {
            give_back(Some(a), gpu, estimate - actual);
        }
        // VMM handles outlive contexts; everything else dies with its context.
        let ctx = if kind == Kind::Generic {
            0
        } else {
            current_ctx()
        };
        let e = Entry {
            bytes: actual,
            ctx,
            gpu,
        };
        if let Some(old) = p.table.insert(kind, key, e) {
            // The driver handed out a key we still held: the old allocation is
            // gone (its context was reset behind our back). Not counted twice.
            log!(
                Debug,
                "{kind:?} {key:#x} reused; giving back its old {} bytes",
                old.bytes
            );
            give_back(Some(a), old.gpu, old.bytes);
            super::vmm::forget(kind, key);
        }
        r
    })
}

/// Runs the free `call` and gives the allocation's bytes back on success.
#[inline]
pub(crate) fn free(kind: Kind, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if config::enforce().is_none() {
        return call();
    }
    let p = proc();
    let _f = InFlight::begin();
    // Taken out first: the same address may be handed out again the moment
    // the driver frees it.
    let Some(e) = p.table.remove(kind, key) else {
        return call();
    };
    let guard = p.attach();
    let r = call();
    if r != CUDA_SUCCESS {
        p.table.insert(kind, key, e);
        return r;
    }
    give_back(guard.as_ref(), e.gpu, e.bytes);
    r
}

/// Reserves `bytes` the driver allocates outside an allocation call (graph
/// memory, see graph.rs) on device `dev`: `call` runs only if they fit
/// (else OUT_OF_MEMORY, counted as a refusal), and they are given back if
/// it fails. Not in the allocation table: the caller keeps track and
/// returns them with [`release_reserved`].
pub(crate) fn reserve_for(dev: i32, bytes: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if config::enforce().is_none() || bytes == 0 {
        return call();
    }
    attached(|_, a| {
        let gpu = match position(On::Device(dev)) {
            Ok(g) => g,
            Err(e) => return e,
        };
        let _f = InFlight::begin();
        if let Err(e) = try_take(a, gpu, bytes, "graph memory") {
            return e;
        }
        let r = call();
        if r != CUDA_SUCCESS {
            give_back(Some(a), gpu, bytes);
        }
        r
    })
}

/// Runs `f` with this process registered and its attachment held (read
/// lock) for the whole call; the registration's error, or REFUSED without
/// an attachment, is returned without running it.
#[inline]
fn attached(f: impl FnOnce(&'static Proc, &Attach) -> CUresult) -> CUresult {
    let p = proc();
    if let Err(e) = p.ensure_registered() {
        return e;
    }
    let guard = p.attach();
    let Some(a) = guard.as_ref() else {
        return REFUSED;
    };
    f(p, a)
}

/// Gives back bytes taken with [`reserve_for`] on device `dev`.
pub(crate) fn release_reserved(dev: i32, bytes: u64) {
    if config::enforce().is_none() || bytes == 0 {
        return;
    }
    let gpu = crate::devices::record(dev).unwrap_or(0);
    let _f = InFlight::begin();
    give_back(proc().attach().as_ref(), gpu, bytes);
}
