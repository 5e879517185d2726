//! What this process must enforce, from the container's `vcuda.config`
//! (and `vcuda-gpus.config` when the share spans several GPUs:
//! docs/multi-gpu.md).
//!
//! The interposer is only ever installed into shared containers (whole-GPU
//! containers get the untouched driver), so a missing or unreadable quota
//! file means something is wrong: fail closed, never run unlimited.

use quota_config::{CONTAINER_DIR, GpuQuota, Quota, ReadError, ResourceData};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// Overrides the container directory (default `/etc/vcuda`) only where
/// that directory does not exist: a process on a host or in a test, never
/// one in a container the manager set up (see [`config_dir`]).
pub const CONFIG_DIR_ENV: &str = "VCUDA_CONFIG_DIR";
/// How long cuInit waits for the manager's socket, in milliseconds.
pub const REGISTER_TIMEOUT_ENV: &str = "VCUDA_REGISTER_TIMEOUT_MS";
/// Default of [`REGISTER_TIMEOUT_ENV`]. A container with a quota was set up
/// by a manager, so a missing socket means it is restarting: on the real
/// node a DaemonSet upgrade left no manager for 9-10 s (tests/k8s_node,
/// phase 3b), longer where the new image must be pulled. New processes wait
/// it out rather than fail closed; a container whose manager is gone for
/// good fails closed after this long.
pub const DEFAULT_REGISTER_TIMEOUT_MS: u64 = 30_000;
/// After this long without the manager's socket, `cuInit` says once that it
/// is waiting (stderr, whatever the log level).
pub const REGISTER_WAIT_NOTICE_MS: u64 = 1_000;

#[derive(Debug)]
pub enum Mode {
    /// `enable` = 0: forward everything untouched.
    PassThrough,
    /// Enforce the quotas of this config.
    Enforce(Box<Enforce>),
    /// No usable quota file: every CUDA context is refused; the reason is
    /// the one line printed.
    Closed(String),
}

#[derive(Debug)]
pub struct Enforce {
    /// The container's fields; with a share on several GPUs, the first
    /// GPU's bus id, memory and cores (what one-GPU code paths see).
    pub data: ResourceData,
    pub dir: PathBuf,
    /// Each GPU's quota, in record order (the order of the ledgers); one
    /// entry, from `data`, for a one-GPU container.
    pub gpus: Vec<GpuQuota>,
}

impl Enforce {
    /// How many GPUs the container's share spans (ledgers it registers for).
    pub fn gpus(&self) -> usize {
        self.gpus.len()
    }

    fn single(data: ResourceData, dir: &Path) -> Enforce {
        let gpu = GpuQuota {
            bus_id: data.bus_id.clone(),
            uuid: String::new(),
            gpu_memory: data.gpu_memory,
            utilization: data.utilization,
            limit: data.limit,
        };
        Enforce {
            data,
            dir: dir.to_path_buf(),
            gpus: vec![gpu],
        }
    }

    fn multi(q: quota_config::MultiGpuQuota, dir: &Path) -> Enforce {
        let first = &q.gpus[0];
        let data = ResourceData {
            pod_uid: q.pod_uid.clone(),
            limit: first.limit,
            container_name: q.container_name.clone(),
            bus_id: first.bus_id.clone(),
            gpu_memory: first.gpu_memory,
            utilization: first.utilization,
            hard_limit: q.hard_limit,
            driver_version: q.driver_version,
            enable: true,
        };
        Enforce {
            data,
            dir: dir.to_path_buf(),
            gpus: q.gpus,
        }
    }
}

/// Set once the mode is Enforce: the launch path reads only this.
pub static ENFORCING: AtomicBool = AtomicBool::new(false);

/// Where the quota is: `/etc/vcuda`, which the manager mounts read-only
/// into every shared container. `VCUDA_CONFIG_DIR` is honoured only when
/// `/etc/vcuda` does not exist, so no environment reachable from inside a
/// share (pointing at a copied `vcuda.config` with `enable = 0`, or a
/// larger quota) turns enforcement off: the mount is there and cannot be
/// removed without privileges the container does not have.
pub fn config_dir() -> PathBuf {
    config_dir_from(
        Path::new(CONTAINER_DIR),
        std::env::var_os(CONFIG_DIR_ENV).filter(|v| !v.is_empty()),
    )
}

fn config_dir_from(container: &Path, env: Option<std::ffi::OsString>) -> PathBuf {
    match env {
        Some(v) if std::fs::symlink_metadata(container).is_err() => PathBuf::from(v),
        Some(v) => {
            crate::log::write_line(&format!(
                "{CONFIG_DIR_ENV}={} ignored: {} is this container's quota directory",
                Path::new(&v).display(),
                container.display()
            ));
            container.to_path_buf()
        }
        None => container.to_path_buf(),
    }
}

pub fn register_timeout() -> std::time::Duration {
    let ms = std::env::var(REGISTER_TIMEOUT_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_REGISTER_TIMEOUT_MS);
    std::time::Duration::from_millis(ms)
}

/// The mode, decided once per process (a fork child inherits it).
pub fn mode() -> &'static Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    MODE.get_or_init(|| {
        let m = decide(&config_dir());
        if matches!(m, Mode::Enforce(_)) {
            ENFORCING.store(true, Ordering::Release);
        }
        crate::log::log!(Info, "mode: {}", describe(&m));
        m
    })
}

