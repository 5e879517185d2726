//! Which GPU of the container's share a CUDA device is: its position in
//! `vcuda-gpus.config` (the index of its ledger). Matched by PCI bus id
//! (`cuDeviceGetPCIBusId`, domain width and case normalised), else by UUID
//! (`cuDeviceGetUuid`), never by ordinal: `CUDA_VISIBLE_DEVICES` may reorder
//! the devices or name them by UUID. A device the share does not name is
//! refused (its contexts are not created).
//!
//! A one-GPU container keeps today's behaviour: every device is its one GPU
//! (the container sees only that one), and nothing is asked of the driver.

use crate::config::{self, Enforce};
use crate::real::real_cuda;
use cuda_abi::{CUDA_SUCCESS, CUresult};
use std::ffi::c_char;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// Ordinals whose answer is cached (more are looked up each time).
const CACHED: usize = 64;
/// Per ordinal: 0 not looked up yet, -1 no record, else record + 1.
static CACHE: [AtomicI32; CACHED] = [const { AtomicI32::new(0) }; CACHED];

/// (domain, bus, device, function) of a PCI bus id in any of the forms
/// CUDA and NVML print ("0000:3b:00.0", "00000000:3B:00.0").
pub fn parse_bus_id(s: &str) -> Option<(u32, u32, u32, u32)> {
    let s = s.trim().trim_end_matches('\0');
    let mut parts = s.rsplitn(3, ':');
    let devfn = parts.next()?;
    let bus = parts.next()?;
    let domain = parts.next().unwrap_or("0");
    let (dev, func) = devfn.split_once('.')?;
    let hex = |x: &str| u32::from_str_radix(x, 16).ok();
    Some((hex(domain)?, hex(bus)?, hex(dev)?, hex(func)?))
}

/// Whether two UUIDs name the same GPU ("GPU-" prefix and case aside).
fn same_uuid(a: &str, b: &str) -> bool {
    let norm = |s: &str| {
        s.trim()
            .to_ascii_lowercase()
            .trim_start_matches("gpu-")
            .replace('-', "")
    };
    !a.is_empty() && !b.is_empty() && norm(a) == norm(b)
}

/// The record a GPU with this bus id and UUID matches, if any.
pub fn record_of(gpus: &[quota_config::GpuQuota], bus_id: &str, uuid: &str) -> Option<usize> {
    let bus = parse_bus_id(bus_id);
    gpus.iter()
        .position(|g| bus.is_some() && parse_bus_id(&g.bus_id) == bus)
        .or_else(|| gpus.iter().position(|g| same_uuid(&g.uuid, uuid)))
}

fn get_bus_id(buf: &mut [c_char; 32], dev: i32) -> CUresult {
    let f =
        real_cuda!(cuDeviceGetPCIBusId: unsafe extern "C" fn(*mut c_char, i32, i32) -> CUresult);
    // SAFETY: the real driver's function of this exact signature, resolved by name; `buf` is
    // our caller's local of the length passed.
    unsafe { f(buf.as_mut_ptr(), buf.len() as i32, dev) }
}

fn get_uuid(u: &mut [u8; 16], dev: i32) -> CUresult {
    let f = real_cuda!(cuDeviceGetUuid: unsafe extern "C" fn(*mut [u8; 16], i32) -> CUresult);
    // SAFETY: the real driver's function of this exact signature, resolved by name; `u` is
    // our caller's 16-byte CUuuid.
    unsafe { f(u, dev) }
}

fn get_ctx_device(dev: &mut i32) -> CUresult {
    let f = real_cuda!(cuCtxGetDevice: unsafe extern "C" fn(*mut i32) -> CUresult);
    // SAFETY: the real driver's function of this exact signature, resolved by name; `dev` is
    // our caller's local.
    unsafe { f(dev) }
}

