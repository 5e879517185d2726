//! A node runs one mode: the device plugins (`gpu-manager`) or the DRA
//! driver (`vcuda-dra-driver`). Both would hand the same GPUs out twice, so
//! each refuses to start while the other's kubelet socket accepts
//! connections; a stale socket file (the other was killed) does not count.
//! One being replaced keeps serving while it stops (a manager drains up to
//! about 5 s while pods bound to the node await admission), so a daemon
//! started as the other's DaemonSet goes waits [`OTHER_MODE_PATIENCE`]
//! for its sockets to close before it refuses.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a daemon waits for the other mode's sockets to close.
pub const OTHER_MODE_PATIENCE: Duration = Duration::from_secs(15);

/// The DRA driver's registration socket in the kubelet's `plugins_registry`
/// before instances named theirs ([`dra_registration_socket`]); still
/// matched, so a node upgraded from it is seen.
pub const DRA_REGISTRATION_SOCKET: &str = "vcuda.tencent.com-reg.sock";
const DRA_REGISTRATION_PREFIX: &str = "vcuda.tencent.com-";
const DRA_REGISTRATION_SUFFIX: &str = "reg.sock";

/// The registration socket of one driver instance: each process start has
/// its own, so the kubelet (which keys plugins by endpoint) never confuses
/// a restarted driver with the one it replaces.
pub fn dra_registration_socket(instance: &str) -> String {
    format!("{DRA_REGISTRATION_PREFIX}{instance}-{DRA_REGISTRATION_SUFFIX}")
}

/// Whether `name` (a file in `plugins_registry`) is a vcuda DRA driver's
/// registration socket, of any instance.
pub fn is_dra_registration_socket(name: &str) -> bool {
    name.starts_with(DRA_REGISTRATION_PREFIX) && name.ends_with(DRA_REGISTRATION_SUFFIX)
}

/// Every vcuda DRA registration socket file in `registry_dir`, live or not.
pub fn dra_registration_sockets(registry_dir: &Path) -> Vec<PathBuf> {
    files_named(registry_dir, is_dra_registration_socket)
}

/// The files in `dir` whose name satisfies `named`, sorted.
fn files_named(dir: &Path, named: fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| named(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}
/// The device plugins' sockets in the kubelet's `device-plugins` directory
/// before each manager start named its own ([`device_plugin_socket`]);
/// still matched, so a node upgraded from them is seen.
pub const VCORE_SOCKET: &str = "vcore.sock";
pub const VMEMORY_SOCKET: &str = "vmemory.sock";
const DEVICE_PLUGIN_STEMS: [&str; 2] = ["vcore", "vmemory"];

/// A name no other process start on this node has: start time (ms), PID
/// and a counter for several instances in one process (tests).
pub fn instance_id() -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{ms}-{}-{n}", std::process::id())
}

/// One manager instance's socket for `legacy` ([`VCORE_SOCKET`] or
/// [`VMEMORY_SOCKET`]): `vcore-<instance>.sock`. Its own names let a new
/// manager register beside the one it replaces (a rolling update with
/// surge) without either removing the other's socket.
pub fn device_plugin_socket(legacy: &str, instance: &str) -> String {
    let stem = legacy.strip_suffix(".sock").unwrap_or(legacy);
    format!("{stem}-{instance}.sock")
}

/// Whether `name` (a file in `device-plugins`) is a manager's plugin
/// socket, of any instance or of the fixed names of old.
pub fn is_device_plugin_socket(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".sock") else {
        return false;
    };
    let instance_of = |s: &str| {
        stem.strip_prefix(s)
            .and_then(|r| r.strip_prefix('-'))
            .is_some_and(|inst| inst.starts_with(|c: char| c.is_ascii_digit()))
    };
    DEVICE_PLUGIN_STEMS
        .iter()
        .any(|s| stem == *s || instance_of(s))
        || stem
            .strip_prefix(MIG_STEM)
            .and_then(|r| r.split_once('-'))
            .is_some_and(|(_, inst)| inst.starts_with(|c: char| c.is_ascii_digit()))
}

/// MIG plugins' sockets: `vcuda-mig-<profile>-<instance>.sock`.
const MIG_STEM: &str = "vcuda-mig-";

