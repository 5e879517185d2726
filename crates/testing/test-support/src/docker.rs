//! The private Docker engine tests/run.sh starts (tests/docker/engine.sh).

use crate::require::{Capability, missing};
use std::path::Path;

/// The private Docker engine started by `tests/run.sh` (tests/docker/engine.sh).
pub struct Docker {
    /// Value for DOCKER_HOST.
    pub host: String,
    pub image: String,
}

impl Docker {
    /// The engine, if one answers; otherwise [`missing`] says so (which
    /// fails the test where [`Capability::Docker`] is required).
    #[track_caller]
    pub fn get() -> Option<Docker> {
        match probe() {
            Ok(d) => Some(d),
            Err(detail) => {
                missing(Capability::Docker, &detail);
                None
            }
        }
    }

    /// A Docker CLI command aimed at this engine (Debian's client, matching
    /// Debian's engine, when present).
    pub fn command(&self) -> std::process::Command {
        let bin = if Path::new("/usr/bin/docker").exists() {
            "/usr/bin/docker"
        } else {
            "docker"
        };
        let mut c = std::process::Command::new(bin);
        c.env("DOCKER_HOST", &self.host);
        c
    }

    /// Runs the Docker CLI with `args`.
    pub fn cli(&self, args: &[&str]) -> std::io::Result<std::process::Output> {
        self.command().args(args).output()
    }

    /// Like [`cli`](Self::cli), panicking with the CLI's stderr on failure.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args).expect("docker cli");
        assert!(
            out.status.success(),
            "docker {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Bind mounts that give a busybox container the host's glibc, so
    /// programs built here (and the driver libraries) run inside it.
    pub fn glibc_mounts() -> Vec<String> {
        let mut v = Vec::new();
        for (host, ctr) in [
            ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"),
            ("/usr/lib64", "/lib64"),
        ] {
            if Path::new(host).exists() {
                v.push("-v".into());
                v.push(format!("{host}:{ctr}:ro"));
            }
        }
        v
    }
}

/// The engine at `DOCKER_HOST` if it answers `docker info`, else what is wrong.
pub(crate) fn probe() -> Result<Docker, String> {
    let host = std::env::var("DOCKER_HOST").unwrap_or_default();
    let image =
        std::env::var("VCUDA_TEST_IMAGE").unwrap_or_else(|_| "vcuda-test/busybox:latest".into());
    let d = Docker { host, image };
    if d.host.is_empty() {
        return Err("DOCKER_HOST is unset".into());
    }
    match d.cli(&["info"]) {
        Ok(o) if o.status.success() => Ok(d),
        Ok(o) => Err(format!(
            "no Docker engine answers at DOCKER_HOST={:?}: {}",
            d.host,
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("docker info: {e}")),
    }
}
