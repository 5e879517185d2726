//! Init and shutdown, error strings, system queries and device enumeration.

use crate::info;
use crate::*;
use std::ffi::{c_int, c_uint};

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    ffi(init)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    ffi(init)
}

/// Flags (NO_GPUS, NO_ATTACH) change nothing here: init never needs GPUs.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    ffi(init)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    ffi(shutdown)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let s: &'static [u8] = match result {
        0 => b"Success\0",
        1 => b"Uninitialized\0",
        2 => b"Invalid Argument\0",
        3 => b"Not Supported\0",
        4 => b"Insufficient Permissions\0",
        5 => b"Already Initialized\0",
        6 => b"Not Found\0",
        7 => b"Insufficient Size\0",
        8 => b"Insufficient External Power\0",
        9 => b"Driver Not Loaded\0",
        10 => b"Timeout\0",
        11 => b"Interrupt Request Issue\0",
        12 => b"NVML Shared Library Not Found\0",
        13 => b"Function Not Found\0",
        14 => b"Corrupted infoROM\0",
        15 => b"GPU is lost\0",
        16 => b"GPU requires restart\0",
        17 => b"The operating system has blocked the request.\0",
        18 => b"RM has detected an NVML/RM version mismatch.\0",
        19 => b"In use by another client\0",
        20 => b"Insufficient Memory\0",
        21 => b"No data\0",
        22 => b"The requested vgpu operation is not available on target device, becasue ECC is enabled\0",
        23 => b"Insufficient Resources\0",
        24 => b"Frequency not supported\0",
        25 => b"Argument version mismatch\0",
        26 => b"Deprecated\0",
        27 => b"Not Ready\0",
        28 => b"GPU not found\0",
        29 => b"Invalid state\0",
        _ => b"Unknown Error\0",
    };
    s.as_ptr().cast()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| put_str(version, length, &ctx()?.state.node().driver_version))
}

/// "<CUDA major>.<driver version>", e.g. "12.550.54.15", as the real one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let node = c.state.node();
        let s = format!("{}.{}", node.cuda_version / 1000, node.driver_version);
        put_str(version, length, &s)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) -> nvmlReturn_t {
    ffi(|| put(v, ctx()?.state.node().cuda_version))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> nvmlReturn_t {
    ffi(|| put(v, ctx()?.state.node().cuda_version))
}

/// Name of a process by PID: its executable path as the host sees it (like
/// the real driver), else the command name the simulator recorded.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetProcessName(
    pid: c_uint,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let from_proc = std::fs::read(format!("/proc/{pid}/cmdline"))
            .ok()
            .and_then(|b| {
                let first = b.split(|&x| x == 0).next()?.to_vec();
                (!first.is_empty()).then(|| String::from_utf8_lossy(&first).into_owned())
            });
        let s = match from_proc {
            Some(s) => s,
            None => (0..c.state.gpu_count())
                .flat_map(|g| c.state.processes(g))
                .find(|p| p.pid() == pid)
                .map(|p| p.name)
                .ok_or(NVML_ERROR_NOT_FOUND)?,
        };
        // The real call truncates to the buffer rather than failing.
        let cut: String = s
            .chars()
            .take((length as usize).saturating_sub(1))
            .collect();
        put_str(name, length, &cut)
    })
}

// ---- enumeration --------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> nvmlReturn_t {
    ffi(|| put(count, ctx()?.visible.len() as c_uint))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    ffi(|| put(count, ctx()?.visible.len() as c_uint))
}

fn by_index(index: c_uint, device: *mut nvmlDevice_t) -> R {
    let c = ctx()?;
    let sim = *c
        .visible
        .get(index as usize)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    put(device, handle_of(sim))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| by_index(index, device))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| by_index(index, device))
}

fn find_visible(
    c: &Ctx,
    pred: impl Fn(&gpu_sim_core::GpuSpec) -> bool,
) -> Result<usize, nvmlReturn_t> {
    c.visible
        .iter()
        .copied()
        .find(|&s| pred(c.gpu(s)))
        .ok_or(NVML_ERROR_NOT_FOUND)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let want = arg_str(uuid)?;
        if want.starts_with("MIG-") {
            return put(device, crate::mig_device::by_uuid(&c, want)?);
        }
        let sim = find_visible(&c, |g| g.uuid.eq_ignore_ascii_case(want))?;
        put(device, handle_of(sim))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleBySerial(
    serial: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let want = arg_str(serial)?;
        let sim = find_visible(&c, |g| info::serial(g) == want)?;
        put(device, handle_of(sim))
    })
}

/// Accepts "DDDDDDDD:BB:DD.F", "DDDD:BB:DD.F" and "BB:DD.F" in any case.
fn by_bus_id(bus_id: *const c_char, device: *mut nvmlDevice_t) -> R {
    let c = ctx()?;
    let s = arg_str(bus_id)?.trim();
    let full = if s.matches(':').count() == 1 {
        format!("0000:{s}")
    } else {
        s.to_string()
    };
    let want = gpu_sim_core::node::parse_bus_id(&full).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let sim = find_visible(&c, |g| {
        let (d, b, dev, _) = g.pci_location();
        (d, b, dev) == (want.0, want.1, want.2)
    })?;
    put(device, handle_of(sim))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| by_bus_id(bus_id, device))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| by_bus_id(bus_id, device))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_strings_are_nul_terminated() {
        // SAFETY: nvmlErrorString returns a static NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(nvmlErrorString(7)) };
        assert_eq!(s.to_str().unwrap(), "Insufficient Size");
        // SAFETY: as above, for an unknown code too.
        let s = unsafe { std::ffi::CStr::from_ptr(nvmlErrorString(12345)) };
        assert_eq!(s.to_str().unwrap(), "Unknown Error");
    }

    #[test]
    fn uninitialized_calls_fail_cleanly() {
        let mut n = 0u32;
        assert_eq!(
            // SAFETY: a valid out-pointer to a local.
            unsafe { nvmlDeviceGetCount_v2(&mut n) },
            NVML_ERROR_UNINITIALIZED
        );
        assert_eq!(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
    }
}