fn device_bus_id(dev: i32) -> String {
    let mut buf = [0 as c_char; 32];
    if get_bus_id(&mut buf, dev) != CUDA_SUCCESS {
        return String::new();
    }
    buf[buf.len() - 1] = 0;
    // SAFETY: `buf`'s last byte is 0, so a NUL terminator lies within it.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn device_uuid(dev: i32) -> String {
    let mut u = [0u8; 16];
    if get_uuid(&mut u, dev) != CUDA_SUCCESS {
        return String::new();
    }
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn lookup(enf: &Enforce, dev: i32) -> Result<usize, String> {
    let (bus, uuid) = (device_bus_id(dev), device_uuid(dev));
    record_of(&enf.gpus, &bus, &uuid).ok_or_else(|| {
        let share: Vec<String> = enf
            .gpus
            .iter()
            .map(|g| format!("{} {}", g.bus_id, g.uuid))
            .collect();
        format!(
            "CUDA device {dev} (PCI {bus}, {uuid}) is not one of this container's GPUs ({}); \
             refusing it",
            share.join(", ")
        )
    })
}

/// The position in the share of CUDA device `dev`; the error names the
/// device and the share's GPUs.
pub fn record(dev: i32) -> Result<usize, String> {
    let Some(enf) = config::enforce() else {
        return Ok(0);
    };
    if enf.gpus.len() == 1 {
        return Ok(0);
    }
    let slot = usize::try_from(dev).ok().and_then(|d| CACHE.get(d));
    match slot.map(|c| c.load(Ordering::Acquire)) {
        Some(-1) => {}
        Some(r) if r > 0 => return Ok(r as usize - 1),
        _ => {
            let found = lookup(enf, dev);
            if let Some(c) = slot {
                c.store(
                    found.as_ref().map_or(-1, |&r| r as i32 + 1),
                    Ordering::Release,
                );
            }
            return found;
        }
    }
    lookup(enf, dev)
}

/// [`record`] for a call that uses the device (a context, memory on it):
/// a device outside the share is `CUDA_ERROR_NOT_PERMITTED`, and why is
/// printed whatever the log level, once per device.
pub fn allowed(dev: i32) -> Result<usize, CUresult> {
    static SAID: AtomicU64 = AtomicU64::new(0);
    record(dev).map_err(|e| {
        let bit = 1u64.checked_shl(dev as u32).unwrap_or(0);
        if bit == 0 || SAID.fetch_or(bit, Ordering::AcqRel) & bit == 0 {
            crate::log::write_line(&e);
        }
        cuda_abi::CUDA_ERROR_NOT_PERMITTED
    })
}

/// The position of the calling thread's current context's device (0 in a
/// one-GPU container). `None` without a current context.
pub fn current() -> Option<usize> {
    let enf = config::enforce()?;
    if enf.gpus.len() == 1 {
        return Some(0);
    }
    let mut dev = -1;
    if get_ctx_device(&mut dev) != CUDA_SUCCESS {
        return None;
    }
    record(dev).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_config::GpuQuota;

    fn gpu(bus: &str, uuid: &str) -> GpuQuota {
        GpuQuota {
            bus_id: bus.into(),
            uuid: uuid.into(),
            gpu_memory: 1 << 30,
            utilization: 50,
            limit: 50,
        }
    }

    #[test]
    fn bus_ids_match_whatever_the_domain_width_and_case() {
        assert_eq!(parse_bus_id("0000:3b:00.0"), Some((0, 0x3b, 0, 0)));
        assert_eq!(
            parse_bus_id("00000000:3B:00.0"),
            parse_bus_id("0000:3b:00.0")
        );
        assert_eq!(parse_bus_id("3b:00.1"), Some((0, 0x3b, 0, 1)));
        assert_eq!(parse_bus_id("garbage"), None);
        assert_eq!(parse_bus_id(""), None);
    }

    #[test]
    fn devices_match_records_by_bus_id_else_uuid_never_by_position() {
        let share = [
            gpu("0000:3B:00.0", "GPU-aaaaaaaa-0000-0000-0000-000000000000"),
            gpu("0000:86:00.0", "GPU-bbbbbbbb-0000-0000-0000-000000000000"),
        ];
        assert_eq!(record_of(&share, "00000000:86:00.0", ""), Some(1));
        assert_eq!(record_of(&share, "0000:3b:00.0", ""), Some(0));
        assert_eq!(
            record_of(&share, "", "gpu-BBBBBBBB-0000-0000-0000-000000000000"),
            Some(1)
        );
        assert_eq!(
            record_of(
                &share,
                "0000:af:00.0",
                "GPU-cccccccc-0000-0000-0000-000000000000"
            ),
            None
        );
        assert_eq!(
            record_of(&share, "", ""),
            None,
            "an empty UUID matches nothing"
        );
    }
}
