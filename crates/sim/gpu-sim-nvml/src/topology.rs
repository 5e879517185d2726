//! Topology between devices: PCIe common ancestors, nearest GPUs, P2P status
//! and NVLink.

use crate::device::{nvmlPciInfo_t, pci_info};
use crate::info;
use crate::*;
use std::ffi::c_uint;

const NVML_NVLINK_MAX_LINKS: c_uint = 36;

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
        // What cuDeviceCanAccessPeer answers on the same node.
        let peer = node.peer_capable(a, b);
        const OK: c_uint = 0;
        const CHIPSET_NOT_SUPPORTED: c_uint = 1;
        const NOT_SUPPORTED: c_uint = 5;
        let st = match index {
            _ if a == b => NOT_SUPPORTED,
            // read, write, atomics, prop
            0 | 1 | 3 | 4 => {
                if peer {
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
