//! Per-container vm directories: `<vm>/<pod uid>/<container>/` holding
//! `vcuda.config`, `pids.config`, the ledger's id record and `vcuda.sock`,
//! mounted read-only at `/etc/vcuda`. Directories are 0755 and files 0644
//! (root writes, any container user reads); the socket is 0666 so non-root
//! processes can connect; the ledger itself is a sealed memfd that reaches
//! processes only as a descriptor passed over the socket
//! ([`crate::ledgers`]).
//!
//! These files are derived state: the checkpoint is the durable record and
//! recovery rewrites them from it, so they are replaced atomically (temp +
//! rename, readers never see half a file) but not fsynced on the Allocate
//! path. A directory mounted into a running container is never removed and
//! re-created (the mount would keep the deleted one); files inside it are
//! replaced only when their content differs.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use quota_config::{CONFIG_FILE, GPUS_FILE, MultiGpuQuota, PIDS_FILE, ResourceData};

/// A container's ledger and the open file whose descriptor is passed over
/// `vcuda.sock`.
pub type LedgerFile = (container_ledger::Ledger, std::fs::File);

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{what} {value:?} cannot name a directory: {problem}")]
    BadName {
        what: &'static str,
        value: String,
        problem: &'static str,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("vcuda.config for {path}: {source}")]
    Config {
        path: String,
        #[source]
        source: quota_config::ConfigError,
    },
    #[error("ledger {path}: {source}")]
    Ledger {
        path: String,
        #[source]
        source: container_ledger::LedgerError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> VmError + '_ {
    move |source| VmError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A pod UID: what Kubernetes generates (UUIDs) and what fits
/// `resource_data_t.pod_uid`: 1..=47 of `[A-Za-z0-9-]`.
pub fn check_pod_uid(uid: &str) -> Result<(), VmError> {
    let bad = |problem| {
        Err(VmError::BadName {
            what: "pod UID",
            value: uid.to_string(),
            problem,
        })
    };
    if uid.is_empty() || uid.len() > 47 {
        return bad("must be 1 to 47 characters");
    }
    if !uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return bad("only letters, digits and '-' are allowed");
    }
    Ok(())
}

/// A container name: a DNS-1123 label, as the API server enforces
/// (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63).
pub fn check_container_name(name: &str) -> Result<(), VmError> {
    let bad = |problem| {
        Err(VmError::BadName {
            what: "container name",
            value: name.to_string(),
            problem,
        })
    };
    if name.is_empty() || name.len() > 63 {
        return bad("must be 1 to 63 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return bad("only lower-case letters, digits and '-' are allowed (DNS-1123 label)");
    }
    if name.starts_with('-') || name.ends_with('-') {
        return bad("must start and end with a letter or digit");
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct VmDirs {
    root: PathBuf,
}

fn mkdir(p: &Path) -> Result<(), VmError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(p)
        .map_err(io(p))?;
    // An existing directory keeps whatever mode it had; make it ours.
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).map_err(io(p))
}

impl VmDirs {
    pub fn new(root: &Path) -> VmDirs {
        VmDirs {
            root: root.to_path_buf(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of a container; the names must have been checked.
    pub fn dir(&self, pod_uid: &str, container: &str) -> Result<PathBuf, VmError> {
        check_pod_uid(pod_uid)?;
        check_container_name(container)?;
        Ok(self.root.join(pod_uid).join(container))
    }

    /// Creates the directory of a share on several GPUs: `vcuda-gpus.config`
    /// then `vcuda.config` (the order `quota_config::write_multi` keeps, so
    /// whoever sees `enable` 2 finds the GPUs), an empty `pids.config` (an
    /// existing one is kept) and one ledger per GPU in record order (ids
    /// `ledger.id`, `ledger.1.id`, …), each with that GPU's memory quota.
    pub fn prepare_multi(&self, q: &MultiGpuQuota) -> Result<(PathBuf, Vec<LedgerFile>), VmError> {
        let dir = self.dir(&q.pod_uid, &q.container_name)?;
        mkdir(&self.root)?;
        mkdir(&dir)?;
        let (config, gpus) = q.to_files().map_err(|source| VmError::Config {
            path: dir.display().to_string(),
            source,
        })?;
        replace_if_changed(&dir.join(GPUS_FILE), &gpus, 0o644)?;
        replace_if_changed(&dir.join(CONFIG_FILE), &config, 0o644)?;
        let pids = dir.join(PIDS_FILE);
        if !pids.exists() {
            replace_file(&pids, &[], 0o644)?;
        }
        let mut ledgers = Vec::with_capacity(q.gpus.len());
        for (i, g) in q.gpus.iter().enumerate() {
            ledgers.push(crate::ledgers::open(&dir, i, g.gpu_memory)?);
        }
        Ok((dir, ledgers))
    }

    /// Creates the directory and writes `vcuda.config` and an empty
    /// `pids.config` (an existing one is kept: recovery). For shares,
    /// takes the live ledger back or starts one, with the memory quota.
    pub fn prepare(
        &self,
        data: &ResourceData,
        ledger_quota: Option<u64>,
    ) -> Result<(PathBuf, Option<LedgerFile>), VmError> {
        let dir = self.dir(&data.pod_uid, &data.container_name)?;
        mkdir(&self.root)?;
        mkdir(&dir)?;
        let bytes = data.to_bytes().map_err(|source| VmError::Config {
            path: dir.display().to_string(),
            source,
        })?;
        replace_if_changed(&dir.join(CONFIG_FILE), &bytes, 0o644)?;
        let pids = dir.join(PIDS_FILE);
        if !pids.exists() {
            replace_file(&pids, &[], 0o644)?;
        }
        let ledger = match ledger_quota {
            Some(q) => Some(crate::ledgers::open(&dir, 0, q)?),
            None => None,
        };
        Ok((dir, ledger))
    }

    /// The `(pod uid, container)` of every vm directory on disk with valid
    /// names (anything else under the root is not ours and is left alone).
    pub fn list(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let Ok(pods) = std::fs::read_dir(&self.root) else {
            return out;
        };
        for p in pods.flatten() {
            let uid = p.file_name().to_string_lossy().into_owned();
            if check_pod_uid(&uid).is_err() || !p.path().is_dir() {
                continue;
            }
            for c in std::fs::read_dir(p.path()).into_iter().flatten().flatten() {
                let name = c.file_name().to_string_lossy().into_owned();
                if check_container_name(&name).is_ok() && c.path().is_dir() {
                    out.push((uid.clone(), name));
                }
            }
        }
        out
    }

    /// Removes a container's directory, and its pod's when that is empty.
    pub fn remove(&self, pod_uid: &str, container: &str) {
        let Ok(dir) = self.dir(pod_uid, container) else {
            return;
        };
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %dir.display(), error = %e, "removing vm directory");
        }
        if let Some(pod) = dir.parent() {
            let _ = std::fs::remove_dir(pod);
        }
    }
}

/// Replaces `path` atomically (temp + rename) without fsync: derived state
/// ([`quota_config::Durability::Derived`]).
pub fn replace_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), VmError> {
    quota_config::write_atomic(path, bytes, mode, quota_config::Durability::Derived).map_err(|e| {
        VmError::Io {
            path: e.path,
            source: e.source,
        }
    })
}

/// [`replace_file`] unless the file already holds `bytes` (a recovered
/// container's quota file is left as it is).
pub fn replace_if_changed(path: &Path, bytes: &[u8], mode: u32) -> Result<bool, VmError> {
    if std::fs::read(path).is_ok_and(|b| b == bytes) {
        return Ok(false);
    }
    replace_file(path, bytes, mode)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn names_that_cannot_escape() {
        for bad in ["", "..", "a/b", "../x", "x\0", &"a".repeat(48), "UPPER"] {
            assert!(
                check_pod_uid(bad).is_err() || check_container_name(bad).is_err(),
                "{bad:?}"
            );
        }
        assert!(check_pod_uid("..").is_err());
        assert!(check_container_name("..").is_err());
        assert!(check_container_name("-a").is_err());
        assert!(check_container_name("cuda-1").is_ok());
        assert!(check_pod_uid("3f1a9c2e-0000-4000-8000-000000000001").is_ok());
    }

    #[test]
    fn prepare_writes_files_with_modes() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = VmDirs::new(&tmp.path().join("vm"));
        let data = ResourceData {
            pod_uid: "uid-1".into(),
            limit: 30,
            container_name: "c".into(),
            bus_id: "0000:3B:00.0".into(),
            gpu_memory: 1 << 30,
            utilization: 30,
            hard_limit: true,
            driver_version: (550, 54),
            enable: true,
        };
        let (dir, ledger) = vm.prepare(&data, Some(1 << 30)).unwrap();
        assert_eq!(ledger.unwrap().0.quota(), 1 << 30);
        let md = std::fs::metadata(dir.join(CONFIG_FILE)).unwrap();
        assert_eq!(md.mode() & 0o777, 0o644);
        assert_eq!(md.len(), quota_config::CONFIG_SIZE as u64);
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o755);
        assert!(
            !dir.join(container_ledger::LEDGER_FILE).exists(),
            "no resizable ledger file on the host"
        );
        assert_eq!(
            std::fs::metadata(crate::ledgers::id_file(&dir, 0))
                .unwrap()
                .mode()
                & 0o777,
            0o644
        );
        assert_eq!(vm.list(), vec![("uid-1".to_string(), "c".to_string())]);
        // Preparing again (recovery) keeps the inode of an unchanged file.
        let ino = std::fs::metadata(dir.join(CONFIG_FILE)).unwrap().ino();
        vm.prepare(&data, Some(1 << 30)).unwrap();
        assert_eq!(std::fs::metadata(dir.join(CONFIG_FILE)).unwrap().ino(), ino);
        vm.remove("uid-1", "c");
        assert!(!dir.exists() && !dir.parent().unwrap().exists());
        assert!(vm.list().is_empty());
    }

    #[test]
    fn prepare_multi_writes_both_files_and_a_ledger_per_gpu() {
        use std::os::fd::AsFd;
        let tmp = tempfile::tempdir().unwrap();
        let vm = VmDirs::new(&tmp.path().join("vm"));
        let gpu = |i: usize, memory: u64| quota_config::GpuQuota {
            bus_id: format!("0000:{:02X}:00.0", i + 1),
            uuid: format!("GPU-{i}"),
            gpu_memory: memory,
            utilization: 50,
            limit: 50,
        };
        let q = MultiGpuQuota {
            pod_uid: "uid-2".into(),
            container_name: "main".into(),
            hard_limit: true,
            driver_version: (550, 54),
            gpus: vec![gpu(0, 8 << 30), gpu(1, 4 << 30)],
        };
        let (dir, ledgers) = vm.prepare_multi(&q).unwrap();
        let quotas: Vec<u64> = ledgers.iter().map(|(l, _)| l.quota()).collect();
        assert_eq!(quotas, vec![8 << 30, 4 << 30]);
        for gpu in [0, 1] {
            let seals = container_ledger::seals(ledgers[gpu].1.as_fd()).unwrap();
            assert_eq!(
                seals & container_ledger::REQUIRED_SEALS,
                container_ledger::REQUIRED_SEALS
            );
            assert!(crate::ledgers::id_file(&dir, gpu).exists());
        }
        assert_eq!(
            quota_config::read_quota(&dir).unwrap(),
            quota_config::Quota::Multi(q.clone())
        );
        // Again (recovery): the same files, the same live ledgers.
        let ino = std::fs::metadata(dir.join(GPUS_FILE)).unwrap().ino();
        let again = vm.prepare_multi(&q).unwrap().1;
        for (a, b) in ledgers.iter().zip(&again) {
            let id = |f: &std::fs::File| f.metadata().map(|m| m.ino()).unwrap();
            assert_eq!(id(&a.1), id(&b.1));
        }
        assert_eq!(std::fs::metadata(dir.join(GPUS_FILE)).unwrap().ino(), ino);
    }
}
