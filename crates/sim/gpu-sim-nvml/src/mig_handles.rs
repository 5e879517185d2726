//! MIG handles: `nvmlGpuInstance_t`, `nvmlComputeInstance_t` and MIG
//! `nvmlDevice_t`s point at static slots, one per (GPU, GPU-instance id,
//! compute-instance id), so a handle is the same in every call and names
//! its instance by position; each use checks the instance still exists in
//! the shared state (a destroyed instance's handle is INVALID_ARGUMENT).

use crate::*;
use gpu_sim_core::mig::{MAX_CIS, MAX_GI_IDS};
use gpu_sim_core::state::{ComputeInstance, GpuInstance, MigError};

#[repr(C)]
pub struct GiSlot {
    _opaque: u64,
}

#[repr(C)]
pub struct CiSlot {
    _opaque: u64,
}

pub type nvmlGpuInstance_t = *const GiSlot;
pub type nvmlComputeInstance_t = *const CiSlot;

const GI_SLOTS: usize = MAX_GPUS * MAX_GI_IDS;
const CI_SLOTS: usize = GI_SLOTS * MAX_CIS;

static GIS: [GiSlot; GI_SLOTS] = [const { GiSlot { _opaque: 0 } }; GI_SLOTS];
static CIS: [CiSlot; CI_SLOTS] = [const { CiSlot { _opaque: 0 } }; CI_SLOTS];
/// MIG devices: `nvmlDevice_t`s too, told apart from whole GPUs by address.
static MIGS: [DeviceSlot; CI_SLOTS] = [const { DeviceSlot { _opaque: 0 } }; CI_SLOTS];

/// Index of `p` in `slots`, if it points at one of them.
fn slot_index<T>(slots: &[T], p: *const T) -> Option<usize> {
    let off = (p as usize).wrapping_sub(slots.as_ptr() as usize);
    let size = std::mem::size_of::<T>();
    let i = off / size;
    (i < slots.len() && i * size == off).then_some(i)
}

fn ci_slot(sim: usize, gi: u32, ci: u32) -> usize {
    (sim * MAX_GI_IDS + gi as usize) * MAX_CIS + ci as usize
}

fn split_ci_slot(i: usize) -> (usize, u32, u32) {
    let ci = (i % MAX_CIS) as u32;
    let gi = i / MAX_CIS;
    (gi / MAX_GI_IDS, (gi % MAX_GI_IDS) as u32, ci)
}

pub fn gi_handle(sim: usize, gi: u32) -> nvmlGpuInstance_t {
    &GIS[sim * MAX_GI_IDS + gi as usize]
}

pub fn ci_handle(sim: usize, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    &CIS[ci_slot(sim, gi, ci)]
}

pub fn mig_handle(sim: usize, gi: u32, ci: u32) -> nvmlDevice_t {
    &MIGS[ci_slot(sim, gi, ci)]
}

/// A live compute instance: its GPU, GPU instance and itself.
pub type Mig = (usize, GpuInstance, ComputeInstance);

/// NVML's code for a refused MIG operation.
pub fn code(e: MigError) -> nvmlReturn_t {
    match e {
        MigError::NotCapable | MigError::Disabled | MigError::UnknownProfile => {
            NVML_ERROR_NOT_SUPPORTED
        }
        MigError::BadPlacement => NVML_ERROR_INVALID_ARGUMENT,
        MigError::NoRoom => NVML_ERROR_INSUFFICIENT_RESOURCES,
        MigError::InUse => NVML_ERROR_IN_USE,
        MigError::NotFound => NVML_ERROR_NOT_FOUND,
    }
}

impl Ctx {
    /// The GPU and the live GPU instance of a handle.
    pub fn gi(&self, h: nvmlGpuInstance_t) -> Result<(usize, GpuInstance), nvmlReturn_t> {
        let i = slot_index(&GIS, h).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let (sim, id) = (i / MAX_GI_IDS, (i % MAX_GI_IDS) as u32);
        if !self.visible.contains(&sim) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let g = self.state.gpu_instance(sim, id);
        Ok((sim, g.ok_or(NVML_ERROR_INVALID_ARGUMENT)?))
    }

    fn live(&self, (sim, gi, ci): (usize, u32, u32)) -> Result<Mig, nvmlReturn_t> {
        if !self.visible.contains(&sim) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let g = self
            .state
            .gpu_instance(sim, gi)
            .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let cis = self.state.compute_instances(sim, gi).map_err(code)?;
        let c = cis.into_iter().find(|c| c.id == ci);
        Ok((sim, g, c.ok_or(NVML_ERROR_INVALID_ARGUMENT)?))
    }

    /// The live compute instance of a handle.
    pub fn ci(&self, h: nvmlComputeInstance_t) -> Result<Mig, nvmlReturn_t> {
        let i = slot_index(&CIS, h).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        self.live(split_ci_slot(i))
    }

    /// `None` when `h` is not a MIG device handle; else its live compute
    /// instance (INVALID_ARGUMENT once destroyed).
    pub fn mig_dev(&self, h: nvmlDevice_t) -> Option<Result<Mig, nvmlReturn_t>> {
        let i = slot_index(&MIGS, h)?;
        Some(self.live(split_ci_slot(i)))
    }
}

/// Runs `gpu` for a whole-GPU handle, `mig` for a MIG device handle.
pub fn with_dev_or_mig(
    device: nvmlDevice_t,
    gpu: impl FnOnce(&Ctx, usize) -> R,
    mig: impl FnOnce(&Ctx, Mig) -> R,
) -> nvmlReturn_t {
    ffi(|| {
        let c = ctx()?;
        match c.mig_dev(device) {
            Some(m) => mig(&c, m?),
            None => {
                let sim = c.dev(device)?;
                gpu(&c, sim)
            }
        }
    })
}

/// MIG UUIDs are the core's, so the simulated CUDA names them alike.
pub use gpu_sim_core::mig::mig_uuid;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip() {
        let h = mig_handle(3, 14, 6);
        let i = slot_index(&MIGS, h).unwrap();
        assert_eq!(split_ci_slot(i), (3, 14, 6));
        assert_eq!(slot_index(&MIGS, handle_of(0)), None);
        let g = gi_handle(2, 9);
        assert_eq!(slot_index(&GIS, g), Some(2 * MAX_GI_IDS + 9));
    }
}
