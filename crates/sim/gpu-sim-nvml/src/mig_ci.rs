//! Compute instances within a GPU instance (nvml.h's nvmlMultiInstanceGPU
//! group): profiles (1c, 2c, 3c, 4c, 7c as the GI allows), placements,
//! create, list, destroy. `profile`/`profileId` are
//! NVML_COMPUTE_INSTANCE_PROFILE_* indices, which are also the ids.

use crate::mig::{nvmlGpuInstancePlacement_t as nvmlComputeInstancePlacement_t, put_list};
use crate::mig_handles::*;
use crate::*;
use gpu_sim_core::mig::{CI_PROFILE_COUNT, CiProfile, Placement};
use gpu_sim_core::state::MigError;
use std::ffi::c_uint;

/// NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 2 / 3).
const CI_PROFILE_INFO_V2: c_uint = 0x88 | (2 << 24);
const CI_PROFILE_INFO_V3: c_uint = 0x8C | (3 << 24);
/// NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT (only SHARED, 0, exists).
const ENGINE_PROFILE_COUNT: c_uint = 1;

#[repr(C)]
pub struct nvmlComputeInstanceProfileInfo_t {
    id: c_uint,
    sliceCount: c_uint,
    instanceCount: c_uint,
    multiprocessorCount: c_uint,
    sharedCopyEngineCount: c_uint,
    sharedDecoderCount: c_uint,
    sharedEncoderCount: c_uint,
    sharedJpegCount: c_uint,
    sharedOfaCount: c_uint,
}

/// v2 (`name` added) and v3 (`capabilities` after it): one struct, v2
/// callers get the bytes before `capabilities`.
#[repr(C)]
pub struct nvmlComputeInstanceProfileInfo_v3_t {
    version: c_uint,
    head: nvmlComputeInstanceProfileInfo_t,
    name: [c_char; 96],
    capabilities: c_uint,
}

/// nvmlComputeInstanceInfo_t; `nvmlComputeInstanceGetInfo` (v1) callers
/// have the struct without `placement`.
#[repr(C)]
pub struct nvmlComputeInstanceInfo_t {
    device: nvmlDevice_t,
    gpuInstance: nvmlGpuInstance_t,
    id: c_uint,
    profileId: c_uint,
    placement: nvmlComputeInstancePlacement_t,
}

const _: () = assert!(std::mem::size_of::<nvmlComputeInstanceProfileInfo_t>() == 36);
const _: () =
    assert!(std::mem::offset_of!(nvmlComputeInstanceProfileInfo_v3_t, capabilities) == 0x88);
const _: () = assert!(std::mem::size_of::<nvmlComputeInstanceProfileInfo_v3_t>() == 0x8C);
const _: () = assert!(std::mem::size_of::<nvmlComputeInstanceInfo_t>() == 32);
const _: () = assert!(std::mem::offset_of!(nvmlComputeInstanceInfo_t, placement) == 24);

fn v1_info(p: &CiProfile) -> nvmlComputeInstanceProfileInfo_t {
    let gi = p.gi;
    nvmlComputeInstanceProfileInfo_t {
        id: p.index,
        sliceCount: p.slices,
        instanceCount: p.instances(),
        multiprocessorCount: p.sms(),
        // The engines are the GI's, shared by its compute instances.
        sharedCopyEngineCount: gi.copy_engines,
        sharedDecoderCount: gi.decoders,
        sharedEncoderCount: gi.encoders,
        sharedJpegCount: gi.jpegs,
        sharedOfaCount: gi.ofas,
    }
}

/// The CI profile at an NVML_COMPUTE_INSTANCE_PROFILE_* index in the GI.
fn profile(c: &Ctx, h: nvmlGpuInstance_t, index: c_uint) -> Result<(usize, u32, CiProfile), R> {
    let (sim, g) = c.gi(h).map_err(Err)?;
    if index >= CI_PROFILE_COUNT {
        return Err(Err(NVML_ERROR_INVALID_ARGUMENT));
    }
    let p = g
        .profile
        .ci_profile(index)
        .ok_or(Err(NVML_ERROR_NOT_SUPPORTED))?;
    Ok((sim, g.id, p))
}

