//! Devices: visibility, properties, attributes.

use crate::ctx::Ctx;
use crate::visible::Visible;
use crate::{R, cstr, drv, put};
use cuda_abi::attr::*;
use cuda_abi::*;
use gpu_sim_core::Attached;
use gpu_sim_core::{GpuSpec, SharedState};
use std::ffi::c_char;

pub(crate) struct Device {
    pub ordinal: i32,
    /// Index of the GPU in the node description / shared state (a MIG
    /// device's parent).
    pub gpu: usize,
    /// (GPU-instance id, compute-instance id) of a MIG device.
    pub mig: Option<(u32, u32)>,
    /// What the device is: the GPU's description, or a MIG device's (its
    /// name, UUID, SMs and memory; the parent's PCI location).
    pub spec: &'static GpuSpec,
    /// Lives as long as the process, like the real primary context.
    pub primary: &'static Ctx,
}

impl Device {
    pub fn new(ordinal: i32, v: Visible, spec: &'static GpuSpec) -> Device {
        Device {
            ordinal,
            gpu: v.gpu,
            mig: v.mig,
            spec,
            primary: Ctx::leak(ordinal, v.gpu, true, 0),
        }
    }
}

/// The devices of `visible`, in order; a MIG device's process is bound to
/// its instance in the shared state (its memory and kernels go there).
pub(crate) fn devices(state: &SharedState, me: Attached, visible: &[Visible]) -> Vec<Device> {
    visible
        .iter()
        .enumerate()
        .map(|(ordinal, &v)| {
            if let Some((gi, ci)) = v.mig {
                state.bind_mig(me, v.gpu, gi, ci);
            }
            Device::new(ordinal as i32, v, crate::visible::spec_of(state, v))
        })
        .collect()
}

fn spec(ordinal: i32) -> R<&'static GpuSpec> {
    Ok(drv()?.device(ordinal)?.spec)
}

/// 16 bytes of "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (or "MIG-…").
pub(crate) fn uuid_bytes(uuid: &str) -> [u8; 16] {
    let hex: Vec<u8> = uuid
        .trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .bytes()
        .filter(u8::is_ascii_hexdigit)
        .collect();
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        let s = hex
            .get(2 * i..2 * i + 2)
            .and_then(|s| std::str::from_utf8(s).ok());
        *b = s.and_then(|s| u8::from_str_radix(s, 16).ok()).unwrap_or(0);
    }
    out
}

/// Value of a device attribute: node values where the node describes them,
/// an A100-like part otherwise; 0 for attributes the simulator does not model.
pub(crate) fn attribute(g: &GpuSpec, ordinal: i32, a: i32) -> R<i32> {
    let (major, minor) = g.compute_capability();
    let (domain, bus, device, _) = g.pci_location();
    let v = match a {
        MAX_THREADS_PER_BLOCK => 1024,
        MAX_BLOCK_DIM_X | MAX_BLOCK_DIM_Y => 1024,
        MAX_BLOCK_DIM_Z => 64,
        MAX_GRID_DIM_X => i32::MAX,
        MAX_GRID_DIM_Y | MAX_GRID_DIM_Z => 65535,
        MAX_SHARED_MEMORY_PER_BLOCK => 49152,
        TOTAL_CONSTANT_MEMORY => 65536,
        WARP_SIZE => 32,
        MAX_PITCH => i32::MAX,
        MAX_REGISTERS_PER_BLOCK | MAX_REGISTERS_PER_MULTIPROCESSOR => 65536,
        CLOCK_RATE => 1_410_000,
        TEXTURE_ALIGNMENT => 512,
        TEXTURE_PITCH_ALIGNMENT => 32,
        GPU_OVERLAP | CONCURRENT_KERNELS | ECC_ENABLED | UNIFIED_ADDRESSING => 1,
        CAN_MAP_HOST_MEMORY | MANAGED_MEMORY | CONCURRENT_MANAGED_ACCESS => 1,
        COMPUTE_PREEMPTION_SUPPORTED | COOPERATIVE_LAUNCH | STREAM_PRIORITIES_SUPPORTED => 1,
        GLOBAL_L1_CACHE_SUPPORTED | LOCAL_L1_CACHE_SUPPORTED | HOST_REGISTER_SUPPORTED => 1,
        CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM => 1,
        VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED | HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED => 1,
        MEMORY_POOLS_SUPPORTED => 1,
        MPS_ENABLED => i32::from(gpu_sim_core::mps_server_pid().is_some()),
        MEMPOOL_SUPPORTED_HANDLE_TYPES => 1,
        KERNEL_EXEC_TIMEOUT | INTEGRATED | COMPUTE_MODE | TCC_DRIVER | MULTI_GPU_BOARD => 0,
        HOST_NATIVE_ATOMIC_SUPPORTED | PAGEABLE_MEMORY_ACCESS => 0,
        MULTI_GPU_BOARD_GROUP_ID => ordinal,
        MULTIPROCESSOR_COUNT => g.sm_count as i32,
        MAX_THREADS_PER_MULTIPROCESSOR => g.max_threads_per_sm as i32,
        MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        COMPUTE_CAPABILITY_MAJOR => major,
        COMPUTE_CAPABILITY_MINOR => minor,
        PCI_DOMAIN_ID => domain as i32,
        PCI_BUS_ID => bus as i32,
        PCI_DEVICE_ID => device as i32,
        MEMORY_CLOCK_RATE => 1_215_000,
        GLOBAL_MEMORY_BUS_WIDTH => 5120,
        L2_CACHE_SIZE => 40 * 1024 * 1024,
        ASYNC_ENGINE_COUNT => 2,
        MAX_SHARED_MEMORY_PER_MULTIPROCESSOR => 167_936,
        MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 166_912,
        SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO => 2,
        MAX_PERSISTING_L2_CACHE_SIZE => 30 * 1024 * 1024,
        MAX_ACCESS_POLICY_WINDOW_SIZE => 134_213_632,
        RESERVED_SHARED_MEMORY_PER_BLOCK => 1024,
        // Known to the driver (CU_DEVICE_ATTRIBUTE_MAX is 150 in CUDA 13),
        // not modelled here.
        _ if (1..150).contains(&a) => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    Ok(v)
}

unsafe fn write_cstr(dst: *mut c_char, len: i32, s: &str) -> R {
    if dst.is_null() || len <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: `dst` is non-NULL with `len` > n bytes (checked above; the caller's buffer per
    // the CUDA ABI), and cannot overlap our `s`.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), dst, n);
        *dst.add(n) = 0;
    }
    Ok(())
}

/// "DDDD:BB:DD.F" as cuDeviceGetPCIBusId prints it.
fn bus_id(g: &GpuSpec) -> String {
    let (domain, bus, device, function) = g.pci_location();
    format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}").to_ascii_uppercase()
}

