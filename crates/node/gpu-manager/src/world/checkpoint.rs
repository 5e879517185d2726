//! The manager's own record of its allocations: the one durable record,
//! written before an Allocate answers and read at start. Everything else
//! the manager writes (vm directories) can be rebuilt from it and from the
//! node.
//!
//! Format: two slot files, `gpu-manager.json.a` and `gpu-manager.json.b`
//! (`checkpoint-slots`), each a CRC-checked header and the JSON payload
//! [`encode`] makes; the
//! single-file format of earlier versions (`gpu-manager.json`) is read when
//! no slot file exists and removed after the first slot write.

use std::path::{Path, PathBuf};

use checkpoint_slots::{Layout, MAGIC, Slots};
use serde::{Deserialize, Serialize};

use crate::allocation::Allocation;
use crate::world::CheckpointStore;

/// The single-file checkpoint of earlier versions (read once, migrated).
pub const CHECKPOINT_FILE: &str = "gpu-manager.json";
/// The two slot files.
pub const SLOT_FILES: [&str; 2] = ["gpu-manager.json.a", "gpu-manager.json.b"];
/// Version of the JSON payload (unchanged by the slot format).
const VERSION: u32 = 1;
const LAYOUT: Layout = Layout {
    slots: SLOT_FILES,
    legacy: CHECKPOINT_FILE,
    version: VERSION,
    mirror: false,
};

#[derive(Debug, Serialize, Deserialize)]
struct File {
    version: u32,
    /// GPU UUIDs by index when written: a checkpoint from another set of
    /// GPUs is not applied blindly.
    gpus: Vec<String>,
    allocations: Vec<Allocation>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path} is not valid: {problem}; move it away to start without it")]
    Invalid { path: String, problem: String },
    #[error(
        "checkpoint {path} was written by a gpu-manager of another format ({found}); this one \
         reads slot layout \"{MAGIC}\" with payload version {VERSION}"
    )]
    Version { path: String, found: String },
}

/// The engine's errors in the manager's words; a single file of earlier
/// versions that does not parse is as invalid as a bad slot.
impl<E: std::fmt::Display> From<checkpoint_slots::Error<E>> for CheckpointError {
    fn from(e: checkpoint_slots::Error<E>) -> Self {
        use checkpoint_slots::Error as Engine;
        match e {
            Engine::Io { path, source } => CheckpointError::Io { path, source },
            Engine::Invalid { path, problem } => CheckpointError::Invalid { path, problem },
            Engine::OtherFormat { path, found } => CheckpointError::Version { path, found },
            Engine::Legacy { path, error } => CheckpointError::Invalid {
                path,
                problem: error.to_string(),
            },
        }
    }
}

/// GPU UUIDs by index and the allocations, as saved.
pub type Saved = (Vec<String>, Vec<Allocation>);

#[derive(Debug, Clone)]
pub struct Checkpoint {
    slots: Slots,
}

impl Checkpoint {
    pub fn new(dir: &Path) -> Checkpoint {
        Checkpoint {
            slots: Slots::new(dir, LAYOUT),
        }
    }

    /// The checkpoint directory.
    pub fn path(&self) -> &Path {
        self.slots.dir()
    }

    #[cfg(test)]
    fn slot_path(&self, i: usize) -> PathBuf {
        self.slots.slot_path(i)
    }

    /// The saved allocations and the GPU UUIDs they were made on; none when
    /// there is no checkpoint. The newest slot that verifies wins; a slot
    /// that does not is ignored with a warning; none verifying is
    /// [`CheckpointError::Invalid`] (see [`Checkpoint::set_aside`]).
    pub fn load(&self) -> Result<Option<Saved>, CheckpointError> {
        let saved = self.slots.load(parse)?;
        Ok(saved)
    }

    /// Records the allocations durably: the older slot is overwritten in
    /// place and synced once. On failure the newest good slot is untouched
    /// and the next store goes to the same slot again.
    pub fn store<'a>(
        &self,
        gpus: &[String],
        allocations: impl IntoIterator<Item = &'a Allocation>,
    ) -> Result<(), CheckpointError> {
        Ok(self.slots.write(&encode(gpus, allocations))?)
    }

    /// Moves unreadable checkpoint files (both slots, the old single file)
    /// out of the way, kept for inspection, and returns where they went.
    pub fn set_aside(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        Ok(self.slots.set_aside()?)
    }
}

impl CheckpointStore for Checkpoint {
    fn location(&self) -> String {
        self.path().display().to_string()
    }

    fn load(&self) -> Result<Option<Saved>, CheckpointError> {
        Checkpoint::load(self)
    }

    fn store(&self, gpus: &[String], allocations: &[Allocation]) -> Result<(), CheckpointError> {
        Checkpoint::store(self, gpus, allocations)
    }

    fn set_aside(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        Checkpoint::set_aside(self)
    }
}

/// The JSON payload of a checkpoint: with [`parse`], the one place the
/// record's format is known (every [`CheckpointStore`] goes through both).
pub fn encode<'a>(
    gpus: &[String],
    allocations: impl IntoIterator<Item = &'a Allocation>,
) -> Vec<u8> {
    let f = File {
        version: VERSION,
        gpus: gpus.to_vec(),
        allocations: allocations.into_iter().cloned().collect(),
    };
    // Compact JSON: the record is rewritten on every allocation.
    serde_json::to_vec(&f).expect("serialisable")
}

/// Why a payload is not one [`encode`] made.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("version {0} (this build writes {VERSION})")]
    Version(u32),
}

/// A payload made by [`encode`], or why it is not one.
pub fn parse(payload: &[u8]) -> Result<Saved, PayloadError> {
    let f: File = serde_json::from_slice(payload)?;
    if f.version != VERSION {
        return Err(PayloadError::Version(f.version));
    }
    Ok((f.gpus, f.allocations))
}

/// A 30-core, 4-unit share on `gpu`, unverified: the allocation the unit
/// tests of this crate start from.
#[cfg(test)]
pub(crate) fn sample_share(uid: &str, gpu: usize) -> Allocation {
    Allocation {
        pod_uid: uid.into(),
        namespace: "ns".into(),
        pod_name: "p".into(),
        container: "c".into(),
        container_index: 0,
        cores: 30,
        memory_units: 4,
        memory_limit: 4,
        placement: crate::allocation::PlacementRecord::Share {
            gpu,
            cores: 30,
            memory_units: 4,
        },
        soft_limit: None,
        tier: Default::default(),
        memory_ceiling: None,
        vcore_ids: vec!["vcore-0-00".into()],
        vmemory_ids: vec![],
        verified: false,
        created: 1,
    }
}

#[cfg(test)]
mod tests;
