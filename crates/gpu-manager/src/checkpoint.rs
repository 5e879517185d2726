//! The manager's own record of its allocations, written atomically (temp +
//! rename + fsync) after every change and read at start.

use std::path::{Path, PathBuf};

use gpu_allocator::Placement;
use serde::{Deserialize, Serialize};

pub const CHECKPOINT_FILE: &str = "gpu-manager.json";
const VERSION: u32 = 1;

/// One container's allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub pod_uid: String,
    pub namespace: String,
    pub pod_name: String,
    pub container: String,
    /// Index of the container in the pod spec (`predicate-gpu-idx-<i>`).
    pub container_index: usize,
    /// `vcuda-core` of the request.
    pub cores: u32,
    /// `vcuda-memory` units of the container (whole GPUs: all their memory).
    pub memory_units: u64,
    /// The container's `vcuda-memory` limit (what kubelet allocates IDs for).
    #[serde(default)]
    pub memory_limit: u64,
    pub placement: PlacementRecord,
    /// Soft limit ceiling (`tencent.com/vcuda-core-limit`), if any.
    pub soft_limit: Option<u32>,
    /// The advertised IDs kubelet passed to Allocate.
    pub vcore_ids: Vec<String>,
    #[serde(default)]
    pub vmemory_ids: Vec<String>,
    /// kubelet's record was seen to agree with the pod the manager guessed.
    #[serde(default)]
    pub verified: bool,
    /// Unix seconds of the allocation.
    pub created: u64,
}

impl Allocation {
    /// The allocator's id for this allocation.
    pub fn id(&self) -> String {
        alloc_id(&self.pod_uid, &self.container)
    }
}

pub fn alloc_id(pod_uid: &str, container: &str) -> String {
    format!("{pod_uid}/{container}")
}

/// [`Placement`] in a stable serialised form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum PlacementRecord {
    Share {
        gpu: usize,
        cores: u32,
        memory_units: u64,
    },
    Exclusive {
        gpus: Vec<usize>,
    },
}

impl From<&Placement> for PlacementRecord {
    fn from(p: &Placement) -> Self {
        match p {
            Placement::Share {
                gpu,
                cores,
                memory_units,
            } => PlacementRecord::Share {
                gpu: *gpu,
                cores: *cores,
                memory_units: *memory_units,
            },
            Placement::Exclusive { gpus } => PlacementRecord::Exclusive { gpus: gpus.clone() },
        }
    }
}

impl From<&PlacementRecord> for Placement {
    fn from(p: &PlacementRecord) -> Self {
        match p {
            PlacementRecord::Share {
                gpu,
                cores,
                memory_units,
            } => Placement::Share {
                gpu: *gpu,
                cores: *cores,
                memory_units: *memory_units,
            },
            PlacementRecord::Exclusive { gpus } => Placement::Exclusive { gpus: gpus.clone() },
        }
    }
}

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
}

/// GPU UUIDs by index and the allocations, as saved.
pub type Saved = (Vec<String>, Vec<Allocation>);

#[derive(Debug, Clone)]
pub struct Checkpoint {
    path: PathBuf,
}

impl Checkpoint {
    pub fn new(dir: &Path) -> Checkpoint {
        Checkpoint {
            path: dir.join(CHECKPOINT_FILE),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The saved allocations and the GPU UUIDs they were made on; none when
    /// there is no file.
    pub fn load(&self) -> Result<Option<Saved>, CheckpointError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CheckpointError::Io {
                    path: self.path.display().to_string(),
                    source,
                });
            }
        };
        let f: File = serde_json::from_str(&text).map_err(|e| CheckpointError::Invalid {
            path: self.path.display().to_string(),
            problem: e.to_string(),
        })?;
        if f.version != VERSION {
            return Err(CheckpointError::Invalid {
                path: self.path.display().to_string(),
                problem: format!("version {} (this build writes {VERSION})", f.version),
            });
        }
        Ok(Some((f.gpus, f.allocations)))
    }

    pub fn store<'a>(
        &self,
        gpus: &[String],
        allocations: impl IntoIterator<Item = &'a Allocation>,
    ) -> Result<(), CheckpointError> {
        let f = File {
            version: VERSION,
            gpus: gpus.to_vec(),
            allocations: allocations.into_iter().cloned().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&f).expect("serialisable");
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| CheckpointError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
        quota_config::write_atomic(&self.path, &bytes, 0o600).map_err(|e| CheckpointError::Io {
            path: e.path,
            source: e.source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let cp = Checkpoint::new(&dir.path().join("sub"));
        assert!(cp.load().unwrap().is_none());
        let a = Allocation {
            pod_uid: "u".into(),
            namespace: "ns".into(),
            pod_name: "p".into(),
            container: "c".into(),
            container_index: 0,
            cores: 30,
            memory_units: 4,
            memory_limit: 4,
            placement: PlacementRecord::Share {
                gpu: 1,
                cores: 30,
                memory_units: 4,
            },
            soft_limit: None,
            vcore_ids: vec!["vcore-0-00".into()],
            vmemory_ids: vec![],
            verified: false,
            created: 1,
        };
        cp.store(&["GPU-a".into()], [&a]).unwrap();
        let (gpus, allocs) = cp.load().unwrap().unwrap();
        assert_eq!(gpus, vec!["GPU-a"]);
        assert_eq!(allocs, vec![a]);
        std::fs::write(cp.path(), "{").unwrap();
        assert!(cp.load().unwrap_err().to_string().contains("move it away"));
    }
}
