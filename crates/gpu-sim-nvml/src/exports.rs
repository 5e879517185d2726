//! Init, system queries and per-device queries.

use crate::info;
use crate::*;
use gpu_sim_core::PcieLevel;
use gpu_sim_core::state::now_ns;
use std::ffi::{c_int, c_uint, c_ulong, c_ulonglong};

const NVML_FEATURE_DISABLED: c_uint = 0;
const NVML_FEATURE_ENABLED: c_uint = 1;
const NVML_NVLINK_MAX_LINKS: c_uint = 36;

/// nvmlMemory_v2 = NVML_STRUCT_VERSION(Memory, 2).
const NVML_MEMORY_V2: c_uint = 40 | (2 << 24);
/// nvmlPciInfoExt_v1 = NVML_STRUCT_VERSION(PciInfoExt, 1).
const NVML_PCI_INFO_EXT_V1: c_uint = 64 | (1 << 24);

#[repr(C)]
pub struct nvmlMemory_t {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct nvmlMemory_v2_t {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct nvmlBAR1Memory_t {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct nvmlUtilization_t {
    gpu: c_uint,
    memory: c_uint,
}

/// nvmlPciInfo_t since NVML 9 (used by _v2, _v3 and NvLinkRemotePciInfo).
#[repr(C)]
pub struct nvmlPciInfo_t {
    busIdLegacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pciDeviceId: c_uint,
    pciSubSystemId: c_uint,
    busId: [c_char; 32],
}

/// The original nvmlPciInfo_t (nvmlDeviceGetPciInfo): 16-byte bus id first;
/// its trailing reserved words are left alone.
#[repr(C)]
struct nvmlPciInfo_v1_head {
    busId: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pciDeviceId: c_uint,
    pciSubSystemId: c_uint,
}

#[repr(C)]
pub struct nvmlPciInfoExt_t {
    version: c_uint,
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pciDeviceId: c_uint,
    pciSubSystemId: c_uint,
    baseClass: c_uint,
    subClass: c_uint,
    busId: [c_char; 32],
}

const _: () = assert!(std::mem::size_of::<nvmlMemory_v2_t>() == 40);
const _: () = assert!(std::mem::size_of::<nvmlPciInfo_t>() == 68);
const _: () = assert!(std::mem::size_of::<nvmlPciInfoExt_t>() == 64);
// check_version() reads the version where these structs keep it.
const _: () = assert!(std::mem::offset_of!(nvmlMemory_v2_t, version) == 0);
const _: () = assert!(std::mem::offset_of!(nvmlPciInfoExt_t, version) == 0);

/// A versioned struct from the caller: non-null, and its leading `version`
/// word is `want`.
fn check_version<T>(p: *mut T, want: c_uint) -> R {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null pointer to the caller's struct, which starts with
    // its c_uint version (asserted above for the structs passed here).
    if unsafe { *p.cast::<c_uint>() } != want {
        return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    Ok(())
}

fn pci_info(g: &gpu_sim_core::GpuSpec) -> nvmlPciInfo_t {
    let (domain, bus, device, _) = g.pci_location();
    nvmlPciInfo_t {
        busIdLegacy: c_field(&format!("{:04X}:{bus:02X}:{device:02X}.0", domain & 0xffff)),
        domain,
        bus,
        device,
        pciDeviceId: info::pci_combined_id(g),
        pciSubSystemId: info::pci_subsystem_id(g),
        busId: c_field(&format!("{domain:08X}:{bus:02X}:{device:02X}.0")),
    }
}

/// Device utilization over the last second of the simulated timeline.
fn recent_util(c: &Ctx, sim: usize) -> u32 {
    let now = now_ns();
    c.state
        .utilization(sim, now.saturating_sub(1_000_000_000), now)
        .round() as u32
}

// ---- init and system ----------------------------------------------------

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

// ---- identity -----------------------------------------------------------

/// Runs `f` with the context and the simulated index of `device`.
fn with_dev(device: nvmlDevice_t, f: impl FnOnce(&Ctx, usize) -> R) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let sim = c.dev(device)?;
        f(&c, sim)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put_str(name, length, &c.gpu(s).name))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put_str(uuid, length, &c.gpu(s).uuid))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        put_str(serial, length, &info::serial(c.gpu(s)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBoardPartNumber(
    device: nvmlDevice_t,
    part: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put_str(part, length, "692-2G506-0200-002"))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVbiosVersion(
    device: nvmlDevice_t,
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put_str(version, length, "92.00.36.00.01"))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        put(
            index,
            c.index_of(s).ok_or(NVML_ERROR_INVALID_ARGUMENT)? as c_uint,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(minor, c.gpu(s).minor))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBoardId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(id, info::board_id(c.gpu(s))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMultiGpuBoard(
    device: nvmlDevice_t,
    multi: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(multi, 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(brand, info::brand(c.gpu(s))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(arch, info::architecture(c.gpu(s))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if major.is_null() || minor.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (a, b) = c.gpu(s).compute_capability();
        put(major, a)?;
        put(minor, b)
    })
}

// ---- PCI ----------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let p = pci_info(c.gpu(s));
        let head = nvmlPciInfo_v1_head {
            busId: p.busIdLegacy,
            domain: p.domain,
            bus: p.bus,
            device: p.device,
            pciDeviceId: p.pciDeviceId,
            pciSubSystemId: p.pciSubSystemId,
        };
        put(pci.cast::<nvmlPciInfo_v1_head>(), head)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(pci, pci_info(c.gpu(s))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(pci, pci_info(c.gpu(s))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfoExt(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfoExt_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        check_version(pci, NVML_PCI_INFO_EXT_V1)?;
        let p = pci_info(c.gpu(s));
        put(
            pci,
            nvmlPciInfoExt_t {
                version: NVML_PCI_INFO_EXT_V1,
                domain: p.domain,
                bus: p.bus,
                device: p.device,
                pciDeviceId: p.pciDeviceId,
                pciSubSystemId: p.pciSubSystemId,
                baseClass: 3, // display controller
                subClass: 2,  // 3D controller
                busId: p.busId,
            },
        )
    })
}

/// Every link runs at its maximum: the current and the max calls agree.
const PCIE_LINK_GEN: c_uint = 4;
const PCIE_LINK_WIDTH: c_uint = 16;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkGeneration(
    device: nvmlDevice_t,
    gen_: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(gen_, PCIE_LINK_GEN))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkGeneration(
    device: nvmlDevice_t,
    gen_: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(gen_, PCIE_LINK_GEN))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkWidth(
    device: nvmlDevice_t,
    width: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(width, PCIE_LINK_WIDTH))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkWidth(
    device: nvmlDevice_t,
    width: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(width, PCIE_LINK_WIDTH))
}

// ---- memory and utilization --------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let total = c.state.memory_total(s);
        let used = c.state.memory_used(s).min(total);
        put(
            memory,
            nvmlMemory_t {
                total,
                free: total - used,
                used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        check_version(memory, NVML_MEMORY_V2)?;
        let total = c.state.memory_total(s);
        let used = c.state.memory_used(s).min(total);
        put(
            memory,
            nvmlMemory_v2_t {
                version: NVML_MEMORY_V2,
                total,
                // No driver reservation: used is exactly what processes hold.
                reserved: 0,
                free: total - used,
                used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBAR1MemoryInfo(
    device: nvmlDevice_t,
    bar1: *mut nvmlBAR1Memory_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let total = c.state.memory_total(s).next_power_of_two();
        let used = 2 << 20;
        put(
            bar1,
            nvmlBAR1Memory_t {
                total,
                free: total - used,
                used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    util: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let gpu = recent_util(c, s);
        // No memory-traffic model: report it proportional to compute.
        put(
            util,
            nvmlUtilization_t {
                gpu,
                memory: gpu / 2,
            },
        )
    })
}

/// No video engine model: the encoder and the decoder are always idle.
fn codec_utilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| {
        put(util, 0)?;
        put(period_us, 167_000)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderUtilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    codec_utilization(device, util, period_us)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDecoderUtilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    codec_utilization(device, util, period_us)
}

// ---- health, power, clocks, modes --------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: c_uint,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if sensor != 0 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put(temp, 32 + recent_util(c, s) * 2 / 5)
    })
}

fn power_mw(c: &Ctx, s: usize) -> u32 {
    let limit = limit_mw(c, s);
    let idle = limit / 7;
    idle + (limit - idle) * recent_util(c, s) / 100
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mw, power_mw(c, s)))
}

fn limit_mw(c: &Ctx, s: usize) -> u32 {
    c.gpu(s).power_limit_w * 1000
}

/// The enforced, the set and the default limit: one fixed board limit.
fn power_limit(device: nvmlDevice_t, mw: *mut c_uint) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mw, limit_mw(c, s)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    power_limit(device, mw)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementLimit(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    power_limit(device, mw)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementDefaultLimit(
    device: nvmlDevice_t,
    mw: *mut c_uint,
) -> nvmlReturn_t {
    power_limit(device, mw)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementLimitConstraints(
    device: nvmlDevice_t,
    min_mw: *mut c_uint,
    max_mw: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let limit = limit_mw(c, s);
        put(min_mw, limit / 4)?;
        put(max_mw, limit)
    })
}

/// Data-centre boards have no fan (the real call fails the same way).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFanSpeed(
    device: nvmlDevice_t,
    speed: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if !info::is_consumer(c.gpu(s)) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        put(speed, 30 + recent_util(c, s) / 3)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(mode, NVML_FEATURE_ENABLED))
}

/// NVML_COMPUTEMODE_DEFAULT: vcuda shares devices between processes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(mode, 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDisplayMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(mode, NVML_FEATURE_DISABLED))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDisplayActive(
    device: nvmlDevice_t,
    active: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |_, _| put(active, NVML_FEATURE_DISABLED))
}

