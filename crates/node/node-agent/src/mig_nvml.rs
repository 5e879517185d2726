//! [`MigDriver`] over NVML: nvml-wrapper 0.13 reads MIG mode, profiles
//! and placements; creating, listing and destroying GPU and compute
//! instances go through its raw symbol table (the calls nvidia-smi's `mig
//! -cgi … -C` and `-dci`/`-dgi` make, nvml.h's MIG section).

use std::ffi::CStr;
use std::mem;

use gpu_allocator::mig::Slices;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT, NVML_GPU_INSTANCE_PROFILE_COUNT, nvmlComputeInstance_t,
    nvmlComputeInstanceProfileInfo_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t,
};

use crate::geometry::{GiProfile, GiState, MigDriver};
use crate::mig::MigGpu;

/// The engine profile of compute instances that share their GPU
/// instance's engines (`NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`).
const ENGINE_SHARED: u32 = 0;
/// Room for the instances of one profile (a GPU has at most 8 slices).
const MAX_INSTANCES: usize = 16;

/// The node's GPUs (discovery's handles, by index).
pub struct NvmlMig<'a> {
    pub nvml: &'a Nvml,
    pub devices: &'a [Device<'a>],
}

impl NvmlMig<'_> {
    fn dev(&self, gpu: usize) -> Result<&Device<'_>, NvmlError> {
        self.devices.get(gpu).ok_or(NvmlError::InvalidArg)
    }

    /// Every GPU instance of `gpu`, with its handle.
    fn gpu_instances(
        &self,
        gpu: usize,
    ) -> Result<Vec<(nvmlGpuInstance_t, nvmlGpuInstanceInfo_t)>, NvmlError> {
        let lib = self.nvml.lib();
        let list = nvml_sym(lib.nvmlDeviceGetGpuInstances.as_ref())?;
        let info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
        let d = self.dev(gpu)?;
        let mut out = Vec::new();
        for p in self.profiles(gpu)? {
            let mut handles: [nvmlGpuInstance_t; MAX_INSTANCES] =
                [std::ptr::null_mut(); MAX_INSTANCES];
            let mut count = MAX_INSTANCES as u32;
            // SAFETY: `d` is a live handle of `self.nvml`; `handles` has
            // room for `count` handles, which the call writes at most.
            nvml_try(unsafe { list(d.handle(), p.id, handles.as_mut_ptr(), &mut count) })?;
            for h in handles.into_iter().take(count as usize) {
                // SAFETY: zeroed is a valid nvmlGpuInstanceInfo_t (plain
                // integers and a pointer); `h` came from the list call.
                let mut i: nvmlGpuInstanceInfo_t = unsafe { mem::zeroed() };
                // SAFETY: as above; `i` is the struct the call fills.
                nvml_try(unsafe { info(h, &mut i) })?;
                out.push((h, i));
            }
        }
        Ok(out)
    }

    /// The compute-instance profile as large as `gi`'s GPU instance: the
    /// largest it offers (compute slices, which a GPU instance's memory
    /// placement does not give: a 3g.40gb takes four memory slices).
    fn full_ci_profile(&self, gi: nvmlGpuInstance_t) -> Result<u32, NvmlError> {
        let sym = nvml_sym(
            self.nvml
                .lib()
                .nvmlGpuInstanceGetComputeInstanceProfileInfo
                .as_ref(),
        )?;
        let mut best: Option<(u32, u32)> = None;
        for p in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            // SAFETY: zeroed is a valid profile info (plain integers).
            let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { mem::zeroed() };
            // SAFETY: `gi` is a live GPU-instance handle; `info` is filled.
            match nvml_try(unsafe { sym(gi, p, ENGINE_SHARED, &mut info) }) {
                Ok(()) if best.is_none_or(|(slices, _)| info.sliceCount > slices) => {
                    best = Some((info.sliceCount, info.id));
                }
                Ok(()) | Err(NvmlError::NotSupported) | Err(NvmlError::InvalidArg) => {}
                Err(e) => return Err(e),
            }
        }
        best.map(|(_, id)| id).ok_or(NvmlError::NotFound)
    }
}

/// The version word of nvmlGpuInstanceProfileInfo_v2 (nvml.h's
/// NVML_STRUCT_VERSION: the struct's size, version in the top byte).
fn gi_profile_info_v2() -> u32 {
    mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32 | (2 << 24)
}

