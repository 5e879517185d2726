//! Event sets: injected Xid errors (`gpu-sim xid`) delivered through
//! nvmlEventSetWait.

use crate::*;
use gpu_sim_core::node::MAX_GPUS;
use std::collections::HashSet;
use std::ffi::{c_uint, c_ulonglong};
use std::time::{Duration, Instant};

pub const XID_CRITICAL_ERROR: u64 = 0x8;
/// Types a device accepts for registration: the Xid events the simulator
/// raises plus the ECC, P-state and clock events a real board accepts (they
/// simply never fire here).
pub const SUPPORTED_EVENTS: u64 = 0x1 | 0x2 | 0x4 | XID_CRITICAL_ERROR | 0x10;

/// How often a waiting call looks at the Xid ring.
const POLL: Duration = Duration::from_millis(2);

pub struct EventSet {
    inner: Mutex<EventInner>,
}

struct EventInner {
    /// Registered event types per simulated GPU.
    types: [u64; MAX_GPUS],
    /// Sequence number of the last Xid event this set has looked at.
    cursor: u64,
}

pub type nvmlEventSet_t = *mut EventSet;

/// Sets handed out and not yet freed, so a stale or foreign pointer is
/// refused instead of dereferenced.
static LIVE: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn live() -> std::sync::MutexGuard<'static, Option<HashSet<usize>>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

fn checked<'a>(set: nvmlEventSet_t) -> Result<&'a EventSet, nvmlReturn_t> {
    if set.is_null() || !live().as_ref().is_some_and(|l| l.contains(&(set as usize))) {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: a live set made by nvmlEventSetCreate and not yet freed.
    Ok(unsafe { &*set })
}

#[repr(C)]
pub struct nvmlEventData_t {
    device: nvmlDevice_t,
    eventType: c_ulonglong,
    eventData: c_ulonglong,
    gpuInstanceId: c_uint,
    computeInstanceId: c_uint,
}

/// nvmlEventData_t before MIG: what nvmlEventSetWait (v1) writes.
#[repr(C)]
struct nvmlEventData_v1_t {
    device: nvmlDevice_t,
    eventType: c_ulonglong,
    eventData: c_ulonglong,
}

const _: () = assert!(std::mem::size_of::<nvmlEventData_t>() == 32);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        if set.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // Only events raised after the set exists are delivered.
        let s = Box::into_raw(Box::new(EventSet {
            inner: Mutex::new(EventInner {
                types: [0; MAX_GPUS],
                cursor: c.state.xid_cursor(),
            }),
        }));
        live().get_or_insert_with(HashSet::new).insert(s as usize);
        put(set, s)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    ffi(|| {
        ctx()?;
        let mut l = live();
        if set.is_null() || !l.as_mut().is_some_and(|l| l.remove(&(set as usize))) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        drop(l);
        // SAFETY: made by Box::into_raw in nvmlEventSetCreate, removed from
        // the live set above so it is freed once. A concurrent waiter on a
        // set being freed is a caller bug the real library does not survive
        // either.
        drop(unsafe { Box::from_raw(set) });
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    ffi(|| {
        ctx()?.dev(device)?;
        put(types, SUPPORTED_EVENTS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        let set = checked(set)?;
        if types & !SUPPORTED_EVENTS != 0 {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        set.inner.lock().unwrap_or_else(|e| e.into_inner()).types[sim] |= types;
        Ok(())
    })
}

/// Waits up to `timeout_ms` for an Xid on a registered device.
/// An Xid as an event: GPU, code, and the MIG instance it names.
type Xid = (usize, u32, Option<(u32, u32)>);

fn wait(set: nvmlEventSet_t, timeout_ms: c_uint) -> Result<Xid, nvmlReturn_t> {
    let c = ctx()?;
    let set = checked(set)?;
    let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
    loop {
        {
            let mut inner = set.inner.lock().unwrap_or_else(|e| e.into_inner());
            for ev in c.state.xid_events_since(inner.cursor) {
                inner.cursor = ev.seq;
                let gpu = ev.gpu as usize;
                if gpu < MAX_GPUS
                    && inner.types[gpu] & XID_CRITICAL_ERROR != 0
                    && c.visible.contains(&gpu)
                {
                    return Ok((gpu, ev.code, ev.instance));
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(NVML_ERROR_TIMEOUT);
        }
        std::thread::sleep(POLL.min(deadline - now));
    }
}

/// Waits (see [`wait`]) and writes the event to `data` as `make` builds it.
fn wait_into<T>(
    set: nvmlEventSet_t,
    data: *mut T,
    timeout_ms: c_uint,
    make: fn(Xid) -> T,
) -> nvmlReturn_t {
    ffi(|| {
        if data.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put(data, make(wait(set, timeout_ms)?))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    // nvml.h: 0xFFFFFFFF when the event names no MIG instance.
    wait_into(set, data, timeout_ms, |(gpu, code, instance)| {
        let (gi, ci) = instance.unwrap_or((0xFFFF_FFFF, 0xFFFF_FFFF));
        nvmlEventData_t {
            device: handle_of(gpu),
            eventType: XID_CRITICAL_ERROR,
            eventData: code as u64,
            gpuInstanceId: gi,
            computeInstanceId: ci,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    wait_into(
        set,
        data.cast::<nvmlEventData_v1_t>(),
        timeout_ms,
        |(gpu, code, _)| nvmlEventData_v1_t {
            device: handle_of(gpu),
            eventType: XID_CRITICAL_ERROR,
            eventData: code as u64,
        },
    )
}