/// P0 while kernels ran in the last second, P8 when idle.
fn pstate(device: nvmlDevice_t, state: *mut c_uint) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        put(state, if recent_util(c, s) > 0 { 0 } else { 8 })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPerformanceState(
    device: nvmlDevice_t,
    state: *mut c_uint,
) -> nvmlReturn_t {
    pstate(device, state)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerState(
    device: nvmlDevice_t,
    state: *mut c_uint,
) -> nvmlReturn_t {
    pstate(device, state)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if info::is_consumer(c.gpu(s)) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        put(current, NVML_FEATURE_ENABLED)?;
        put(pending, NVML_FEATURE_ENABLED)
    })
}

/// No ECC error model: counters stay at zero where ECC exists.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    _error_type: c_uint,
    _counter_type: c_uint,
    count: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if info::is_consumer(c.gpu(s)) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        put(count, 0)
    })
}

fn clock(c: &Ctx, s: usize, kind: c_uint, current: bool) -> Result<c_uint, nvmlReturn_t> {
    let (gfx, mem, video) = info::max_clocks(c.gpu(s));
    let busy = !current || recent_util(c, s) > 0;
    Ok(match kind {
        0 | 1 if busy => gfx,
        0 | 1 => 210,
        2 => mem,
        3 if busy => video,
        3 => 795,
        _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    kind: c_uint,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mhz, clock(c, s, kind, true)?))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxClockInfo(
    device: nvmlDevice_t,
    kind: c_uint,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(mhz, clock(c, s, kind, false)?))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(
    device: nvmlDevice_t,
    node: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        put(node, c.gpu(s).numa_node.max(0) as c_uint)
    })
}

