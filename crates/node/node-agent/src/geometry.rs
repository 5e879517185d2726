//! A MIG geometry named in the node's configuration, applied at start
//! (both daemons): `--mig-geometry "0=3g.40gb,1g.10gb,1g.10gb;1=7g.80gb"`
//! makes each named GPU hold exactly those GPU instances (each with one
//! compute instance the size of its GPU instance), by index or UUID. GPUs
//! not named are left as they are (whole, for shares, or an operator's).
//!
//! What exists is adopted, not rebuilt: instances of wanted profiles are
//! kept where they are, and an instance is destroyed only when vcuda made
//! it (the record beside the daemon's state, [`Created`]) and nothing uses
//! it (no process on it, no pod holding it). The placements are
//! `gpu_allocator::mig::converge`'s. A GPU not in MIG mode is switched
//! when idle; the switch needs a GPU reset on real hardware, so the
//! geometry waits for the next start after it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use gpu_allocator::mig::{self as plan, MigShape, Slices, Step};
use nvml_wrapper::error::NvmlError;
use serde::{Deserialize, Serialize};

/// One GPU-instance profile as the driver offers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiProfile {
    /// The driver's id (what create and placements take).
    pub id: u32,
    /// `3g.40gb` (NVML's name without its `MIG ` prefix).
    pub name: String,
    pub placements: Vec<Slices>,
}

/// A GPU instance that exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiState {
    pub id: u32,
    pub profile: u32,
    pub slices: Slices,
    /// The `MIG-…` UUIDs of its compute instances.
    pub uuids: Vec<String>,
    /// A process runs on it.
    pub busy: bool,
}

/// Where MIG geometry changes reach the GPU (NVML; an in-memory double in
/// tests).
pub trait MigDriver {
    /// MIG mode (current, pending).
    fn mode(&self, gpu: usize) -> Result<(bool, bool), NvmlError>;
    /// Asks for MIG mode `on`; a process on the GPU refuses it.
    fn set_mode(&self, gpu: usize, on: bool) -> Result<(), NvmlError>;
    fn profiles(&self, gpu: usize) -> Result<Vec<GiProfile>, NvmlError>;
    fn instances(&self, gpu: usize) -> Result<Vec<GiState>, NvmlError>;
    /// A GPU instance of `profile` at `slices` and its full compute
    /// instance; returns the GPU instance's id.
    fn create(&self, gpu: usize, profile: u32, slices: Slices) -> Result<u32, NvmlError>;
    /// GPU instance `gi` and its compute instances.
    fn destroy(&self, gpu: usize, gi: u32) -> Result<(), NvmlError>;
}

/// `--mig-geometry`: wanted profile names per GPU (index or UUID).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Geometry {
    pub gpus: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "mig-geometry {text:?}: {problem} (expected \"<GPU index or UUID>=<profile>,<profile>;…\", e.g. \"0=3g.40gb,1g.10gb\")"
)]
pub struct GeometryParseError {
    pub text: String,
    pub problem: String,
}

impl std::str::FromStr for Geometry {
    type Err = GeometryParseError;
    fn from_str(text: &str) -> Result<Geometry, GeometryParseError> {
        let err = |problem: String| GeometryParseError {
            text: text.to_string(),
            problem,
        };
        let mut gpus = BTreeMap::new();
        for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (gpu, profiles) = part
                .split_once('=')
                .ok_or_else(|| err(format!("{part:?} has no '='")))?;
            let gpu = gpu.trim();
            if gpu.is_empty() {
                return Err(err(format!("{part:?} names no GPU")));
            }
            let list: Vec<String> = profiles
                .split(',')
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect();
            if list.is_empty() {
                return Err(err(format!("GPU {gpu} has no profile")));
            }
            if gpus.insert(gpu.to_string(), list).is_some() {
                return Err(err(format!("GPU {gpu} is named twice")));
            }
        }
        Ok(Geometry { gpus })
    }
}

/// The GPU instances vcuda made, by GPU UUID: the only ones it may
/// destroy. Kept as JSON beside the daemon's state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    /// GPU UUID → (GPU instance id, profile id, first memory slice) of
    /// each. An operator who destroys one of these and makes the same
    /// profile at the same place while no daemon runs gets the same id
    /// back from NVML: that one is read as vcuda's.
    pub gpus: BTreeMap<String, BTreeSet<(u32, u32, u32)>>,
}

impl Created {
    pub fn path(state_dir: &Path) -> PathBuf {
        state_dir.join("mig-created.json")
    }

