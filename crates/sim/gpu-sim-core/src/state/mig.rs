//! MIG state of the node: per GPU its mode (current, pending) and its GPU
//! and compute instances, shared by every process like the rest of the
//! state (layout: `layout::MigBlock`).
//!
//! Each GPU instance is one atomic word holding its profile and its compute
//! instances, so creating a compute instance and destroying its GPU
//! instance race safely (compare-and-swap on the same word). Creating and
//! destroying GPU instances and changing the mode also take a per-GPU OFD
//! lock on `procs.lock` (byte `MIG_LOCK_BASE + gpu`), which the kernel drops
//! if the holder dies, so two processes never place overlapping instances.
//!
//! Mode changes take effect at once when the GPU is idle: no process holds
//! a context or memory on it and, to disable, no GPU instance is left. A
//! real A100 needs a GPU reset for that; the sim models the reset as
//! immediate. Otherwise the change stays pending and the activation status
//! is "in use", as NVML reports it.

use super::{SharedState, mig_caps};
use crate::mig::{self, CiProfile, GiProfile, MAX_CIS, MAX_GI_IDS, Placement};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::sync::atomic::Ordering::*;
use thiserror::Error;

/// First byte of `procs.lock` locked for a GPU's MIG changes (past the
/// process slots' bytes).
const MIG_LOCK_BASE: i64 = 1 << 20;

/// OFD locks do not exclude threads sharing one description: this does.
static LOCAL: Mutex<()> = Mutex::new(());

/// Why a MIG operation was refused (the NVML layer maps these to codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum MigError {
    #[error("the GPU is not MIG-capable")]
    NotCapable,
    #[error("MIG mode is disabled")]
    Disabled,
    #[error("no such profile")]
    UnknownProfile,
    #[error("not a placement of this profile")]
    BadPlacement,
    #[error("no room: the placement is occupied or the profile's instances are used up")]
    NoRoom,
    #[error("in use")]
    InUse,
    #[error("no such instance")]
    NotFound,
}

/// Outcome of a mode change: applied, or left pending because the GPU is
/// busy (NVML's `activationStatus` NVML_ERROR_IN_USE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Applied,
    PendingInUse,
}

/// A GPU instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuInstance {
    pub id: u32,
    pub profile: &'static GiProfile,
    pub placement: Placement,
}

/// A compute instance within a GPU instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeInstance {
    pub id: u32,
    pub profile: CiProfile,
    pub placement: Placement,
}

/// Byte `k + 1` of a GI word: compute instance `k`.
fn ci_byte(word: u64, k: usize) -> u8 {
    (word >> (8 * (k + 1))) as u8
}

fn decode_gi(model: &'static mig::MigModel, id: usize, word: u64) -> Option<GpuInstance> {
    let index = (word & 0xff).checked_sub(1)? as u32;
    Some(GpuInstance {
        id: id as u32,
        profile: model.by_index(index)?,
        placement: mig::placement_of_gi_id(id as u32)?,
    })
}

fn decode_cis(gi: &GpuInstance, word: u64) -> Vec<ComputeInstance> {
    (0..MAX_CIS)
        .filter_map(|k| {
            let b = ci_byte(word, k);
            let profile = gi.profile.ci_profile(u32::from(b & 0xf).checked_sub(1)?)?;
            Some(ComputeInstance {
                id: k as u32,
                profile,
                placement: Placement {
                    start: u32::from(b >> 4),
                    size: profile.slices,
                },
            })
        })
        .collect()
}