/// One manager instance's socket for MIG `profile`'s plugin.
pub fn mig_plugin_socket(profile: &str, instance: &str) -> String {
    format!("{MIG_STEM}{}-{instance}.sock", profile.replace('+', "."))
}

/// Every manager plugin socket file in `device_plugin_dir`, live or not.
pub fn device_plugin_sockets(device_plugin_dir: &Path) -> Vec<PathBuf> {
    files_named(device_plugin_dir, is_device_plugin_socket)
}

/// Whether something accepts connections on `sock`.
pub fn serving(sock: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(sock).is_ok()
}

/// The kubelet's `plugins_registry` beside its device-plugin directory
/// (`/var/lib/kubelet/device-plugins` → `.../plugins_registry`).
pub fn registry_beside(device_plugin_dir: &Path) -> PathBuf {
    device_plugin_dir
        .parent()
        .unwrap_or(Path::new("/"))
        .join("plugins_registry")
}

/// The kubelet's `device-plugins` beside its `plugins_registry`.
pub fn device_plugins_beside(registry_dir: &Path) -> PathBuf {
    registry_dir
        .parent()
        .unwrap_or(Path::new("/"))
        .join("device-plugins")
}

/// For the manager: an error naming the live DRA driver's socket.
pub fn refuse_if_dra_serving(device_plugin_dir: &Path) -> Result<(), String> {
    for s in dra_registration_sockets(&registry_beside(device_plugin_dir)) {
        if serving(&s) {
            return Err(format!(
                "the vcuda DRA driver is serving on this node ({} accepts connections): a node runs one mode, device plugins or DRA; stop vcuda-dra-driver first",
                s.display()
            ));
        }
    }
    Ok(())
}

/// For the DRA driver: an error naming the manager's live plugin socket.
pub fn refuse_if_device_plugins_serving(registry_dir: &Path) -> Result<(), String> {
    for s in device_plugin_sockets(&device_plugins_beside(registry_dir)) {
        if serving(&s) {
            return Err(format!(
                "gpu-manager's device plugins are serving on this node ({} accepts connections): a node runs one mode, device plugins or DRA; stop gpu-manager first",
                s.display()
            ));
        }
    }
    Ok(())
}