    /// The record, or none when there is no file; a record that does not
    /// parse is set aside (`.bad`) and read as empty: vcuda then destroys
    /// nothing it cannot prove it made.
    pub fn load(state_dir: &Path) -> Created {
        let p = Created::path(state_dir);
        match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                tracing::warn!(path = %p.display(), error = %e, "unreadable MIG record set aside: no instance counts as vcuda's");
                let _ = std::fs::rename(&p, p.with_extension("json.bad"));
                Created::default()
            }),
            Err(_) => Created::default(),
        }
    }

    pub fn store(&self, state_dir: &Path) -> Result<(), quota_config::IoError> {
        let text = serde_json::to_vec_pretty(self).expect("a map of numbers serializes");
        quota_config::write_atomic(
            &Created::path(state_dir),
            &text,
            0o644,
            quota_config::Durability::Durable,
        )
    }
}

/// Why a GPU's geometry was not applied.
#[derive(Debug, thiserror::Error)]
pub enum GeometryError {
    #[error("GPU {gpu}: NVML: {what}: {source}")]
    Driver {
        gpu: String,
        what: String,
        #[source]
        source: NvmlError,
    },
    #[error("GPU {gpu}: profile {name:?} is not one this GPU offers ({offered})")]
    UnknownProfile {
        gpu: String,
        name: String,
        offered: String,
    },
    #[error("GPU {gpu}: {source}")]
    NoFit {
        gpu: String,
        #[source]
        source: plan::MigPlanError,
    },
    #[error("no GPU {0:?} on this node (an index or a GPU-… UUID)")]
    NoGpu(String),
}

/// What became of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It holds the geometry: the instances created and destroyed to get there.
    Applied { created: usize, destroyed: usize },
    /// MIG mode was asked for and waits for a GPU reset.
    ModePending,
}

/// A GPU as the geometry names it.
#[derive(Debug, Clone, Copy)]
pub struct GpuRef<'a> {
    pub index: usize,
    pub uuid: &'a str,
}

/// GPU `gpu` in MIG mode, asked for when off (a process on the GPU
/// refuses it); false while the mode waits for a GPU reset.
pub fn ensure_mig_mode(driver: &dyn MigDriver, gpu: usize) -> Result<bool, NvmlError> {
    let (on, pending) = driver.mode(gpu)?;
    if on {
        return Ok(true);
    }
    if !pending {
        driver.set_mode(gpu, true)?;
    }
    Ok(driver.mode(gpu)?.0)
}

/// Of the GPUs `named` by `--<flag>` (index or UUID; names of no GPU are
/// left to the flag's own check), those that stay whole instead of being
/// put in MIG mode, each logged with `why` it is held: not in MIG mode,
/// and `holding` (the GPUs pods or claims hold whole or a share of;
/// `None`: unknown, their record unread) has it. MIG mode would take it
/// from under them, with no process there to refuse it; it is applied at
/// a start that finds none.
pub fn left_whole<'a>(
    flag: &str,
    why: &str,
    named: impl IntoIterator<Item = &'a String>,
    found: &crate::nvml::Discovered,
    holding: Option<&BTreeSet<String>>,
) -> BTreeSet<String> {
    let gpus = found.topology.gpus();
    let mut out = BTreeSet::new();
    for name in named {
        let Some(g) = gpus
            .iter()
            .find(|g| g.index.to_string() == *name || g.uuid == *name)
        else {
            continue;
        };
        let in_mig = found.mig.get(g.index).is_some_and(|m| m.enabled);
        if !in_mig && holding.is_none_or(|h| h.contains(&g.uuid)) {
            tracing::warn!(
                gpu = %name,
                "--{flag} not applied: {why} (or the record of them is unread); left whole until a start that finds none"
            );
            out.insert(name.clone());
        }
    }
    out
}

/// A GPU-list flag's entry that names no GPU of this node.
#[derive(Debug, thiserror::Error)]
#[error("--{flag} {name:?}: no GPU of this node has that index or UUID")]
pub struct UnknownGpu {
    pub flag: &'static str,
    pub name: String,
}

/// The indices of the GPUs `named` (index or UUID) among `uuids`, for
/// flag `--<flag>`.
pub fn resolve_gpus(
    flag: &'static str,
    named: &[String],
    uuids: &[String],
) -> Result<BTreeSet<usize>, UnknownGpu> {
    named
        .iter()
        .map(|n| {
            let by_index = n.parse::<usize>().ok().filter(|&i| i < uuids.len());
            by_index
                .or_else(|| uuids.iter().position(|u| u == n))
                .ok_or_else(|| UnknownGpu {
                    flag,
                    name: n.clone(),
                })
        })
        .collect()
}