/// CPUs of the GPU's NUMA node where the host has that node, else all
/// online CPUs.
fn affinity_cpus(numa: i32) -> Vec<usize> {
    let parse = |list: &str| -> Vec<usize> {
        list.trim()
            .split(',')
            .filter(|p| !p.is_empty())
            .flat_map(|p| match p.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (a.parse().unwrap_or(0), b.parse().unwrap_or(0));
                    (a..=b).collect::<Vec<usize>>()
                }
                None => p.parse().into_iter().collect(),
            })
            .collect()
    };
    std::fs::read_to_string(format!("/sys/devices/system/node/node{numa}/cpulist"))
        .or_else(|_| std::fs::read_to_string("/sys/devices/system/cpu/online"))
        .map(|s| parse(&s))
        .unwrap_or_else(|_| (0..1).collect())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinity(
    device: nvmlDevice_t,
    set_size: c_uint,
    set: *mut c_ulong,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if set.is_null() || set_size == 0 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let bits = c_ulong::BITS as usize;
        for w in 0..set_size as usize {
            // SAFETY: the caller's array holds set_size words.
            unsafe { *set.add(w) = 0 };
        }
        for cpu in affinity_cpus(c.gpu(s).numa_node) {
            if cpu / bits < set_size as usize {
                // SAFETY: index checked against set_size.
                unsafe { *set.add(cpu / bits) |= 1 << (cpu % bits) };
            }
        }
        Ok(())
    })
}

// ---- topology -----------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let (a, b) = (c.dev(device1)?, c.dev(device2)?);
        put(path, c.state.node().pcie_level(a, b) as c_uint)
    })
}