impl MigDriver for NvmlMig<'_> {
    fn mode(&self, gpu: usize) -> Result<(bool, bool), NvmlError> {
        let m = self.dev(gpu)?.mig_mode()?;
        Ok((m.current == 1, m.pending == 1))
    }

    fn set_mode(&self, gpu: usize, on: bool) -> Result<(), NvmlError> {
        self.dev(gpu)?.set_mig_mode(on).map(|_| ())
    }

    fn profiles(&self, gpu: usize) -> Result<Vec<GiProfile>, NvmlError> {
        let d = self.dev(gpu)?;
        let sym = nvml_sym(
            self.nvml
                .lib()
                .nvmlDeviceGetGpuInstanceProfileInfoV
                .as_ref(),
        )?;
        let mut out = Vec::new();
        for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            // SAFETY: zeroed is a valid v2 info (integers, a char array).
            let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { mem::zeroed() };
            info.version = gi_profile_info_v2();
            // SAFETY: `d` is a live handle; `info` is the versioned struct.
            match nvml_try(unsafe { sym(d.handle(), index, &mut info) }) {
                Ok(()) => {}
                // Profiles this GPU does not offer.
                Err(NvmlError::NotSupported) | Err(NvmlError::InvalidArg) => continue,
                Err(e) => return Err(e),
            }
            // SAFETY: the driver writes a NUL-terminated name into the
            // array (zeroed before, so a NUL is there whatever it wrote).
            let name = unsafe { CStr::from_ptr(info.name.as_ptr()) }.to_string_lossy();
            let placements = self.placements(d, info.id)?;
            out.push(GiProfile {
                id: info.id,
                name: name.trim_start_matches("MIG ").to_string(),
                placements,
            });
        }
        Ok(out)
    }

    fn instances(&self, gpu: usize) -> Result<Vec<GiState>, NvmlError> {
        let d = self.dev(gpu)?;
        let busy: Vec<u32> = d
            .running_compute_processes()?
            .into_iter()
            .filter_map(|p| p.gpu_instance_id)
            .collect();
        let mig: MigGpu = crate::mig::read(self.nvml, std::slice::from_ref(d))
            .map_err(|e| e.source)?
            .pop()
            .unwrap_or_default();
        Ok(self
            .gpu_instances(gpu)?
            .into_iter()
            .map(|(_, i)| GiState {
                id: i.id,
                profile: i.profileId,
                slices: Slices {
                    start: i.placement.start,
                    size: i.placement.size,
                },
                uuids: mig
                    .devices
                    .iter()
                    .filter(|m| m.gpu_instance == i.id)
                    .map(|m| m.uuid.clone())
                    .collect(),
                busy: busy.contains(&i.id),
            })
            .collect())
    }

    fn create(&self, gpu: usize, profile: u32, slices: Slices) -> Result<u32, NvmlError> {
        let lib = self.nvml.lib();
        let create_gi = nvml_sym(lib.nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?;
        let create_ci = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())?;
        let info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
        let d = self.dev(gpu)?;
        let placement = nvmlGpuInstancePlacement_t {
            start: slices.start,
            size: slices.size,
        };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a live device handle, a placement and a place for the
        // handle the call writes.
        nvml_try(unsafe { create_gi(d.handle(), profile, &placement, &mut gi) })?;
        // SAFETY: zeroed is a valid info; `gi` was just created.
        let mut i: nvmlGpuInstanceInfo_t = unsafe { mem::zeroed() };
        // SAFETY: as above.
        nvml_try(unsafe { info(gi, &mut i) })?;
        let made = self.full_ci_profile(gi).and_then(|ci_profile| {
            let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
            // SAFETY: a live GPU-instance handle, a place for the handle.
            nvml_try(unsafe { create_ci(gi, ci_profile, &mut ci) })
        });
        if let Err(e) = made {
            // No half-made instance left behind.
            let destroy = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?;
            // SAFETY: `gi` was created above and holds no compute instance.
            let _ = unsafe { destroy(gi) };
            return Err(e);
        }
        Ok(i.id)
    }

    fn destroy(&self, gpu: usize, gi_id: u32) -> Result<(), NvmlError> {
        let lib = self.nvml.lib();
        let list_ci = nvml_sym(lib.nvmlGpuInstanceGetComputeInstances.as_ref())?;
        let destroy_ci = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref())?;
        let destroy_gi = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?;
        let (gi, _) = self
            .gpu_instances(gpu)?
            .into_iter()
            .find(|(_, i)| i.id == gi_id)
            .ok_or(NvmlError::NotFound)?;
        for p in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            let mut cis: [nvmlComputeInstance_t; MAX_INSTANCES] =
                [std::ptr::null_mut(); MAX_INSTANCES];
            let mut count = MAX_INSTANCES as u32;
            let ci_profile = match self.ci_profile_id(gi, p) {
                Some(id) => id,
                None => continue,
            };
            // SAFETY: a live GPU-instance handle; room for `count` handles.
            nvml_try(unsafe { list_ci(gi, ci_profile, cis.as_mut_ptr(), &mut count) })?;
            for ci in cis.into_iter().take(count as usize) {
                // SAFETY: a compute-instance handle the list call gave.
                nvml_try(unsafe { destroy_ci(ci) })?;
            }
        }
        // SAFETY: a live GPU-instance handle with no compute instance left.
        nvml_try(unsafe { destroy_gi(gi) })
    }
}

impl NvmlMig<'_> {
    /// Where a GPU instance of `profile` may go. Called directly:
    /// nvml-wrapper 0.13's `possible_placements` fills a vector whose
    /// length it never sets, so it always answers none.
    fn placements(&self, d: &Device<'_>, profile: u32) -> Result<Vec<Slices>, NvmlError> {
        let sym = nvml_sym(
            self.nvml
                .lib()
                .nvmlDeviceGetGpuInstancePossiblePlacements_v2
                .as_ref(),
        )?;
        let mut all = [nvmlGpuInstancePlacement_t { start: 0, size: 0 }; MAX_INSTANCES];
        let mut count = MAX_INSTANCES as u32;
        // SAFETY: a live device handle; room for `count` placements, which
        // the call writes at most (and sets `count` to what it wrote).
        nvml_try(unsafe { sym(d.handle(), profile, all.as_mut_ptr(), &mut count) })?;
        Ok(all
            .iter()
            .take(count as usize)
            .map(|p| Slices {
                start: p.start,
                size: p.size,
            })
            .collect())
    }

    /// The id of compute-instance profile index `p` on `gi`, if offered.
    fn ci_profile_id(&self, gi: nvmlGpuInstance_t, p: u32) -> Option<u32> {
        let sym = nvml_sym(
            self.nvml
                .lib()
                .nvmlGpuInstanceGetComputeInstanceProfileInfo
                .as_ref(),
        )
        .ok()?;
        // SAFETY: zeroed is a valid profile info (plain integers).
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { mem::zeroed() };
        // SAFETY: a live GPU-instance handle; `info` is filled.
        nvml_try(unsafe { sym(gi, p, ENGINE_SHARED, &mut info) }).ok()?;
        Some(info.id)
    }
}
