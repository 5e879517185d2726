//! MIG mode and GPU instances (nvml.h's nvmlMultiInstanceGPU group): the
//! GPU's profiles (`gpu_sim_core::mig`), placements, and creating, listing
//! and destroying GPU instances in the shared state.
//!
//! `profile` arguments are NVML_GPU_INSTANCE_PROFILE_* indices (indices at
//! or above NVML_GPU_INSTANCE_PROFILE_COUNT are INVALID_ARGUMENT, so
//! clients can enumerate); `profileId` arguments are the driver's profile
//! ids that the profile info reports (19 for 1g.10gb, ...). A GPU without
//! MIG, or with MIG disabled, answers NOT_SUPPORTED, except that placements
//! are listed whatever the mode, as nvml.h says.

use crate::mig_handles::*;
use crate::*;
use gpu_sim_core::mig::{GI_PROFILE_COUNT, GiProfile, MigModel, Placement};
use gpu_sim_core::state::{Activation, GpuInstance, MigError};
use std::ffi::c_uint;

/// NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2 / 3).
const GI_PROFILE_INFO_V2: c_uint = 0x98 | (2 << 24);
const GI_PROFILE_INFO_V3: c_uint = 0x98 | (3 << 24);

const NVML_DEVICE_MIG_DISABLE: c_uint = 0;
const NVML_DEVICE_MIG_ENABLE: c_uint = 1;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlGpuInstancePlacement_t {
    pub start: c_uint,
    pub size: c_uint,
}

#[repr(C)]
pub struct nvmlGpuInstanceProfileInfo_t {
    id: c_uint,
    isP2pSupported: c_uint,
    sliceCount: c_uint,
    instanceCount: c_uint,
    multiprocessorCount: c_uint,
    copyEngineCount: c_uint,
    decoderCount: c_uint,
    encoderCount: c_uint,
    jpegCount: c_uint,
    ofaCount: c_uint,
    memorySizeMB: u64,
}

#[repr(C)]
pub struct nvmlGpuInstanceProfileInfo_v2_t {
    version: c_uint,
    id: c_uint,
    isP2pSupported: c_uint,
    sliceCount: c_uint,
    instanceCount: c_uint,
    multiprocessorCount: c_uint,
    copyEngineCount: c_uint,
    decoderCount: c_uint,
    encoderCount: c_uint,
    jpegCount: c_uint,
    ofaCount: c_uint,
    memorySizeMB: u64,
    name: [c_char; 96],
}

/// v3: `isP2pSupported` gone, `capabilities` (NVML_GPU_INSTANCE_PROFILE_CAPS_*) added.
#[repr(C)]
pub struct nvmlGpuInstanceProfileInfo_v3_t {
    version: c_uint,
    id: c_uint,
    sliceCount: c_uint,
    instanceCount: c_uint,
    multiprocessorCount: c_uint,
    copyEngineCount: c_uint,
    decoderCount: c_uint,
    encoderCount: c_uint,
    jpegCount: c_uint,
    ofaCount: c_uint,
    memorySizeMB: u64,
    name: [c_char; 96],
    capabilities: c_uint,
}

#[repr(C)]
pub struct nvmlGpuInstanceInfo_t {
    device: nvmlDevice_t,
    id: c_uint,
    profileId: c_uint,
    placement: nvmlGpuInstancePlacement_t,
}

// nvml.h's layouts (sizes also in the version words: 0x98).
const _: () = assert!(std::mem::size_of::<nvmlGpuInstanceProfileInfo_t>() == 48);
const _: () = assert!(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() == 0x98);
const _: () = assert!(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() == 0x98);
const _: () = assert!(std::mem::offset_of!(nvmlGpuInstanceProfileInfo_v3_t, memorySizeMB) == 40);
const _: () = assert!(std::mem::size_of::<nvmlGpuInstanceInfo_t>() == 24);

fn v1_info(p: &GiProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        // `nvidia-smi mig -lgip` prints P2P "No" on these boards.
        isP2pSupported: 0,
        sliceCount: p.slices,
        instanceCount: p.instances,
        multiprocessorCount: p.sms,
        copyEngineCount: p.copy_engines,
        decoderCount: p.decoders,
        encoderCount: p.encoders,
        jpegCount: p.jpegs,
        ofaCount: p.ofas,
        memorySizeMB: p.memory_mib,
    }
}

/// Writes a v2 or v3 profile info, as the caller's version word asks.
fn put_versioned(info: *mut nvmlGpuInstanceProfileInfo_v2_t, p: &GiProfile) -> R {
    if info.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null pointer to the caller's struct, whose first field
    // is its c_uint version.
    let version = unsafe { *info.cast::<c_uint>() };
    let v = v1_info(p);
    let name = c_field(&format!("MIG {}", p.name));
    match version {
        GI_PROFILE_INFO_V2 => put(
            info,
            nvmlGpuInstanceProfileInfo_v2_t {
                version,
                id: v.id,
                isP2pSupported: v.isP2pSupported,
                sliceCount: v.sliceCount,
                instanceCount: v.instanceCount,
                multiprocessorCount: v.multiprocessorCount,
                copyEngineCount: v.copyEngineCount,
                decoderCount: v.decoderCount,
                encoderCount: v.encoderCount,
                jpegCount: v.jpegCount,
                ofaCount: v.ofaCount,
                memorySizeMB: v.memorySizeMB,
                name,
            },
        ),
        GI_PROFILE_INFO_V3 => put(
            info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(),
            nvmlGpuInstanceProfileInfo_v3_t {
                version,
                id: v.id,
                sliceCount: v.sliceCount,
                instanceCount: v.instanceCount,
                multiprocessorCount: v.multiprocessorCount,
                copyEngineCount: v.copyEngineCount,
                decoderCount: v.decoderCount,
                encoderCount: v.encoderCount,
                jpegCount: v.jpegCount,
                ofaCount: v.ofaCount,
                memorySizeMB: v.memorySizeMB,
                name,
                capabilities: 0,
            },
        ),
        _ => Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH),
    }
}

