//! Events: recorded at a stream's simulated tail, waited on, timed.

use crate::ctx::{current, done, end_of, wait_done};
use crate::stream::Target;
use crate::{R, drv, put};
use cuda_abi::*;
use gpu_sim_core::state::now_ns;
use std::ffi::c_void;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering::*};

const EVENT_MAGIC: u64 = 0x5349_4d45_5654_0001;

pub(crate) struct Event {
    magic: u64,
    pub flags: u32,
    /// Simulated completion time of the recorded work; 0 = never recorded.
    pub own_time: AtomicU64,
    /// Once shared over CUDA IPC (`ipc.rs`): the time's cell in a page
    /// every process holding the event maps, used instead of `own_time`.
    pub shared: AtomicPtr<AtomicU64>,
    /// The IPC handle's id, in the process that exported it (0 otherwise).
    pub ipc_id: AtomicU64,
    /// The GPU it was last recorded on (its time resolves against that
    /// device's preemptions).
    pub gpu: AtomicU32,
}

impl Event {
    pub fn new(flags: u32) -> Box<Event> {
        Box::new(Event {
            magic: EVENT_MAGIC,
            flags,
            own_time: AtomicU64::new(0),
            shared: AtomicPtr::new(std::ptr::null_mut()),
            ipc_id: AtomicU64::new(0),
            gpu: AtomicU32::new(0),
        })
    }

    /// Where the event's time is: the shared cell once it has one.
    pub fn time(&self) -> &AtomicU64 {
        let p = self.shared.load(Acquire);
        if p.is_null() {
            &self.own_time
        } else {
            // SAFETY: a page mapped by `ipc.rs` for this event, unmapped only when the event is
            // destroyed (using it after that is the caller's bug, as with the real driver).
            unsafe { &*p }
        }
    }
}

pub(crate) unsafe fn event<'a>(h: *mut c_void) -> R<&'a Event> {
    let e = h as *const Event;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if e.is_null() || unsafe { (*e).magic } != EVENT_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: checked just above: the live object this driver leaked for the handle; it stays
    // until its destroy call (use after that is the caller's bug, as with the real driver).
    Ok(unsafe { &*e })
}

unsafe fn event_record(ev: *mut c_void, stream: *mut c_void, ptsz: bool) -> R {
    let d = drv()?;
    // SAFETY: `ev`/`start`/`end` are our caller's event handles, passed on under this
    // function's own contract; `event` checks their magic.
    let e = unsafe { event(ev)? };
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    crate::capture_mode::legacy_use(t)?;
    if crate::capture::event_record(ev, t) {
        return Ok(());
    }
    let at = d.state.served_from(d.me, t.ctx().gpu, t.tail());
    e.gpu.store(t.ctx().gpu as u32, Release);
    e.time().store(at.max(1), Release);
    Ok(())
}

/// `CU_EVENT_DISABLE_TIMING`.
const EVENT_DISABLE_TIMING: u32 = 2;

/// Test knob: while this file exists in the sim's state directory
/// (`run/gpu-sim/`), `cuEventElapsedTime` answers as for events made with
/// `CU_EVENT_DISABLE_TIMING`: with NVML's samples off too
/// (`nvml-samples-off`), a process gets no feedback on its device time at
/// all.
pub const EVENT_TIMING_OFF_FILE: &str = "event-timing-off";

unsafe fn elapsed(ms: *mut f32, start: *mut c_void, end: *mut c_void) -> R {
    let d = drv()?;
    if d.state
        .root()
        .state_dir()
        .join(EVENT_TIMING_OFF_FILE)
        .exists()
    {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: `ev`/`start`/`end` are our caller's event handles, passed on under this
    // function's own contract; `event` checks their magic.
    let (a, b) = unsafe { (event(start)?, event(end)?) };
    if ms.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if (a.flags | b.flags) & EVENT_DISABLE_TIMING != 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let (ta, tb) = (a.time().load(Acquire), b.time().load(Acquire));
    if ta == 0 || tb == 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let ta = end_of(a.gpu.load(Acquire) as usize, ta);
    let tb = end_of(b.gpu.load(Acquire) as usize, tb);
    if ta.max(tb) > now_ns() {
        return Err(CUDA_ERROR_NOT_READY);
    }
    put(ms, ((tb as f64 - ta as f64) / 1e6) as f32)?;
    Ok(())
}

unsafe fn event_destroy(ev: *mut c_void) -> R {
    let d = drv()?;
    // SAFETY: `ev`/`start`/`end` are our caller's event handles, passed on under this
    // function's own contract; `event` checks their magic.
    crate::ipc::drop_event(d, unsafe { event(ev)? });
    let e = ev as *mut Event;
    // SAFETY: the handle passed its magic check, so it is a Box this driver leaked; the magic
    // is zeroed and the Box freed once, here, under the destroy call.
    unsafe {
        (*e).magic = 0;
        drop(Box::from_raw(e));
    }
    Ok(())
}

cuda_fn! {
    fn cuEventCreate(out: *mut *mut c_void, flags: u32) {
        drv()?;
        current()?;
        if out.is_null() || flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, Box::into_raw(Event::new(flags)).cast())?;
        Ok(())
    }

    fn cuEventRecord(ev: *mut c_void, stream: *mut c_void) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, false) }
    }

    fn cuEventRecord_ptsz(ev: *mut c_void, stream: *mut c_void) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, true) }
    }

    fn cuEventRecordWithFlags(ev: *mut c_void, stream: *mut c_void, _flags: u32) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, false) }
    }

    fn cuEventRecordWithFlags_ptsz(ev: *mut c_void, stream: *mut c_void, _flags: u32) {
        // SAFETY: `event_record` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_record(ev, stream, true) }
    }

    fn cuEventQuery(ev: *mut c_void) {
        drv()?;
        crate::capture_mode::event_sync_point(ev)?;
        // SAFETY: `event` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let e = unsafe { event(ev) }?;
        if !done(e.gpu.load(Acquire) as usize, e.time().load(Acquire)) {
            return Err(CUDA_ERROR_NOT_READY);
        }
        Ok(())
    }

    fn cuEventSynchronize(ev: *mut c_void) {
        let d = drv()?;
        crate::capture_mode::event_sync_point(ev)?;
        // SAFETY: `event` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let e = unsafe { event(ev) }?;
        wait_done(e.gpu.load(Acquire) as usize, e.time().load(Acquire));
        crate::pool::at_sync(d);
        Ok(())
    }

    fn cuEventElapsedTime(ms: *mut f32, start: *mut c_void, end: *mut c_void) {
        // SAFETY: `elapsed` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { elapsed(ms, start, end) }
    }

    fn cuEventElapsedTime_v2(ms: *mut f32, start: *mut c_void, end: *mut c_void) {
        // SAFETY: `elapsed` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { elapsed(ms, start, end) }
    }

    fn cuEventDestroy(ev: *mut c_void) {
        // SAFETY: `event_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_destroy(ev) }
    }

    fn cuEventDestroy_v2(ev: *mut c_void) {
        // SAFETY: `event_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { event_destroy(ev) }
    }
}
