//! The driver's events, as the interposer's own bookkeeping uses them:
//! a batch stream's queue bound (`qos::window`) and launches timed on the
//! device (`throttle::timed`). Every call goes to the real driver; none
//! waits except [`sync`].

use crate::real::real_cuda;
use cuda_abi::{CUDA_SUCCESS, CUresult};
use std::ffi::c_void;

pub(crate) type Event = *mut c_void;
pub(crate) type Stream = *mut c_void;

pub(crate) fn create() -> Option<usize> {
    let mut ev: Event = std::ptr::null_mut();
    let r = (|| -> CUresult {
        let f = real_cuda!(cuEventCreate: unsafe extern "C" fn(*mut Event, u32) -> CUresult);
        // SAFETY: the real driver's function; `ev` is a valid out pointer.
        unsafe { f(&mut ev, 0) }
    })();
    (r == CUDA_SUCCESS && !ev.is_null()).then_some(ev as usize)
}

pub(crate) fn record(ev: Event, stream: Stream, ptsz: bool) -> CUresult {
    type Record = unsafe extern "C" fn(Event, Stream) -> CUresult;
    let f = if ptsz {
        real_cuda!(cuEventRecord_ptsz: Record)
    } else {
        real_cuda!(cuEventRecord: Record)
    };
    // SAFETY: the real driver's function; an event it made, the stream our
    // caller is about to launch onto.
    unsafe { f(ev, stream) }
}

pub(crate) fn query(ev: Event) -> CUresult {
    let f = real_cuda!(cuEventQuery: unsafe extern "C" fn(Event) -> CUresult);
    // SAFETY: the real driver's function; an event it made.
    unsafe { f(ev) }
}

pub(crate) fn sync(ev: Event) -> CUresult {
    let f = real_cuda!(cuEventSynchronize: unsafe extern "C" fn(Event) -> CUresult);
    // SAFETY: the real driver's function; an event it made.
    unsafe { f(ev) }
}

pub(crate) fn destroy(ev: Event) {
    let _ = (|| -> CUresult {
        let f = real_cuda!(cuEventDestroy_v2: unsafe extern "C" fn(Event) -> CUresult);
        // SAFETY: the real driver's function; an event it made that no
        // window holds any more.
        unsafe { f(ev) }
    })();
}

pub(crate) fn elapsed_ns(start: Event, end: Event) -> Option<u64> {
    let mut ms = 0f32;
    let r = (|| -> CUresult {
        let f = real_cuda!(cuEventElapsedTime: unsafe extern "C" fn(*mut f32, Event, Event) -> CUresult);
        // SAFETY: the real driver's function; two events it made, both
        // complete; `ms` a valid out pointer.
        unsafe { f(&mut ms, start, end) }
    })();
    (r == CUDA_SUCCESS && ms >= 0.0).then_some((f64::from(ms) * 1e6) as u64)
}
