//! Real-node suites that run side by side (tests/run.sh: the 1.20 node's
//! and, under `tests/k8s/isolated.sh`, the 1.37 node's) keep their
//! load-sensitive figures apart from each other's heavy phases. The sim's
//! device time is host CPU, so a share's achieved percent falls when the
//! host is loaded: a 70 % share got 55 % beside the other suite's 200-pod
//! phase at load average 18 (tests/soak.md, 2026-12-07).
//!
//! One `flock` on a file both namespaces see (`isolated.sh` keeps `/tmp`
//! shared, only the machine lock is private): a heavy phase holds it
//! shared (heavy phases may overlap), a measurement exclusive (it waits
//! out every heavy phase and every other measurement, and holds new heavy
//! phases off while it measures).

use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;

use super::util::wait;

const PATH: &str = "/tmp/vcuda-host-load.lock";
/// The longest a phase waits for the other suite's: a 200-pod phase and
/// its teardown took ~8 min on this machine's slowest runs.
const WAIT_S: u64 = 1200;

/// Held while it lives; released on drop (the fd closes).
pub struct HostLoad {
    _file: fs::File,
}

impl HostLoad {
    /// For a phase that loads the host (hundreds of pods, extra nodes).
    pub fn heavy(what: &str) -> HostLoad {
        HostLoad::take(Path::new(PATH), libc::LOCK_SH, what)
    }

    /// For a figure timed on the sim's device, which host load moves.
    pub fn measure(what: &str) -> HostLoad {
        HostLoad::take(Path::new(PATH), libc::LOCK_EX, what)
    }

    fn take(path: &Path, kind: libc::c_int, what: &str) -> HostLoad {
        let f = open(path);
        let t0 = std::time::Instant::now();
        let why = format!(
            "{} for {what} (another real-node suite's heavy phase or measurement holds it)",
            path.display()
        );
        wait(&why, WAIT_S, || {
            if try_lock(&f, kind) {
                Ok(())
            } else {
                Err("held".into())
            }
        });
        let waited = t0.elapsed().as_secs_f64();
        if waited >= 1.0 {
            eprintln!("host load lock for {what}: waited {waited:.0} s for the other suite");
        }
        HostLoad { _file: f }
    }
}

/// The lock file at `path`, created if missing (also the machine lock's).
pub(crate) fn open(path: &Path) -> fs::File {
    fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whether a lock of `kind` on `f` can be taken now (taken if so).
pub(crate) fn try_lock(f: &fs::File, kind: libc::c_int) -> bool {
    // SAFETY: a valid open fd.
    unsafe { libc::flock(f.as_raw_fd(), kind | libc::LOCK_NB) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule the suites rely on, on a real file: two heavy phases
    /// share it, a measurement excludes them and they it.
    #[test]
    fn heavy_phases_share_and_a_measurement_excludes_them() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("load.lock");
        let heavy = |w| HostLoad::take(&path, libc::LOCK_SH, w);
        let (a, b) = (heavy("a"), heavy("b"));
        let other = open(&path);
        assert!(
            !try_lock(&other, libc::LOCK_EX),
            "measured under heavy phases"
        );
        drop((a, b));
        assert!(try_lock(&other, libc::LOCK_EX), "heavy phases ended");
        drop(other);
        let m = HostLoad::take(&path, libc::LOCK_EX, "m");
        assert!(
            !try_lock(&open(&path), libc::LOCK_SH),
            "heavy while measuring"
        );
        drop(m);
        assert!(try_lock(&open(&path), libc::LOCK_SH), "measurement ended");
    }
}