/// The config, if enforcing.
pub fn enforce() -> Option<&'static Enforce> {
    match mode() {
        Mode::Enforce(e) => Some(e),
        _ => None,
    }
}

fn describe(m: &Mode) -> String {
    match m {
        Mode::PassThrough => "pass-through (enable = 0)".into(),
        Mode::Enforce(e) => e
            .gpus
            .iter()
            .map(|g| {
                format!(
                    "enforcing {} bytes, {}% compute, GPU {}",
                    g.gpu_memory, g.utilization, g.bus_id
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Mode::Closed(r) => format!("closed: {r}"),
    }
}

pub fn decide(dir: &Path) -> Mode {
    match quota_config::read_quota(dir) {
        Err(ReadError::Io(e)) => Mode::Closed(format!(
            "no GPU quota for this container: cannot read {}: {}; \
             the GPU manager writes it when the container is allocated \
             (refusing CUDA rather than running without limits)",
            e.path, e.source
        )),
        Err(ReadError::Invalid { path, source }) => Mode::Closed(format!(
            "GPU quota file {path} is corrupt ({source}); refusing CUDA"
        )),
        Ok(Quota::Single(d)) if !d.enable => Mode::PassThrough,
        Ok(Quota::Single(d)) => Mode::Enforce(Box::new(Enforce::single(d, dir))),
        Ok(Quota::Multi(q)) => Mode::Enforce(Box::new(Enforce::multi(q, dir))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_config::CONFIG_FILE;

    fn data(enable: bool, mem: u64) -> ResourceData {
        ResourceData {
            pod_uid: "uid".into(),
            container_name: "c".into(),
            bus_id: "0000:01:00.0".into(),
            gpu_memory: mem,
            utilization: 50,
            hard_limit: true,
            driver_version: (550, 54),
            enable,
            ..Default::default()
        }
    }

    #[test]
    fn the_environment_cannot_move_a_mounted_quota_directory() {
        let d = tempfile::tempdir().unwrap();
        let mounted = d.path().join("etc-vcuda");
        let elsewhere = Some(std::ffi::OsString::from("/tmp/copied"));
        // No quota directory: a host or test process may point elsewhere.
        assert_eq!(
            config_dir_from(&mounted, elsewhere.clone()),
            PathBuf::from("/tmp/copied")
        );
        // A container's: the variable is ignored.
        std::fs::create_dir(&mounted).unwrap();
        assert_eq!(config_dir_from(&mounted, elsewhere), mounted);
        assert_eq!(config_dir_from(&mounted, None), mounted);
    }

    #[test]
    fn decides_from_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(CONFIG_FILE);
        match decide(d.path()) {
            Mode::Closed(r) => assert!(
                r.contains("vcuda.config") && r.contains("cannot read"),
                "{r}"
            ),
            m => panic!("{m:?}"),
        }
        std::fs::write(&p, b"garbage").unwrap();
        match decide(d.path()) {
            Mode::Closed(r) => assert!(r.contains("corrupt"), "{r}"),
            m => panic!("{m:?}"),
        }
        std::fs::write(&p, data(false, 0).to_bytes().unwrap()).unwrap();
        assert!(matches!(decide(d.path()), Mode::PassThrough));
        std::fs::write(&p, data(true, 1 << 30).to_bytes().unwrap()).unwrap();
        match decide(d.path()) {
            Mode::Enforce(e) => assert_eq!(e.data.gpu_memory, 1 << 30),
            m => panic!("{m:?}"),
        }
    }

    fn multi(utilization: i32) -> quota_config::MultiGpuQuota {
        let gpu = |bus: &str, uuid: &str, mem| GpuQuota {
            bus_id: bus.into(),
            uuid: uuid.into(),
            gpu_memory: mem,
            utilization,
            limit: utilization,
        };
        quota_config::MultiGpuQuota {
            pod_uid: "uid".into(),
            container_name: "c".into(),
            hard_limit: true,
            driver_version: (550, 54),
            gpus: vec![
                gpu("0000:3C:00.0", "GPU-b", 512 << 20),
                gpu("0000:3B:00.0", "GPU-a", 1 << 30),
            ],
        }
    }

    #[test]
    fn a_share_on_several_gpus_is_read_with_every_gpu() {
        let d = tempfile::tempdir().unwrap();
        quota_config::write_multi(d.path(), &multi(100), 0o644).unwrap();
        match decide(d.path()) {
            Mode::Enforce(e) => {
                assert_eq!(e.gpus(), 2);
                assert_eq!(e.gpus[1].gpu_memory, 1 << 30);
                assert_eq!(e.data.bus_id, "0000:3C:00.0", "the first record's");
                assert_eq!(e.data.gpu_memory, 512 << 20);
            }
            m => panic!("{m:?}"),
        }
        quota_config::write_multi(d.path(), &multi(40), 0o644).unwrap();
        match decide(d.path()) {
            Mode::Enforce(e) => assert!(e.gpus.iter().all(|g| g.utilization == 40)),
            m => panic!("{m:?}"),
        }
        // enable = 2 without the GPUs' file: closed, naming it.
        std::fs::remove_file(d.path().join(quota_config::GPUS_FILE)).unwrap();
        match decide(d.path()) {
            Mode::Closed(r) => assert!(r.contains("vcuda-gpus.config"), "{r}"),
            m => panic!("{m:?}"),
        }
    }
}