/// Applies `geometry` to `gpus`: per GPU named, what became of it. `held`
/// are the MIG UUIDs pods hold (never destroyed); `created` is updated
/// with what was made and destroyed (the caller stores it).
pub fn apply(
    driver: &dyn MigDriver,
    gpus: &[GpuRef<'_>],
    geometry: &Geometry,
    held: &BTreeSet<String>,
    created: &mut Created,
) -> Vec<(String, Result<Outcome, GeometryError>)> {
    geometry
        .gpus
        .iter()
        .map(|(name, want)| {
            let gpu = gpus
                .iter()
                .find(|g| g.index.to_string() == *name || g.uuid == name);
            let r = match gpu {
                None => Err(GeometryError::NoGpu(name.clone())),
                Some(g) => apply_gpu(driver, *g, want, held, created),
            };
            (name.clone(), r)
        })
        .collect()
}

fn apply_gpu(
    driver: &dyn MigDriver,
    gpu: GpuRef<'_>,
    want: &[String],
    held: &BTreeSet<String>,
    created: &mut Created,
) -> Result<Outcome, GeometryError> {
    let nvml = |what: &str| {
        let what = what.to_string();
        let gpu = gpu.uuid.to_string();
        move |source| GeometryError::Driver { gpu, what, source }
    };
    if !ensure_mig_mode(driver, gpu.index).map_err(nvml("enabling MIG mode"))? {
        return Ok(Outcome::ModePending);
    }
    let profiles = driver
        .profiles(gpu.index)
        .map_err(nvml("GPU-instance profiles"))?;
    let ids = want
        .iter()
        .map(|n| {
            profiles
                .iter()
                .find(|p| p.name == *n)
                .map(|p| p.id)
                .ok_or_else(|| GeometryError::UnknownProfile {
                    gpu: gpu.uuid.to_string(),
                    name: n.clone(),
                    offered: profiles
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let shape = MigShape {
        placements: profiles
            .iter()
            .map(|p| (p.id, p.placements.clone()))
            .collect(),
    };
    let now = driver.instances(gpu.index).map_err(nvml("GPU instances"))?;
    // Forget instances that are gone: an id and slice an operator reuses
    // is not vcuda's.
    let record = created.gpus.entry(gpu.uuid.to_string()).or_default();
    let key = |g: &GiState| (g.id, g.profile, g.slices.start);
    record.retain(|k| now.iter().any(|g| key(g) == *k));
    let existing: Vec<plan::Instance> = now
        .iter()
        .map(|g| plan::Instance {
            profile: g.profile,
            slices: g.slices,
            in_use: g.busy || g.uuids.iter().any(|u| held.contains(u)),
            ours: record.contains(&key(g)),
        })
        .collect();
    let steps = plan::converge(&shape, &existing, &ids).map_err(|source| GeometryError::NoFit {
        gpu: gpu.uuid.to_string(),
        source,
    })?;
    let (mut made, mut gone) = (0, 0);
    for step in steps {
        match step {
            Step::Destroy(k) => {
                let g = &now[k];
                driver
                    .destroy(gpu.index, g.id)
                    .map_err(nvml(&format!("destroying GPU instance {}", g.id)))?;
                record.remove(&key(g));
                gone += 1;
            }
            Step::Create { profile, slices } => {
                let id = driver
                    .create(gpu.index, profile, slices)
                    .map_err(nvml(&format!(
                        "creating a GPU instance of profile {profile} at slice {}",
                        slices.start
                    )))?;
                record.insert((id, profile, slices.start));
                made += 1;
            }
        }
    }
    Ok(Outcome::Applied {
        created: made,
        destroyed: gone,
    })
}

/// [`apply`] at a daemon's start: each GPU's outcome logged (a GPU whose
/// geometry cannot be applied is served as it is), the record stored in
/// `state_dir`. True when an instance was created or destroyed (the
/// caller then reads the GPUs again).
pub fn apply_at_start(
    driver: &dyn MigDriver,
    gpus: &[GpuRef<'_>],
    geometry: &Geometry,
    held: &BTreeSet<String>,
    state_dir: &Path,
) -> bool {
    let mut created = Created::load(state_dir);
    let before = created.clone();
    let mut changed = false;
    for (gpu, r) in apply(driver, gpus, geometry, held, &mut created) {
        match r {
            Ok(Outcome::Applied { created, destroyed }) => {
                changed |= created + destroyed > 0;
                tracing::info!(%gpu, created, destroyed, "MIG geometry applied");
            }
            Ok(Outcome::ModePending) => tracing::warn!(
                %gpu,
                "MIG mode enabled, pending a GPU reset (nvidia-smi -r, or a reboot): the geometry is applied at the next start after it"
            ),
            Err(e) => {
                tracing::error!(%gpu, error = %e, "MIG geometry not applied: the GPU is served as it is")
            }
        }
    }
    if created != before {
        let stored = std::fs::create_dir_all(state_dir)
            .map_err(|e| e.to_string())
            .and_then(|()| created.store(state_dir).map_err(|e| e.to_string()));
        if let Err(e) = stored {
            tracing::error!(error = %e, "the record of vcuda's MIG instances was not stored: they will be read as an operator's");
        }
    }
    changed
}

#[cfg(test)]
mod tests;
