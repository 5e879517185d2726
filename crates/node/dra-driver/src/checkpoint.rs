//! The driver's durable record of prepared claims, written before
//! NodePrepareResources answers and after NodeUnprepareResources released.
//! A restarted driver re-serves every claim in it without rewriting what
//! the containers use: the kubelet does not prepare a claim twice.
//!
//! The manager's engine ([`checkpoint_slots`]): two CRC-checked slot files
//! (`checkpoint.json.a`, `.b`) in the state directory, and — as long as a
//! release that reads only it may be rolled back to — the single
//! `checkpoint.json` of earlier releases, written whole before each slot
//! ([`checkpoint_slots::Layout::mirror`]; it wins when an earlier release
//! wrote it since, as a rolling update's other instance does).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use checkpoint_slots::{Layout, Slots};
use serde::{Deserialize, Serialize};

use crate::plan::PlannedDevice;

/// Bumped when the layout changes incompatibly.
pub const VERSION: u32 = 1;
/// The single file of earlier releases, still written beside the slots.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// The two slot files.
pub const SLOT_FILES: [&str; 2] = ["checkpoint.json.a", "checkpoint.json.b"];
const LAYOUT: Layout = Layout {
    slots: SLOT_FILES,
    legacy: CHECKPOINT_FILE,
    version: VERSION,
    mirror: true,
};

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
    /// Neither slot file verifies (torn or damaged): why, slot by slot.
    #[error("checkpoint {path}: {problem}")]
    Invalid { path: String, problem: String },
    /// A slot file of another layout or payload version (a newer driver
    /// ran here).
    #[error(
        "checkpoint {path} was written in another format ({found}); this driver reads version {VERSION}"
    )]
    OtherFormat { path: String, found: String },
}

impl From<checkpoint_slots::Error<CheckpointError>> for CheckpointError {
    fn from(e: checkpoint_slots::Error<CheckpointError>) -> Self {
        use checkpoint_slots::Error as E;
        match e {
            E::Io { path, source } => CheckpointError::Io { path, source },
            E::Invalid { path, problem } => CheckpointError::Invalid { path, problem },
            E::OtherFormat { path, found } => CheckpointError::OtherFormat { path, found },
            E::Legacy { error, .. } => error,
        }
    }
}

impl From<checkpoint_slots::Error> for CheckpointError {
    fn from(e: checkpoint_slots::Error) -> Self {
        e.cast::<CheckpointError>().into()
    }
}

/// Mode of the CDI specs (root writes, anyone reads).
pub const FILE_MODE: u32 = 0o644;

/// Holds the checkpoint lock until dropped (closing the file unlocks).
pub struct StoreLock {
    _file: std::fs::File,
}

pub struct Store {
    slots: Slots,
}

impl Store {
    pub fn new(state_dir: &Path) -> Store {
        Store {
            slots: Slots::new(state_dir, LAYOUT),
        }
    }

    /// The single file of earlier releases (still written).
    pub fn path(&self) -> PathBuf {
        self.slots.legacy_path()
    }

    /// The checkpoint, or an empty one for `node` when there is none yet.
    pub fn load(&self, node: &str) -> Result<Checkpoint, CheckpointError> {
        let Some(c) = self.slots.load(|bytes| parse(bytes, &self.path()))? else {
            return Ok(Checkpoint {
                version: VERSION,
                node: node.to_string(),
                claims: BTreeMap::new(),
            });
        };
        // Not a damaged slot: the record is whole, of another node.
        if c.node != node {
            return Err(CheckpointError::Node {
                path: self.slots.dir().display().to_string(),
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
        let path = self.slots.dir().join("checkpoint.lock");
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

    /// Writes `c` durably (the single file, then a slot file).
    pub fn save(&self, c: &Checkpoint) -> Result<(), CheckpointError> {
        let body = serde_json::to_vec_pretty(c).map_err(|e| CheckpointError::Io {
            path: self.path().display().to_string(),
            source: std::io::Error::other(e),
        })?;
        Ok(self.slots.write(&body)?)
    }
}

/// A checkpoint's bytes (a slot's payload or the single file).
fn parse(bytes: &[u8], path: &Path) -> Result<Checkpoint, CheckpointError> {
    let p = path.display().to_string();
    // The version first: a later format may change every other field,
    // and must be named as such, not as an unparseable file.
    #[derive(Deserialize)]
    struct Head {
        version: u32,
    }
    if let Ok(h) = serde_json::from_slice::<Head>(bytes)
        && h.version != VERSION
    {
        return Err(CheckpointError::Version {
            path: p,
            found: h.version,
        });
    }
    serde_json::from_slice(bytes).map_err(|source| CheckpointError::Parse { path: p, source })
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
