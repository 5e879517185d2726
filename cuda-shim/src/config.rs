//! What this process must enforce, from the container's `vcuda.config`.
//!
//! The interposer is only ever installed into shared containers (whole-GPU
//! containers get the untouched driver), so a missing or unreadable quota
//! file means something is wrong: fail closed, never run unlimited.

use quota_config::{CONFIG_FILE, CONTAINER_DIR, ResourceData};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// Overrides the container directory (default `/etc/vcuda`).
pub const CONFIG_DIR_ENV: &str = "VCUDA_CONFIG_DIR";
/// How long cuInit waits for the manager's socket, in milliseconds.
pub const REGISTER_TIMEOUT_ENV: &str = "VCUDA_REGISTER_TIMEOUT_MS";
/// Default of [`REGISTER_TIMEOUT_ENV`].
pub const DEFAULT_REGISTER_TIMEOUT_MS: u64 = 2000;

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
    pub data: ResourceData,
    pub dir: PathBuf,
}

impl Enforce {
    /// How many GPUs the container's share spans (ledgers it registers for).
    pub fn gpus(&self) -> usize {
        1
    }
}

/// Set once the mode is Enforce: the launch path reads only this.
pub static ENFORCING: AtomicBool = AtomicBool::new(false);

pub fn config_dir() -> PathBuf {
    std::env::var_os(CONFIG_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(CONTAINER_DIR))
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
        Mode::Enforce(e) => format!(
            "enforcing {} bytes, {}% compute, GPU {}",
            e.data.gpu_memory, e.data.utilization, e.data.bus_id
        ),
        Mode::Closed(r) => format!("closed: {r}"),
    }
}

pub fn decide(dir: &Path) -> Mode {
    let path = dir.join(CONFIG_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) => {
            return Mode::Closed(format!(
                "no GPU quota for this container: cannot read {}: {e}; \
                 the GPU manager writes it when the container is allocated \
                 (refusing CUDA rather than running without limits)",
                path.display()
            ));
        }
    };
    match ResourceData::from_bytes(&bytes) {
        Err(e) => Mode::Closed(format!(
            "GPU quota file {} is corrupt ({e}); refusing CUDA",
            path.display()
        )),
        Ok(d) if !d.enable => Mode::PassThrough,
        Ok(d) => Mode::Enforce(Box::new(Enforce {
            data: d,
            dir: dir.to_path_buf(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