/// GPUs at most `level` away from `device` (itself excluded). With
/// `*count == 0` only the number is returned, as the real call does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyNearestGpus(
    device: nvmlDevice_t,
    level: c_uint,
    count: *mut c_uint,
    devices: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let node = c.state.node();
        let near: Vec<usize> = c
            .visible
            .iter()
            .copied()
            .filter(|&o| o != s && node.pcie_level(s, o) as c_uint <= level)
            .collect();
        // SAFETY: non-null, checked above.
        let cap = unsafe { *count } as usize;
        if cap == 0 {
            return put(count, near.len() as c_uint);
        }
        if devices.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let n = near.len().min(cap);
        for (i, &o) in near.iter().take(n).enumerate() {
            // SAFETY: the caller's array holds `cap` >= n handles.
            unsafe { *devices.add(i) = handle_of(o) };
        }
        put(count, n as c_uint)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    index: c_uint,
    status: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let (a, b) = (c.dev(device1)?, c.dev(device2)?);
        let node = c.state.node();
        let nvlink = node.nvlink_count(a, b) > 0;
        let pcie_ok = node.pcie_level(a, b) <= PcieLevel::HostBridge;
        const OK: c_uint = 0;
        const CHIPSET_NOT_SUPPORTED: c_uint = 1;
        const NOT_SUPPORTED: c_uint = 5;
        let st = match index {
            _ if a == b => NOT_SUPPORTED,
            // read, write, atomics, prop
            0 | 1 | 3 | 4 => {
                if nvlink || pcie_ok {
                    OK
                } else {
                    CHIPSET_NOT_SUPPORTED
                }
            }
            2 => {
                if nvlink {
                    OK
                } else {
                    NOT_SUPPORTED
                }
            }
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        put(status, st)
    })
}

/// The peer that NVLink `link` of GPU `s` goes to: links are numbered
/// peer by peer in GPU order, each peer taking as many as the node gives it.
fn nvlink_peer(c: &Ctx, s: usize, link: c_uint) -> Result<Option<usize>, nvmlReturn_t> {
    if link >= NVML_NVLINK_MAX_LINKS {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let node = c.state.node();
    let n = node.gpus.len();
    if (0..n).all(|o| node.nvlink_count(s, o) == 0) {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    let mut first = 0;
    for o in 0..n {
        let k = node.nvlink_count(s, o);
        if link < first + k {
            return Ok(Some(o));
        }
        first += k;
    }
    Ok(None)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    active: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let on = nvlink_peer(c, s, link)?.is_some();
        put(
            active,
            if on {
                NVML_FEATURE_ENABLED
            } else {
                NVML_FEATURE_DISABLED
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkVersion(
    device: nvmlDevice_t,
    link: c_uint,
    version: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        nvlink_peer(c, s, link)?.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        put(version, info::nvlink_version(c.gpu(s)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkCapability(
    device: nvmlDevice_t,
    link: c_uint,
    capability: c_uint,
    result: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let active = nvlink_peer(c, s, link)?.is_some();
        let v = match capability {
            // P2P, P2P atomics, valid
            0 | 2 | 5 => active as c_uint,
            1 | 3 | 4 => 0,
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        put(result, v)
    })
}

fn nvlink_remote(device: nvmlDevice_t, link: c_uint, pci: *mut nvmlPciInfo_t) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let peer = nvlink_peer(c, s, link)?.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        put(pci, pci_info(c.gpu(peer)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    nvlink_remote(device, link, pci)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    nvlink_remote(device, link, pci)
}

/// NVML_NVLINK_DEVICE_TYPE_GPU: every simulated link ends at a GPU.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    device: nvmlDevice_t,
    link: c_uint,
    kind: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        nvlink_peer(c, s, link)?.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        put(kind, 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_strings_are_nul_terminated() {
        let s = unsafe { std::ffi::CStr::from_ptr(nvmlErrorString(7)) };
        assert_eq!(s.to_str().unwrap(), "Insufficient Size");
        let s = unsafe { std::ffi::CStr::from_ptr(nvmlErrorString(12345)) };
        assert_eq!(s.to_str().unwrap(), "Unknown Error");
    }

    #[test]
    fn uninitialized_calls_fail_cleanly() {
        let mut n = 0u32;
        assert_eq!(
            unsafe { nvmlDeviceGetCount_v2(&mut n) },
            NVML_ERROR_UNINITIALIZED
        );
        assert_eq!(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
    }
}
