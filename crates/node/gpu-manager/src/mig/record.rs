//! What the MIG plugins served, kept in `mig-served.json` beside the
//! checkpoint. The kubelet's checkpoint says which pod holds which MIG
//! device, but a manager that starts after that device's instance was
//! destroyed never finds it in NVML: without this record it would never
//! list it, and its pod's CUDA would fail with no word why. With it the
//! manager starts from what its predecessor served, so a device missing
//! now is lost ([`super::lost`]) as if it went while the manager ran.
//!
//! Versioned: this build reads [`VERSION`] only; any other record (or one
//! that does not parse) is set aside as `.bad` with a warning and read as
//! empty, which loses only this start's view of devices already gone.

use std::path::{Path, PathBuf};

use node_agent::mig::MigDevice;
use serde::{Deserialize, Serialize};

/// The layout this build writes and reads.
pub const VERSION: u32 = 1;

/// The record's file in the checkpoint directory.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("mig-served.json")
}

/// The devices served, each with its GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub version: u32,
    pub devices: Vec<RecordedDevice>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedDevice {
    /// The parent GPU's UUID (indices may change across a reboot).
    pub gpu: String,
    /// Its UUID, profile, instance ids, memory and SMs.
    #[serde(flatten)]
    pub device: MigDevice,
}

/// Why a record was set aside.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{path} is not JSON of a served-MIG record: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} is version {found}; this build reads version {VERSION} only")]
    Version { path: String, found: u32 },
}

/// The record in `state_dir`: none (an empty list) when there is no file;
/// one that cannot be read as this version is set aside (`.bad`).
pub fn load(state_dir: &Path) -> Vec<RecordedDevice> {
    let p = path(state_dir);
    let Ok(bytes) = std::fs::read(&p) else {
        return Vec::new();
    };
    match parse(&p, &bytes) {
        Ok(r) => r.devices,
        Err(e) => {
            tracing::warn!(error = %e, "the served-MIG record set aside: devices destroyed while no manager ran are not known to this one");
            let _ = std::fs::rename(&p, p.with_extension("json.bad"));
            Vec::new()
        }
    }
}

fn parse(p: &Path, bytes: &[u8]) -> Result<Record, RecordError> {
    let path = p.display().to_string();
    #[derive(Deserialize)]
    struct Versioned {
        version: u32,
    }
    let v: Versioned = serde_json::from_slice(bytes).map_err(|source| RecordError::Json {
        path: path.clone(),
        source,
    })?;
    if v.version != VERSION {
        return Err(RecordError::Version {
            path,
            found: v.version,
        });
    }
    serde_json::from_slice(bytes).map_err(|source| RecordError::Json { path, source })
}

/// Writes `devices` as the record (durably: it must survive the reboot
/// that follows a crash), making `state_dir` if it is not there yet.
pub fn store(state_dir: &Path, devices: Vec<RecordedDevice>) -> Result<(), quota_config::IoError> {
    std::fs::create_dir_all(state_dir).map_err(|source| quota_config::IoError {
        path: state_dir.display().to_string(),
        source,
    })?;
    let r = Record {
        version: VERSION,
        devices,
    };
    let text = serde_json::to_vec_pretty(&r).expect("strings and numbers serialize");
    quota_config::write_atomic(
        &path(state_dir),
        &text,
        0o644,
        quota_config::Durability::Durable,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(uuid: &str) -> RecordedDevice {
        RecordedDevice {
            gpu: "GPU-0".into(),
            device: MigDevice {
                uuid: uuid.into(),
                profile: "1g.10gb".into(),
                gpu_instance: 9,
                compute_instance: 0,
                memory_bytes: 10 << 30,
                multiprocessors: 16,
            },
        }
    }

    #[test]
    fn a_stored_record_loads_back() {
        let d = tempfile::tempdir().unwrap();
        assert!(load(d.path()).is_empty(), "no file: nothing");
        store(d.path(), vec![dev("MIG-a"), dev("MIG-b")]).unwrap();
        assert_eq!(load(d.path()), vec![dev("MIG-a"), dev("MIG-b")]);
        let text = std::fs::read_to_string(path(d.path())).unwrap();
        assert!(text.contains("\"version\": 1"), "{text}");
        assert!(text.contains("\"gpu_instance\": 9"), "flat: {text}");
    }

    #[test]
    fn another_version_or_garbage_is_set_aside() {
        let d = tempfile::tempdir().unwrap();
        for bad in [&br#"{"version": 2, "devices": []}"#[..], b"{not json"] {
            std::fs::write(path(d.path()), bad).unwrap();
            let e = parse(&path(d.path()), bad).unwrap_err().to_string();
            assert!(e.contains("mig-served.json"), "{e}");
            assert!(load(d.path()).is_empty());
            assert!(!path(d.path()).exists());
            assert_eq!(
                std::fs::read(d.path().join("mig-served.json.bad")).unwrap(),
                bad
            );
        }
        let e = parse(&path(d.path()), br#"{"version": 2}"#).unwrap_err();
        assert!(e.to_string().contains("version 2"), "{e}");
    }
}
