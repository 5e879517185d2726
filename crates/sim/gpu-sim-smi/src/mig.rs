//! `nvidia-smi mig -lgip`: the GPU-instance profiles of each MIG-enabled
//! GPU, in the real tool's 81-column table (one row pair per profile:
//! name, id, free/total instances, memory GiB, P2P, SM, DEC, ENC; then CE,
//! JPEG, OFA).

use nvml_wrapper::{Device, Nvml};
use std::ffi::{c_char, c_uint};
use std::fmt::Write as _;

/// NVML_GPU_INSTANCE_PROFILE_COUNT.
const PROFILE_COUNT: c_uint = 0x12;
/// NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2).
const INFO_V2: c_uint = 0x98 | (2 << 24);

/// nvmlGpuInstanceProfileInfo_v2_t (nvml.h).
#[repr(C)]
struct InfoV2 {
    version: c_uint,
    id: c_uint,
    is_p2p: c_uint,
    slices: c_uint,
    instances: c_uint,
    sms: c_uint,
    ce: c_uint,
    dec: c_uint,
    enc: c_uint,
    jpeg: c_uint,
    ofa: c_uint,
    memory_mb: u64,
    name: [c_char; 96],
}

type InfoFn = unsafe extern "C" fn(*mut libc::c_void, c_uint, *mut InfoV2) -> i32;
type CountFn = unsafe extern "C" fn(*mut libc::c_void, c_uint, *mut c_uint) -> i32;

const RULE: &str =
    "+-------------------------------------------------------------------------------+";

/// The table, or the real tool's message when no GPU has MIG enabled.
pub fn list_gip(nvml: &Nvml, devices: &[Device]) -> String {
    // SAFETY: looking the symbols up in the loaded NVML; each is called
    // below with nvml.h's signature.
    let (info, room) = unsafe {
        let lib = &nvml.lib().__library;
        (
            lib.get::<InfoFn>(b"nvmlDeviceGetGpuInstanceProfileInfoV\0"),
            lib.get::<CountFn>(b"nvmlDeviceGetGpuInstanceRemainingCapacity\0"),
        )
    };
    let (Ok(info), Ok(room)) = (info, room) else {
        return "No MIG-enabled devices found.\n".into();
    };
    let mut rows = String::new();
    for d in devices {
        if !d.mig_mode().is_ok_and(|m| m.current == 1) {
            continue;
        }
        let gpu = d.index().unwrap_or(0);
        // SAFETY: the handle of a device of this NVML.
        let h = unsafe { d.handle() }.cast::<libc::c_void>();
        let mut profiles = Vec::new();
        for profile in 0..PROFILE_COUNT {
            // SAFETY: InfoV2 is integers and a char array: all-zero is valid.
            let mut p: InfoV2 = unsafe { std::mem::zeroed() };
            p.version = INFO_V2;
            // SAFETY: nvml.h's signature; `p` is a live v2 struct.
            if unsafe { info(h, profile, &mut p) } == 0 {
                profiles.push(p);
            }
        }
        // The real tool's order: by size (slices, then memory), 1g.10gb
        // before 1g.10gb+me.
        profiles.sort_by_key(|p| (p.slices, p.memory_mb, p.id));
        for p in profiles {
            let mut free: c_uint = 0;
            // SAFETY: nvml.h's signature; `free` is a live c_uint.
            unsafe { room(h, p.id, &mut free) };
            // SAFETY: NVML NUL-terminates the name within its 96 bytes.
            let name = unsafe { std::ffi::CStr::from_ptr(p.name.as_ptr()) }.to_string_lossy();
            let mem = format!("{:.2}", p.memory_mb as f64 / 1024.0);
            let inst = format!("{free}/{}", p.instances);
            let p2p = if p.is_p2p != 0 { "Yes" } else { "No" };
            let _ = writeln!(
                rows,
                "|{gpu:>4}  {name:<20}{:>2}{inst:>8}{mem:>12}{p2p:>9}{:>7}{:>6}{:>6}   |",
                p.id, p.sms, p.dec, p.enc
            );
            let _ = writeln!(rows, "|{:57}{:>7}{:>6}{:>6}   |", "", p.ce, p.jpeg, p.ofa);
            let _ = writeln!(rows, "{RULE}");
        }
    }
    if rows.is_empty() {
        return "No MIG-enabled devices found.\n".into();
    }
    let mut s = String::new();
    let _ = writeln!(s, "{RULE}");
    for line in [
        " GPU instance profiles:",
        " GPU   Name               ID    Instances   Memory     P2P    SM    DEC   ENC",
        "                                Free/Total   GiB              CE    JPEG  OFA",
    ] {
        let _ = writeln!(s, "|{line:<79}|");
    }
    let _ = writeln!(s, "|{}|", "=".repeat(79));
    s + &rows
}