impl SharedState {
    fn mig_model(&self, gpu: usize) -> Result<&'static mig::MigModel, MigError> {
        self.node.gpus[gpu].mig_model().ok_or(MigError::NotCapable)
    }

    /// Runs `f` holding the GPU's MIG lock (in this process and across).
    fn with_mig_lock<T>(&self, gpu: usize, f: impl FnOnce() -> T) -> T {
        let _local = LOCAL.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: flock is plain integers: all-zero is a valid value.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = (MIG_LOCK_BASE + gpu as i64) as libc::off_t;
        fl.l_len = 1;
        // SAFETY: valid fd and flock struct; blocks until the byte is ours
        // (its holder dying releases it). A failure leaves only the local
        // lock, which still orders this process's callers.
        unsafe { libc::fcntl(self.lock.as_raw_fd(), libc::F_OFD_SETLKW, &mut fl) };
        let out = f();
        fl.l_type = libc::F_UNLCK as libc::c_short;
        // SAFETY: as above; releases the byte.
        unsafe { libc::fcntl(self.lock.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
        out
    }

    /// (current, pending) MIG mode, `true` = enabled; `NotCapable` for a
    /// GPU without MIG.
    pub fn mig_mode(&self, gpu: usize) -> Result<(bool, bool), MigError> {
        self.mig_model(gpu)?;
        let m = self.mig_block(gpu).mode.load(Acquire);
        Ok((m & 1 != 0, m & 2 != 0))
    }

    /// Asks for MIG mode `enable`; applied at once when the GPU is idle.
    pub fn set_mig_mode(&self, gpu: usize, enable: bool) -> Result<Activation, MigError> {
        self.mig_model(gpu)?;
        self.with_mig_lock(gpu, || {
            let block = self.mig_block(gpu);
            let current = block.mode.load(Acquire) & 1 != 0;
            let pending = u64::from(enable) << 1;
            let busy = !self.processes(gpu).is_empty()
                || (!enable && block.gis.iter().any(|w| w.load(Acquire) != 0));
            if busy && current != enable {
                block.mode.store(u64::from(current) | pending, Release);
                return Ok(Activation::PendingInUse);
            }
            block.mode.store(u64::from(enable) | pending, Release);
            Ok(Activation::Applied)
        })
    }

    /// The model, when MIG is enabled on `gpu`.
    fn mig_enabled(&self, gpu: usize) -> Result<&'static mig::MigModel, MigError> {
        let model = self.mig_model(gpu)?;
        if self.mig_block(gpu).mode.load(Acquire) & 1 == 0 {
            return Err(MigError::Disabled);
        }
        Ok(model)
    }

    /// The GPU instances of `gpu`, by id.
    pub fn gpu_instances(&self, gpu: usize) -> Vec<GpuInstance> {
        let Ok(model) = self.mig_enabled(gpu) else {
            return Vec::new();
        };
        let block = self.mig_block(gpu);
        (0..MAX_GI_IDS)
            .filter_map(|id| decode_gi(model, id, block.gis[id].load(Acquire)))
            .collect()
    }

    pub fn gpu_instance(&self, gpu: usize, id: u32) -> Option<GpuInstance> {
        self.gpu_instances(gpu).into_iter().find(|g| g.id == id)
    }

    /// Memory slices the GPU instances of `gpu` occupy (bit i = slice i).
    fn used_slices(&self, gpu: usize) -> u32 {
        self.gpu_instances(gpu)
            .iter()
            .fold(0, |m, g| m | g.placement.mask())
    }

    /// How many more instances of the profile with driver id `profile_id`
    /// fit on `gpu`.
    pub fn gpu_instance_room(&self, gpu: usize, profile_id: u32) -> Result<u32, MigError> {
        let model = self.mig_enabled(gpu)?;
        let p = model.by_id(profile_id).ok_or(MigError::UnknownProfile)?;
        let existing = self.gpu_instances(gpu);
        let same = existing.iter().filter(|g| g.profile.id == p.id).count() as u32;
        Ok(p.remaining(self.used_slices(gpu), same))
    }

    /// Creates a GPU instance of driver profile id `profile_id`, at
    /// `placement` or the first free one of the profile.
    pub fn create_gpu_instance(
        &self,
        gpu: usize,
        profile_id: u32,
        placement: Option<Placement>,
    ) -> Result<GpuInstance, MigError> {
        let model = self.mig_enabled(gpu)?;
        let p = model.by_id(profile_id).ok_or(MigError::UnknownProfile)?;
        if placement.is_some_and(|pl| !p.allows(pl)) {
            return Err(MigError::BadPlacement);
        }
        self.with_mig_lock(gpu, || {
            if self.gpu_instance_room(gpu, profile_id)? == 0 {
                return Err(MigError::NoRoom);
            }
            let used = self.used_slices(gpu);
            let pl = match placement {
                Some(pl) if pl.mask() & used != 0 => return Err(MigError::NoRoom),
                Some(pl) => pl,
                None => p.first_free(used).ok_or(MigError::NoRoom)?,
            };
            let id = mig::gi_id_of(pl);
            self.mig_block(gpu).gis[id as usize].store(u64::from(p.index) + 1, Release);
            mig_caps::publish_gi(&self.root, self.node.gpus[gpu].minor, id, true);
            Ok(GpuInstance {
                id,
                profile: p,
                placement: pl,
            })
        })
    }

    /// Destroys GPU instance `id`; `InUse` while it has compute instances.
    pub fn destroy_gpu_instance(&self, gpu: usize, id: u32) -> Result<(), MigError> {
        let gi = self.gpu_instance(gpu, id).ok_or(MigError::NotFound)?;
        self.with_mig_lock(gpu, || {
            let word = &self.mig_block(gpu).gis[gi.id as usize];
            let bare = u64::from(gi.profile.index) + 1;
            match word.compare_exchange(bare, 0, AcqRel, Acquire) {
                Ok(_) => {
                    mig_caps::publish_gi(&self.root, self.node.gpus[gpu].minor, gi.id, false);
                    Ok(())
                }
                Err(0) => Err(MigError::NotFound),
                Err(_) => Err(MigError::InUse),
            }
        })
    }

    /// The compute instances of GPU instance `gi`, by id.
    pub fn compute_instances(&self, gpu: usize, gi: u32) -> Result<Vec<ComputeInstance>, MigError> {
        let g = self.gpu_instance(gpu, gi).ok_or(MigError::NotFound)?;
        let word = self.mig_block(gpu).gis[gi as usize].load(Acquire);
        Ok(decode_cis(&g, word))
    }

    /// How many more compute instances of CI profile `index` fit in `gi`.
    pub fn compute_instance_room(&self, gpu: usize, gi: u32, index: u32) -> Result<u32, MigError> {
        let g = self.gpu_instance(gpu, gi).ok_or(MigError::NotFound)?;
        let cp = g
            .profile
            .ci_profile(index)
            .ok_or(MigError::UnknownProfile)?;
        let cis = self.compute_instances(gpu, gi)?;
        let used = cis.iter().fold(0, |m, c| m | c.placement.mask());
        let free = cp
            .placements()
            .iter()
            .filter(|p| p.mask() & used == 0)
            .count();
        Ok(free as u32)
    }

    /// Creates a compute instance of CI profile `index` in GPU instance
    /// `gi`, at `placement` or the first free one; its id is the lowest free.
    pub fn create_compute_instance(
        &self,
        gpu: usize,
        gi: u32,
        index: u32,
        placement: Option<Placement>,
    ) -> Result<ComputeInstance, MigError> {
        let g = self.gpu_instance(gpu, gi).ok_or(MigError::NotFound)?;
        let cp = g
            .profile
            .ci_profile(index)
            .ok_or(MigError::UnknownProfile)?;
        let allowed = cp.placements();
        if placement.is_some_and(|pl| !allowed.contains(&pl)) {
            return Err(MigError::BadPlacement);
        }
        let word = &self.mig_block(gpu).gis[gi as usize];
        let mut made = None;
        word.fetch_update(AcqRel, Acquire, |w| {
            if w & 0xff != u64::from(g.profile.index) + 1 {
                return None; // destroyed (or replaced) meanwhile
            }
            let used = decode_cis(&g, w)
                .iter()
                .fold(0, |m, c| m | c.placement.mask());
            let pl = match placement {
                Some(pl) => Some(pl).filter(|pl| pl.mask() & used == 0)?,
                None => *allowed.iter().find(|p| p.mask() & used == 0)?,
            };
            let k = (0..MAX_CIS).find(|&k| ci_byte(w, k) == 0)?;
            let b = (u64::from(pl.start) << 4) | (u64::from(cp.index) + 1);
            made = Some(ComputeInstance {
                id: k as u32,
                profile: cp,
                placement: pl,
            });
            Some(w | b << (8 * (k + 1)))
        })
        .map_err(|w| {
            if w == 0 {
                MigError::NotFound
            } else {
                MigError::NoRoom
            }
        })?;
        let made = made.ok_or(MigError::NoRoom)?;
        let minor = self.node.gpus[gpu].minor;
        mig_caps::publish_ci(&self.root, minor, gi, made.id, true);
        Ok(made)
    }

    /// Destroys compute instance `ci` of GPU instance `gi`; `InUse` while a
    /// process uses it (nvml.h's nvmlComputeInstanceDestroy). A process
    /// binding to it meanwhile is not excluded.
    pub fn destroy_compute_instance(&self, gpu: usize, gi: u32, ci: u32) -> Result<(), MigError> {
        let g = self.gpu_instance(gpu, gi).ok_or(MigError::NotFound)?;
        let k = ci as usize;
        if k >= MAX_CIS {
            return Err(MigError::NotFound);
        }
        if self.mig_in_use(gpu, gi, ci) {
            return Err(MigError::InUse);
        }
        let word = &self.mig_block(gpu).gis[gi as usize];
        word.fetch_update(AcqRel, Acquire, |w| {
            (w & 0xff == u64::from(g.profile.index) + 1 && ci_byte(w, k) != 0)
                .then(|| w & !(0xffu64 << (8 * (k + 1))))
        })
        .map_err(|_| MigError::NotFound)?;
        mig_caps::publish_ci(&self.root, self.node.gpus[gpu].minor, gi, ci, false);
        Ok(())
    }

    /// The MIG devices of `gpu` (one per compute instance), in NVML's
    /// index order: by GPU-instance id, then compute-instance id.
    pub fn mig_devices(&self, gpu: usize) -> Vec<(GpuInstance, ComputeInstance)> {
        let block = self.mig_block(gpu);
        self.gpu_instances(gpu)
            .into_iter()
            .flat_map(|g| {
                let w = block.gis[g.id as usize].load(Acquire);
                decode_cis(&g, w).into_iter().map(move |c| (g, c))
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests;
