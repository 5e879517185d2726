//! What both modes' uninstall (`gpu-manager uninstall`, `vcuda-dra-driver
//! uninstall`) shares: shares in use on a node (a vm directory
//! `<vm>/<pod or claim>/<slot>` whose `pids.config` lists a live host PID;
//! the node agents run with hostPID), waiting until nothing blocks, and
//! removing what a mode left.

use std::path::{Path, PathBuf};

/// A share still in use: its vm directory and its live host PIDs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InUse {
    pub dir: PathBuf,
    pub pids: Vec<i32>,
}

/// Vm directories (`<vm>/<pod uid>/<container>`) with a live process.
pub fn in_use(vm: &Path, alive: impl Fn(i32) -> bool) -> Vec<InUse> {
    let mut out = Vec::new();
    for pod in read_dirs(vm) {
        for dir in read_dirs(&pod) {
            let pids = std::fs::read(dir.join(quota_config::PIDS_FILE))
                .ok()
                .and_then(|b| quota_config::decode_pids(&b).ok())
                .unwrap_or_default();
            let live: Vec<i32> = pids.into_iter().filter(|&p| alive(p)).collect();
            if !live.is_empty() {
                out.push(InUse { dir, pids: live });
            }
        }
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    out
}

fn read_dirs(p: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

/// Whether host PID `pid` is alive (the manager shares the host's PID
/// namespace).
pub fn alive(pid: i32) -> bool {
    pid > 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// Why the shares under `vm` block an uninstall, naming them; `None` when
/// none is in use.
pub fn shares_in_use(vm: &Path) -> Option<String> {
    let busy = in_use(vm, alive);
    if busy.is_empty() {
        return None;
    }
    let names: Vec<String> = busy
        .iter()
        .map(|u| format!("{} (PIDs {:?})", u.dir.display(), u.pids))
        .collect();
    Some(format!(
        "{} share(s) still in use: {}; delete their pods",
        busy.len(),
        names.join(", ")
    ))
}

/// What an uninstall did.
#[derive(Debug)]
pub struct Uninstalled {
    /// The host paths removed.
    pub removed: Vec<PathBuf>,
    /// What became of the node's record in the cluster (an annotation, a
    /// ResourceSlice), as the mode says it.
    pub cluster: String,
}

/// The one uninstall flow of both modes: waits (asking `blockers` every
/// `retry`) until nothing uses the node's state, then `remove`s it, then
/// `forget`s the node's record in the cluster. Cancelled first: `None`.
/// A removal that fails stops there: the record stays for the next try.
pub async fn uninstall(
    blockers: impl Fn() -> Vec<String>,
    remove: impl FnOnce() -> Result<Vec<PathBuf>, RemoveError>,
    forget: impl std::future::Future<Output = String>,
    retry: std::time::Duration,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<Option<Uninstalled>, RemoveError> {
    if !wait_until_clear(blockers, retry, cancel).await {
        return Ok(None);
    }
    let removed = remove()?;
    let cluster = forget.await;
    Ok(Some(Uninstalled { removed, cluster }))
}

/// Waits, asking `blockers` every `retry` and saying what they name, until
/// it names nothing (true) or `cancel` comes first (false).
pub async fn wait_until_clear(
    blockers: impl Fn() -> Vec<String>,
    retry: std::time::Duration,
    cancel: &tokio_util::sync::CancellationToken,
) -> bool {
    loop {
        let b = blockers();
        if b.is_empty() {
            return true;
        }
        tracing::warn!(
            "not uninstalling yet: {}; checking again every {} s",
            b.join("; "),
            retry.as_secs()
        );
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = cancel.cancelled() => return false,
        }
    }
}

/// A path an uninstall could not remove.
#[derive(Debug, thiserror::Error)]
#[error("removing {}: {source}", path.display())]
pub struct RemoveError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Removes each path that exists (a directory recursively); returns those
/// removed, or the first failure naming its path.
pub fn remove_paths(
    targets: impl IntoIterator<Item = PathBuf>,
) -> Result<Vec<PathBuf>, RemoveError> {
    let mut removed = Vec::new();
    for t in targets {
        let r = match std::fs::symlink_metadata(&t) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => Err(e),
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&t),
            Ok(_) => std::fs::remove_file(&t),
        };
        r.map_err(|source| RemoveError {
            path: t.clone(),
            source,
        })?;
        removed.push(t);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_with_a_live_process_is_in_use_and_a_dead_one_is_not() {
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join("pod-a/main");
        let dead = d.path().join("pod-b/main");
        let empty = d.path().join("pod-c/main");
        for p in [&live, &dead, &empty] {
            std::fs::create_dir_all(p).unwrap();
        }
        let me = std::process::id() as i32;
        std::fs::write(live.join("pids.config"), quota_config::encode_pids(&[me])).unwrap();
        std::fs::write(
            dead.join("pids.config"),
            quota_config::encode_pids(&[i32::MAX]),
        )
        .unwrap();
        assert_eq!(
            in_use(d.path(), alive),
            vec![InUse {
                dir: live,
                pids: vec![me]
            }]
        );
        assert!(in_use(&d.path().join("missing"), alive).is_empty());
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn uninstall_waits_for_the_blockers_then_removes_then_forgets() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("vm");
        std::fs::create_dir_all(state.join("pod/c")).unwrap();
        let asked = std::cell::Cell::new(0);
        let blockers = || {
            asked.set(asked.get() + 1);
            if asked.get() < 3 {
                vec!["a share is in use".to_string()]
            } else {
                vec![]
            }
        };
        let cancel = tokio_util::sync::CancellationToken::new();
        let done = rt()
            .block_on(uninstall(
                blockers,
                || remove_paths([state.clone(), d.path().join("absent")]),
                async { "record forgotten".to_string() },
                std::time::Duration::from_millis(1),
                &cancel,
            ))
            .unwrap()
            .unwrap();
        assert_eq!(asked.get(), 3);
        assert_eq!(done.removed, vec![state.clone()]);
        assert_eq!(done.cluster, "record forgotten");
        assert!(!state.exists());
    }

    #[test]
    fn a_cancelled_uninstall_removes_nothing_and_forgets_nothing() {
        let d = tempfile::tempdir().unwrap();
        let cancel = tokio_util::sync::CancellationToken::new();
        cancel.cancel();
        let forgot = std::cell::Cell::new(false);
        let r = rt()
            .block_on(uninstall(
                || vec!["in use".to_string()],
                || remove_paths([d.path().to_path_buf()]),
                async {
                    forgot.set(true);
                    String::new()
                },
                std::time::Duration::from_secs(60),
                &cancel,
            ))
            .unwrap();
        assert!(r.is_none());
        assert!(d.path().exists() && !forgot.get());
    }

    #[test]
    fn a_removal_that_fails_names_the_path_and_leaves_the_record() {
        let forgot = std::cell::Cell::new(false);
        let cancel = tokio_util::sync::CancellationToken::new();
        let e = rt()
            .block_on(uninstall(
                Vec::new,
                || {
                    Err(RemoveError {
                        path: "/x/vm".into(),
                        source: std::io::Error::from_raw_os_error(libc::EBUSY),
                    })
                },
                async {
                    forgot.set(true);
                    String::new()
                },
                std::time::Duration::from_secs(1),
                &cancel,
            ))
            .unwrap_err();
        assert!(e.to_string().starts_with("removing /x/vm: "), "{e}");
        assert!(!forgot.get());
    }
}