cuda_fn! {
    fn cuDeviceGetCount(count: *mut i32) {
        put(count, drv()?.devices.len() as i32)
    }

    fn cuDeviceGet(device: *mut i32, ordinal: i32) {
        drv()?.device(ordinal)?;
        put(device, ordinal)
    }

    fn cuDeviceGetName(name: *mut c_char, len: i32, dev: i32) {
        // SAFETY: `write_cstr` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { write_cstr(name, len, &spec(dev)?.name) }
    }

    fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: i32) {
        put(uuid, uuid_bytes(&spec(dev)?.uuid))
    }

    fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: i32) {
        put(uuid, uuid_bytes(&spec(dev)?.uuid))
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) {
        put(bytes, spec(dev)?.memory_bytes() as usize)
    }

    fn cuDeviceGetAttribute(value: *mut i32, attrib: i32, dev: i32) {
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if attrib == crate::share::ATTR_FABRIC_SUPPORTED {
            let d = drv()?;
            return put(value, crate::share::fabric_supported(d, d.device(dev)?.gpu) as i32);
        }
        put(value, attribute(spec(dev)?, dev, attrib)?)
    }

    fn cuDeviceComputeCapability(major: *mut i32, minor: *mut i32, dev: i32) {
        let (a, b) = spec(dev)?.compute_capability();
        put(major, a)?;
        put(minor, b)
    }

    fn cuDeviceGetPCIBusId(out: *mut c_char, len: i32, dev: i32) {
        // SAFETY: `write_cstr` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { write_cstr(out, len, &bus_id(spec(dev)?)) }
    }

    fn cuDeviceGetByPCIBusId(dev: *mut i32, id: *const c_char) {
        if dev.is_null() || id.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let want = cstr(id)?.to_str().ok().and_then(parse_bus_id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let d = drv()?;
        let found = d
            .devices
            .iter()
            .find(|x| {
                let (dom, bus, device, _) = x.spec.pci_location();
                (dom, bus, device) == want
            })
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        put(dev, found.ordinal)
    }

    fn cuDeviceCanAccessPeer(can: *mut i32, dev: i32, peer: i32) {
        let d = drv()?;
        let (a, b) = (d.device(dev)?, d.device(peer)?);
        put(can, d.node().peer_capable(a.gpu, b.gpu) as i32)
    }

    fn cuDeviceGetDefaultMemPool(pool: *mut *mut c_void, dev: i32) {
        let d = drv()?;
        let dev = d.device(dev)?;
        put(pool, crate::pool::default_pool(dev.gpu))
    }
}

use std::ffi::c_void;

/// "[domain:]bus:device[.function]", hex, any width.
fn parse_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    let s = s.trim();
    let parts: Vec<&str> = s.split(':').collect();
    let (dom, bus, rest) = match parts.as_slice() {
        [d, b, r] => (u32::from_str_radix(d, 16).ok()?, *b, *r),
        [b, r] => (0, *b, *r),
        _ => return None,
    };
    let dev = rest.split('.').next()?;
    Some((
        dom,
        u32::from_str_radix(bus, 16).ok()?,
        u32::from_str_radix(dev, 16).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_bytes_parse_the_printed_form() {
        let b = uuid_bytes("GPU-6f61d573-f4c5-5a3a-8902-f931468a1784");
        assert_eq!(b[0], 0x6f);
        assert_eq!(b[15], 0x84);
        let m = uuid_bytes("MIG-0b1c2d3e-f4c5-5a3a-8902-f931468a1784");
        assert_eq!(m[0], 0x0b);
        assert_eq!(uuid_bytes("xyz"), [0; 16]);
    }

    #[test]
    fn bus_ids_in_any_width() {
        assert_eq!(parse_bus_id("0000:07:00.0"), Some((0, 7, 0)));
        assert_eq!(parse_bus_id("00000000:3B:00.0"), Some((0, 0x3b, 0)));
        assert_eq!(parse_bus_id("07:01"), Some((0, 7, 1)));
        assert_eq!(parse_bus_id("nope"), None);
    }
}