/// Runs `f` on the GI's CI profile `index`.
fn with_profile(
    h: nvmlGpuInstance_t,
    index: c_uint,
    f: impl FnOnce(&Ctx, usize, u32, CiProfile) -> R,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        match profile(&c, h, index) {
            Ok((sim, gi, p)) => f(&c, sim, gi, p),
            Err(e) => e,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpuInstance: nvmlGpuInstance_t,
    profile: c_uint,
    engProfile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    with_profile(gpuInstance, profile, |_, _, _, p| {
        if engProfile >= ENGINE_PROFILE_COUNT {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put(info, v1_info(&p))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpuInstance: nvmlGpuInstance_t,
    profile: c_uint,
    engProfile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v3_t,
) -> nvmlReturn_t {
    with_profile(gpuInstance, profile, |_, _, _, p| {
        if engProfile >= ENGINE_PROFILE_COUNT || info.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null pointer to the caller's struct, whose first
        // field is its c_uint version.
        let version = unsafe { *info.cast::<c_uint>() };
        let full = nvmlComputeInstanceProfileInfo_v3_t {
            version,
            head: v1_info(&p),
            name: c_field(&format!("MIG {}", p.device_name())),
            capabilities: 0,
        };
        let len = match version {
            CI_PROFILE_INFO_V2 => 0x88,
            CI_PROFILE_INFO_V3 => 0x8C,
            _ => return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH),
        };
        // SAFETY: the caller's struct is `len` bytes long (its version
        // says which); `full` is at least that long.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&full as *const nvmlComputeInstanceProfileInfo_v3_t).cast::<u8>(),
                info.cast::<u8>(),
                len,
            )
        };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_profile(gpuInstance, profileId, |c, sim, gi, p| {
        let n = c.state.compute_instance_room(sim, gi, p.index);
        put(count, n.map_err(code)?)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    placements: *mut nvmlComputeInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_profile(gpuInstance, profileId, |_, _, _, p| {
        let all: Vec<_> = p
            .placements()
            .into_iter()
            .map(|pl| nvmlComputeInstancePlacement_t {
                start: pl.start,
                size: pl.size,
            })
            .collect();
        put_list(&all, placements, count)
    })
}

fn create(
    c: &Ctx,
    (sim, gi, p): (usize, u32, CiProfile),
    placement: Option<Placement>,
    out: *mut nvmlComputeInstance_t,
) -> R {
    if out.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let ci = c
        .state
        .create_compute_instance(sim, gi, p.index, placement)
        .map_err(|e| match e {
            MigError::NotFound => NVML_ERROR_INVALID_ARGUMENT,
            e => code(e),
        })?;
    put(out, ci_handle(sim, gi, ci.id))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    computeInstance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    with_profile(gpuInstance, profileId, |c, sim, gi, p| {
        create(c, (sim, gi, p), None, computeInstance)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    placement: *const nvmlComputeInstancePlacement_t,
    computeInstance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    with_profile(gpuInstance, profileId, |c, sim, gi, p| {
        if placement.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null pointer to the caller's placement.
        let pl = unsafe { placement.read_unaligned() };
        let pl = Placement {
            start: pl.start,
            size: pl.size,
        };
        create(c, (sim, gi, p), Some(pl), computeInstance)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(
    computeInstance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let (sim, g, ci) = c.ci(computeInstance)?;
        c.state
            .destroy_compute_instance(sim, g.id, ci.id)
            .map_err(code)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    computeInstances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_profile(gpuInstance, profileId, |c, sim, gi, p| {
        if computeInstances.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let all: Vec<_> = c
            .state
            .compute_instances(sim, gi)
            .map_err(code)?
            .iter()
            .filter(|ci| ci.profile.index == p.index)
            .map(|ci| ci_handle(sim, gi, ci.id))
            .collect();
        put_list(&all, computeInstances, count)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpuInstance: nvmlGpuInstance_t,
    id: c_uint,
    computeInstance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        let (sim, g) = c.gi(gpuInstance)?;
        let cis = c.state.compute_instances(sim, g.id).map_err(code)?;
        let ci = cis.iter().find(|ci| ci.id == id);
        let ci = ci.ok_or(NVML_ERROR_NOT_FOUND)?;
        put(computeInstance, ci_handle(sim, g.id, ci.id))
    })
}

fn info_of(h: nvmlComputeInstance_t) -> Result<nvmlComputeInstanceInfo_t, nvmlReturn_t> {
    let c = ctx()?;
    let (sim, g, ci) = c.ci(h)?;
    Ok(nvmlComputeInstanceInfo_t {
        device: handle_of(sim),
        gpuInstance: gi_handle(sim, g.id),
        id: ci.id,
        profileId: ci.profile.index,
        placement: nvmlComputeInstancePlacement_t {
            start: ci.placement.start,
            size: ci.placement.size,
        },
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    computeInstance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    ffi(|| put(info, info_of(computeInstance)?))
}

/// The first version: the struct without `placement`.
#[repr(C)]
struct nvmlComputeInstanceInfo_v1_t {
    device: nvmlDevice_t,
    gpuInstance: nvmlGpuInstance_t,
    id: c_uint,
    profileId: c_uint,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo(
    computeInstance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let i = info_of(computeInstance)?;
        let head = nvmlComputeInstanceInfo_v1_t {
            device: i.device,
            gpuInstance: i.gpuInstance,
            id: i.id,
            profileId: i.profileId,
        };
        put(info.cast::<nvmlComputeInstanceInfo_v1_t>(), head)
    })
}
