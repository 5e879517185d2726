//! This process's memory bookkeeping beyond the allocation table: pools,
//! VMM mappings, primary context handles and the NVML extra. One leaked
//! object behind a pointer that a fork child replaces (another thread may
//! have held one of its locks at fork time; the parent's state is not the
//! child's anyway), as `registration.rs` does with `Proc`.

use super::ctx::Primary;
use super::pool::Pools;
use super::quota::{FINISHED, STARTED};
use super::vmm::Maps;
use crate::registration::init_per_process;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

#[derive(Default)]
pub(crate) struct Local {
    pub pools: Mutex<Pools>,
    pub maps: Mutex<Maps>,
    pub primary: Mutex<Primary>,
    /// Bytes reserved beyond what is counted (NVML said more), per GPU of
    /// the share (ledger position; shorter when never measured).
    pub extra: Mutex<Vec<u64>>,
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
    init_per_process(&LOCAL, &ATFORK, after_fork_child, Local::default)
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
