//! The manager's own record of its allocations: the one durable record
//! (temp file + fdatasync + rename + directory fsync) written after every
//! change and read at start. Everything else the manager writes (vm
//! directories) can be rebuilt from it and from the node. A failed write
//! leaves the previous file intact; an unreadable file is set aside.

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
        // Compact JSON: the file is rewritten on every allocation.
        let bytes = serde_json::to_vec(&f).expect("serialisable");
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let err = |p: &Path| {
            let path = p.display().to_string();
            move |source| CheckpointError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(err(dir))?;
        durable_replace(&self.path, &bytes, 0o600).map_err(err(&self.path))
    }

    /// Moves an unreadable checkpoint out of the way (kept for inspection)
    /// and returns where it went.
    pub fn set_aside(&self) -> Result<PathBuf, CheckpointError> {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let to = self
            .path
            .with_file_name(format!("{CHECKPOINT_FILE}.corrupt-{ts}"));
        std::fs::rename(&self.path, &to).map_err(|source| CheckpointError::Io {
            path: self.path.display().to_string(),
            source,
        })?;
        Ok(to)
    }
}

/// Replaces `path` with `bytes` so that after a crash it holds either the
/// old or the new content, complete: a temp file of a unique name,
/// fdatasync, rename, fsync of the directory. On failure the temp file is
/// removed and `path` is untouched.
pub fn durable_replace(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp.{}.{n}", std::process::id()));
    let r = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_data()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
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
        let aside = cp.set_aside().unwrap();
        assert!(aside.is_file() && cp.load().unwrap().is_none());
    }

    #[test]
    fn a_failed_write_leaves_the_previous_file() {
        use std::os::unix::fs::PermissionsExt;
        if unsafe { libc::geteuid() } == 0 {
            // root ignores directory permissions; the e2e test uses a
            // read-only bind mount instead.
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let cp = Checkpoint::new(dir.path());
        cp.store(&["GPU-a".into()], []).unwrap();
        let before = std::fs::read(cp.path()).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o500)).unwrap();
        assert!(cp.store(&["GPU-b".into()], []).is_err());
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(std::fs::read(cp.path()).unwrap(), before);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
