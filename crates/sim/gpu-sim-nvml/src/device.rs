//! A device's identity (names, serial, board, architecture) and its PCI
//! location and link.

use crate::mig_handles::with_dev_or_mig;
use crate::*;
use crate::{info, mig_device};
use std::ffi::{c_int, c_uint};

/// nvmlPciInfoExt_v1 = NVML_STRUCT_VERSION(PciInfoExt, 1).
const NVML_PCI_INFO_EXT_V1: c_uint = 64 | (1 << 24);

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

const _: () = assert!(std::mem::size_of::<nvmlPciInfo_t>() == 68);
const _: () = assert!(std::mem::size_of::<nvmlPciInfoExt_t>() == 64);
const _: () = assert!(std::mem::offset_of!(nvmlPciInfoExt_t, version) == 0);

pub(crate) fn pci_info(g: &gpu_sim_core::GpuSpec) -> nvmlPciInfo_t {
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

// ---- identity -----------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_dev_or_mig(
        device,
        |c, s| put_str(name, length, &c.gpu(s).name),
        |c, m| put_str(name, length, &mig_device::name(m, c)),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_dev_or_mig(
        device,
        |c, s| put_str(uuid, length, &c.gpu(s).uuid),
        |c, (s, g, ci)| {
            let u = crate::mig_handles::mig_uuid(&c.gpu(s).uuid, g.id, ci.id);
            put_str(uuid, length, &u)
        },
    )
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
