//! This process's memory bookkeeping beyond the allocation table: pools,
//! VMM mappings, primary context handles and the NVML extra. One leaked
//! object behind a pointer that a fork child replaces (another thread may
//! have held one of its locks at fork time; the parent's state is not the
//! child's anyway), as `registration.rs` does with `Proc`.

use super::ctx::Primary;
use super::pool::Pools;
use super::quota::{FINISHED, STARTED};
use super::vmm::Maps;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

#[derive(Default)]
pub(crate) struct Local {
    pub pools: Mutex<Pools>,
    pub maps: Mutex<Maps>,
    pub primary: Mutex<Primary>,
    /// Bytes reserved beyond what is counted (NVML said more).
    pub extra: Mutex<u64>,
}

static LOCAL: AtomicPtr<Local> = AtomicPtr::new(std::ptr::null_mut());

pub(crate) fn local() -> &'static Local {
    let p = LOCAL.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: a non-NULL LOCAL came from Box::into_raw (init or after_fork_child) and is
        // never freed, so it is valid for 'static.
        return unsafe { &*p };
    }
    init()
}

#[cold]
fn init() -> &'static Local {
    static ATFORK: Once = Once::new();
    // SAFETY: pthread_atfork with a plain extern "C" handler that lives as long as the process;
    // registered once.
    ATFORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_child));
    });
    let fresh = Box::into_raw(Box::<Local>::default());
    match LOCAL.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: `fresh` came from Box::into_raw just above and is now published in LOCAL,
        // never freed: valid for 'static.
        Ok(_) => unsafe { &*fresh },
        Err(existing) => {
            // SAFETY: `fresh` came from Box::into_raw above and lost the race, so no one else
            // has seen it: freed once, here.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: `existing` is the published LOCAL: from Box::into_raw, never freed.
            unsafe { &*existing }
        }
    }
}

/// Only this thread exists in the child: a fresh state, and no allocation
/// in flight (a parent thread's would never finish here).
extern "C" fn after_fork_child() {
    LOCAL.store(Box::into_raw(Box::<Local>::default()), Ordering::Release);
    FINISHED.store(STARTED.load(Ordering::Acquire), Ordering::Release);
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