/// `check` (one of the two `refuse_if_*`) until it passes (`Ok(true)`),
/// `cancel` fires (`Ok(false)`: a SIGTERM during the wait stops the daemon
/// at once, not after the patience) or `patience` ran out: then its error,
/// saying how long it waited. Logs once that it waits.
pub async fn await_other_mode_stopped(
    check: impl Fn() -> Result<(), String>,
    patience: Duration,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<bool, String> {
    let t0 = Instant::now();
    let mut logged = false;
    loop {
        let Err(e) = check() else { return Ok(true) };
        if t0.elapsed() >= patience {
            return Err(format!(
                "{e} (still serving after {:.1} s)",
                patience.as_secs_f64()
            ));
        }
        if !logged {
            tracing::warn!(error = %e, patience_s = patience.as_secs(), "the other mode's daemon still serves here: waiting for it to stop");
            logged = true;
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(false),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_plugin_sockets_are_the_managers() {
        let name = mig_plugin_socket("1g.10gb+me", "1764245000000-42-0");
        assert_eq!(name, "vcuda-mig-1g.10gb.me-1764245000000-42-0.sock");
        assert!(is_device_plugin_socket(&name));
        assert!(is_device_plugin_socket(&mig_plugin_socket(
            "3g.40gb", "17-1-0"
        )));
        assert!(!is_device_plugin_socket("vcuda-mig-3g.40gb.sock"));
        assert!(!is_device_plugin_socket("nvidia-mig-3g.40gb-17-1-0.sock"));
    }

    #[tokio::test]
    async fn a_daemon_waits_for_the_other_mode_to_stop_then_refuses() {
        let tmp = tempfile::tempdir().unwrap();
        let (dp, reg) = (
            tmp.path().join("device-plugins"),
            tmp.path().join("plugins_registry"),
        );
        std::fs::create_dir_all(&dp).unwrap();
        let name = device_plugin_socket(VCORE_SOCKET, "17-1-0");
        let stopping = std::os::unix::net::UnixListener::bind(dp.join(&name)).unwrap();
        // A manager that stops 300 ms into the wait: the driver starts.
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(stopping);
        });
        let t0 = Instant::now();
        let check = || refuse_if_device_plugins_serving(&reg);
        let cancel = tokio_util::sync::CancellationToken::new();
        assert_eq!(
            await_other_mode_stopped(check, Duration::from_secs(10), &cancel).await,
            Ok(true)
        );
        assert!(t0.elapsed() >= Duration::from_millis(300));
        closer.join().unwrap();
        // One that keeps serving: refused once the patience ran out.
        std::fs::remove_file(dp.join(&name)).unwrap();
        let _live = std::os::unix::net::UnixListener::bind(dp.join(&name)).unwrap();
        let e = await_other_mode_stopped(check, Duration::from_millis(400), &cancel)
            .await
            .unwrap_err();
        assert!(
            e.contains(&format!("{name} accepts connections")) && e.contains("after 0.4 s"),
            "{e}"
        );
        // Told to stop while it waits: at once, neither refused nor started.
        let stop = cancel.clone();
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            stop.cancel();
        });
        let t0 = Instant::now();
        let r = await_other_mode_stopped(check, Duration::from_secs(30), &cancel).await;
        assert_eq!(r, Ok(false));
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        stopper.join().unwrap();
    }

    #[test]
    fn a_live_socket_refuses_a_stale_one_does_not() {
        let tmp = tempfile::tempdir().unwrap();
        let (dp, reg) = (
            tmp.path().join("device-plugins"),
            tmp.path().join("plugins_registry"),
        );
        std::fs::create_dir_all(&dp).unwrap();
        std::fs::create_dir_all(&reg).unwrap();
        assert_eq!(refuse_if_dra_serving(&dp), Ok(()));
        assert_eq!(refuse_if_device_plugins_serving(&reg), Ok(()));

        let dra =
            std::os::unix::net::UnixListener::bind(reg.join(DRA_REGISTRATION_SOCKET)).unwrap();
        let e = refuse_if_dra_serving(&dp).unwrap_err();
        assert!(
            e.contains("vcuda.tencent.com-reg.sock accepts connections"),
            "{e}"
        );
        drop(dra); // the file stays, nobody listens: stale
        assert_eq!(refuse_if_dra_serving(&dp), Ok(()));
        // An instance's own name is seen as well; another driver's is not.
        let name = dra_registration_socket("1764245000000-42");
        assert_eq!(name, "vcuda.tencent.com-1764245000000-42-reg.sock");
        let _other = std::os::unix::net::UnixListener::bind(reg.join("gpu.nvidia.com-reg.sock"));
        assert_eq!(refuse_if_dra_serving(&dp), Ok(()));
        let _inst = std::os::unix::net::UnixListener::bind(reg.join(&name)).unwrap();
        let e = refuse_if_dra_serving(&dp).unwrap_err();
        assert!(e.contains(&name), "{e}");
        drop(_inst);

        let vmem = std::os::unix::net::UnixListener::bind(dp.join(VMEMORY_SOCKET)).unwrap();
        let e = refuse_if_device_plugins_serving(&reg).unwrap_err();
        assert!(e.contains("vmemory.sock accepts connections"), "{e}");
        drop(vmem);
        // An instance's own name is seen too; another plugin's is not.
        let name = device_plugin_socket(VCORE_SOCKET, "1764245000000-42-0");
        assert_eq!(name, "vcore-1764245000000-42-0.sock");
        let _nv = std::os::unix::net::UnixListener::bind(dp.join("nvidia-gpu.sock")).unwrap();
        let _kl = std::os::unix::net::UnixListener::bind(dp.join("vcore-x.sock")).unwrap();
        assert_eq!(refuse_if_device_plugins_serving(&reg), Ok(()));
        let _inst = std::os::unix::net::UnixListener::bind(dp.join(&name)).unwrap();
        let e = refuse_if_device_plugins_serving(&reg).unwrap_err();
        assert!(e.contains(&name), "{e}");
    }
}