/// The GPU's MIG model when MIG is enabled (NOT_SUPPORTED otherwise).
fn enabled(c: &Ctx, sim: usize) -> Result<&'static MigModel, nvmlReturn_t> {
    let model = c.gpu(sim).mig_model().ok_or(NVML_ERROR_NOT_SUPPORTED)?;
    match c.state.mig_mode(sim).map_err(mig_handles::code)? {
        (true, _) => Ok(model),
        (false, _) => Err(NVML_ERROR_NOT_SUPPORTED),
    }
}

/// The profile at an NVML_GPU_INSTANCE_PROFILE_* index.
fn by_index(c: &Ctx, sim: usize, profile: c_uint) -> Result<&'static GiProfile, nvmlReturn_t> {
    if profile >= GI_PROFILE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    enabled(c, sim)?
        .by_index(profile)
        .ok_or(NVML_ERROR_NOT_SUPPORTED)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    currentMode: *mut c_uint,
    pendingMode: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if currentMode.is_null() || pendingMode.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (cur, pend) = c.state.mig_mode(s).map_err(mig_handles::code)?;
        put(currentMode, c_uint::from(cur))?;
        put(pendingMode, c_uint::from(pend))
    })
}

/// Applies at once on an idle GPU (a real A100 resets the GPU); on a busy
/// one the mode stays pending and `activationStatus` is IN_USE.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activationStatus: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if activationStatus.is_null()
            || !(mode == NVML_DEVICE_MIG_DISABLE || mode == NVML_DEVICE_MIG_ENABLE)
        {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let status = match c.state.set_mig_mode(s, mode == NVML_DEVICE_MIG_ENABLE) {
            Ok(Activation::Applied) => NVML_SUCCESS,
            Ok(Activation::PendingInUse) => NVML_ERROR_IN_USE,
            Err(e) => return Err(mig_handles::code(e)),
        };
        put(activationStatus, status)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put(info, v1_info(by_index(c, s, profile)?)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| put_versioned(info, by_index(c, s, profile)?))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profileId: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let p = enabled(c, s)?.by_id(profileId);
        put_versioned(info, p.ok_or(NVML_ERROR_INVALID_ARGUMENT)?)
    })
}

/// Writes `items` to a caller's array and their number to `*count`. As
/// in nvml.h, `*count` is output only: the array must hold every instance
/// (or placement) the profile allows; NULL asks for the count.
pub(crate) fn put_list<T: Copy>(items: &[T], out: *mut T, count: *mut c_uint) -> R {
    put(count, items.len() as c_uint)?;
    if !out.is_null() {
        // SAFETY: the caller's array holds every item the profile allows,
        // which bounds `items`.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    }
    Ok(())
}

fn c_placement(p: Placement) -> nvmlGpuInstancePlacement_t {
    nvmlGpuInstancePlacement_t {
        start: p.start,
        size: p.size,
    }
}

/// Every placement of the profile, MIG enabled or not.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profileId: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let model = c.gpu(s).mig_model().ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        let p = model.by_id(profileId).ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        let all: Vec<_> = p.placements().map(c_placement).collect();
        put_list(&all, placements, count)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profileId: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        enabled(c, s)?;
        let n = c.state.gpu_instance_room(s, profileId);
        put(count, n.map_err(mig_handles::code)?)
    })
}

fn create(
    c: &Ctx,
    sim: usize,
    profile_id: c_uint,
    placement: Option<Placement>,
    out: *mut nvmlGpuInstance_t,
) -> R {
    if out.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    enabled(c, sim)?;
    let g = c
        .state
        .create_gpu_instance(sim, profile_id, placement)
        .map_err(|e| match e {
            MigError::UnknownProfile => NVML_ERROR_INVALID_ARGUMENT,
            e => mig_handles::code(e),
        })?;
    put(out, gi_handle(sim, g.id))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profileId: c_uint,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| create(c, s, profileId, None, gpuInstance))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profileId: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        if placement.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null pointer to the caller's placement.
        let p = unsafe { placement.read_unaligned() };
        let pl = Placement {
            start: p.start,
            size: p.size,
        };
        create(c, s, profileId, Some(pl), gpuInstance)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gpuInstance: nvmlGpuInstance_t) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let (sim, g) = c.gi(gpuInstance)?;
        c.state
            .destroy_gpu_instance(sim, g.id)
            .map_err(mig_handles::code)
    })
}

/// The GPU instances of a profile, as handles.
fn instances_of(c: &Ctx, sim: usize, profile_id: c_uint) -> Vec<nvmlGpuInstance_t> {
    c.state
        .gpu_instances(sim)
        .iter()
        .filter(|g: &&GpuInstance| g.profile.id == profile_id)
        .map(|g| gi_handle(sim, g.id))
        .collect()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profileId: c_uint,
    gpuInstances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        let model = enabled(c, s)?;
        model.by_id(profileId).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        if gpuInstances.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put_list(&instances_of(c, s, profileId), gpuInstances, count)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    with_dev(device, |c, s| {
        enabled(c, s)?;
        let g = c.state.gpu_instance(s, id).ok_or(NVML_ERROR_NOT_FOUND)?;
        put(gpuInstance, gi_handle(s, g.id))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpuInstance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let (sim, g) = c.gi(gpuInstance)?;
        put(
            info,
            nvmlGpuInstanceInfo_t {
                device: handle_of(sim),
                id: g.id,
                profileId: g.profile.id,
                placement: c_placement(g.placement),
            },
        )
    })
}
