//! The driver's durable record of prepared claims
//! (`<state dir>/checkpoint.json`), written (fsynced, atomically) before
//! NodePrepareResources answers and after NodeUnprepareResources released.
//! A restarted driver re-serves every claim in it without rewriting what
//! the containers use: the kubelet does not prepare a claim twice.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use quota_config::Durability;
use serde::{Deserialize, Serialize};

use crate::plan::PlannedDevice;

/// Bumped when the layout changes incompatibly.
pub const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub devices: Vec<PlannedDevice>,
    /// Unix seconds when it was prepared (the display's "since").
    pub prepared_at: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    pub node: String,
    /// By claim UID.
    pub claims: BTreeMap<String, PreparedClaim>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path} is not a vcuda DRA checkpoint: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("checkpoint {path} has version {found}, this driver reads {VERSION}")]
    Version { path: String, found: u32 },
    #[error("checkpoint {path} is node {found:?}'s, this is {node:?}")]
    Node {
        path: String,
        found: String,
        node: String,
    },
}

/// Mode of the checkpoint and of the CDI specs (root writes, anyone reads).
pub const FILE_MODE: u32 = 0o644;

/// Holds the checkpoint lock until dropped (closing the file unlocks).
pub struct StoreLock {
    _file: std::fs::File,
}

pub struct Store {
    path: PathBuf,
}

impl Store {
    pub fn new(state_dir: &Path) -> Store {
        Store {
            path: state_dir.join("checkpoint.json"),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checkpoint, or an empty one for `node` when there is none yet.
    pub fn load(&self, node: &str) -> Result<Checkpoint, CheckpointError> {
        let p = self.path.display().to_string();
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Checkpoint {
                    version: VERSION,
                    node: node.to_string(),
                    claims: BTreeMap::new(),
                });
            }
            Err(source) => return Err(CheckpointError::Io { path: p, source }),
        };
        // The version first: a later format may change every other field,
        // and must be named as such, not as an unparseable file.
        #[derive(Deserialize)]
        struct Head {
            version: u32,
        }
        if let Ok(h) = serde_json::from_slice::<Head>(&bytes)
            && h.version != VERSION
        {
            return Err(CheckpointError::Version {
                path: p,
                found: h.version,
            });
        }
        let c: Checkpoint =
            serde_json::from_slice(&bytes).map_err(|source| CheckpointError::Parse {
                path: p.clone(),
                source,
            })?;
        if c.node != node {
            return Err(CheckpointError::Node {
                path: p,
                found: c.node,
                node: node.to_string(),
            });
        }
        Ok(c)
    }

    /// Takes the node's checkpoint lock (`checkpoint.lock` beside it,
    /// `flock`, exclusive), waiting for it: during a rolling update two
    /// driver instances serve at once, and each must read what the other
    /// wrote before it writes. Released when the guard drops.
    pub async fn lock(&self) -> Result<StoreLock, CheckpointError> {
        let path = self.path.with_file_name("checkpoint.lock");
        let p = path.display().to_string();
        let io = |source| CheckpointError::Io {
            path: p.clone(),
            source,
        };
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(io)?;
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io)?;
        let f = tokio::task::spawn_blocking(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: flock on an fd this closure owns.
            match unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } {
                0 => Ok(f),
                _ => Err(std::io::Error::last_os_error()),
            }
        })
        .await
        .map_err(|e| io(std::io::Error::other(e)))?
        .map_err(io)?;
        Ok(StoreLock { _file: f })
    }

    pub fn save(&self, c: &Checkpoint) -> Result<(), CheckpointError> {
        let io = |source| CheckpointError::Io {
            path: self.path.display().to_string(),
            source,
        };
        if let Some(d) = self.path.parent() {
            std::fs::create_dir_all(d).map_err(io)?;
        }
        let body = serde_json::to_vec_pretty(c).map_err(|e| io(std::io::Error::other(e)))?;
        // Temp file + fsync + rename + fsync of the directory.
        quota_config::write_atomic(&self.path, &body, FILE_MODE, Durability::Durable)
            .map_err(|e| io(e.source))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::new(tmp.path());
        let mut c = s.load("n1").unwrap();
        assert!(c.claims.is_empty());
        c.claims.insert(
            "u1".into(),
            PreparedClaim {
                namespace: "ns".into(),
                name: "c".into(),
                uid: "u1".into(),
                devices: vec![],
                prepared_at: 1,
            },
        );
        s.save(&c).unwrap();
        assert_eq!(s.load("n1").unwrap(), c);
        assert!(matches!(s.load("n2"), Err(CheckpointError::Node { .. })));
        std::fs::write(s.path(), b"{").unwrap();
        assert!(matches!(s.load("n1"), Err(CheckpointError::Parse { .. })));
        // A later format (other fields too) is named by its version, not
        // reported as unparseable.
        std::fs::write(s.path(), br#"{"version": 2, "claims": [], "host": "n1"}"#).unwrap();
        let e = s.load("n1").unwrap_err();
        assert!(
            matches!(e, CheckpointError::Version { found: 2, .. }),
            "{e}"
        );
        assert!(
            e.to_string().contains("has version 2, this driver reads 1"),
            "{e}"
        );
    }
}
