//! One manager at a time owns a node's state: the checkpoint, the vm
//! directories, the releases. A rolling update with surge starts the new
//! manager while the old one still serves; the new one registers its
//! plugins under its own socket names at once (kubelet then sends it every
//! call) but holds Allocate and PreStartContainer until the old one has
//! stopped and it has read the state the old one left. Ownership is an
//! `flock` on `<checkpoint dir>/owner.lock` held for the owner's life, so a
//! manager killed with -9 gives it up too.
//!
//! A waiting manager names itself in `<checkpoint dir>/successor`, so the
//! owner, stopping, knows that the node's vcuda resources stay served and
//! leaves the node's allocatable alone ([`crate::decide::node_status`]).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

const LOCK_FILE: &str = "owner.lock";
const SUCCESSOR_FILE: &str = "successor";
/// How often a waiting manager tries the lock: its Allocate calls wait
/// for this at most after the owner stopped.
const POLL: Duration = Duration::from_millis(25);

/// The node's state is this process's while it lives.
#[derive(Debug)]
pub struct Owner {
    _lock: File,
}

/// What [`claim`] found.
#[derive(Debug)]
pub enum Claim {
    Owned(Owner),
    /// Another manager owns the state; what it wrote about itself.
    HeldBy(String),
}

fn lock_path(dir: &Path) -> PathBuf {
    dir.join(LOCK_FILE)
}

/// A manager of an earlier version (no lock, fixed socket names) serving
/// beside this one: it owns the state until it stops.
fn earlier_manager(device_plugin_dir: &Path) -> Option<String> {
    [
        node_agent::mode::VCORE_SOCKET,
        node_agent::mode::VMEMORY_SOCKET,
    ]
    .iter()
    .map(|s| device_plugin_dir.join(s))
    .find(|p| node_agent::mode::serving(p))
    .map(|p| {
        format!(
            "a gpu-manager of an earlier version serving on {}",
            p.display()
        )
    })
}

/// Takes the ownership if nobody holds it.
pub fn claim(dir: &Path, device_plugin_dir: &Path, instance: &str) -> std::io::Result<Claim> {
    if let Some(who) = earlier_manager(device_plugin_dir) {
        return Ok(Claim::HeldBy(who));
    }
    std::fs::create_dir_all(dir)?;
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(lock_path(dir))?;
    match f.try_lock() {
        Ok(()) => {
            f.set_len(0)?;
            f.rewind()?;
            writeln!(
                f,
                "gpu-manager instance {instance} (pid {} in its PID namespace)",
                std::process::id()
            )?;
            Ok(Claim::Owned(Owner { _lock: f }))
        }
        Err(TryLockError::WouldBlock) => {
            let mut who = String::new();
            let _ = f.read_to_string(&mut who);
            let who = who.trim();
            Ok(Claim::HeldBy(if who.is_empty() {
                "another gpu-manager".into()
            } else {
                who.to_string()
            }))
        }
        Err(TryLockError::Error(e)) => Err(e),
    }
}

/// Waits until the owner is gone and takes the ownership; `None` when
/// cancelled first. Logs who it waits for, at once and every 10 s.
pub async fn wait(
    dir: &Path,
    device_plugin_dir: &Path,
    instance: &str,
    cancel: &CancellationToken,
) -> Option<Owner> {
    let mut told: Option<Instant> = None;
    loop {
        match claim(dir, device_plugin_dir, instance) {
            Ok(Claim::Owned(o)) => return Some(o),
            Ok(Claim::HeldBy(who)) => {
                if told.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    tracing::info!(owner = %who, lock = %lock_path(dir).display(), "waiting for the node's previous manager to stop; Allocate and PreStartContainer wait until then");
                    told = Some(Instant::now());
                }
            }
            Err(e) => {
                tracing::error!(lock = %lock_path(dir).display(), error = %e, "cannot take the ownership lock; retrying")
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep(POLL) => {}
        }
    }
}

/// Names this instance as the one taking over, with the plugin sockets that
/// show it alive and the inbox where the owner hands it kubelet's
/// connections ([`crate::lifecycle::handover`]). Not fsynced: a note lost in a crash
/// names no live manager anyway.
pub fn announce(
    dir: &Path,
    instance: &str,
    sockets: &[PathBuf],
    inbox: &Path,
) -> Result<(), quota_config::IoError> {
    let mut text = format!("{instance}\ninbox {}\n", inbox.display());
    for s in sockets {
        text.push_str(&format!("{}\n", s.display()));
    }
    quota_config::write_atomic(
        &dir.join(SUCCESSOR_FILE),
        text.as_bytes(),
        0o644,
        quota_config::Durability::Derived,
    )
}

/// Removes the successor note if it is still this instance's.
pub fn withdraw(dir: &Path, instance: &str) {
    if read_successor(dir).is_some_and(|s| s.instance == instance) {
        let _ = std::fs::remove_file(dir.join(SUCCESSOR_FILE));
    }
}

fn read_successor(dir: &Path) -> Option<Successor> {
    let text = std::fs::read_to_string(dir.join(SUCCESSOR_FILE)).ok()?;
    let mut lines = text.lines();
    let instance = lines.next()?.to_string();
    let (mut sockets, mut inbox) = (Vec::new(), None);
    for l in lines {
        match l.strip_prefix("inbox ") {
            Some(p) => inbox = Some(PathBuf::from(p)),
            None => sockets.push(PathBuf::from(l)),
        }
    }
    Some(Successor {
        instance,
        sockets,
        inbox,
    })
}

/// A manager waiting to take over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Successor {
    pub instance: String,
    pub sockets: Vec<PathBuf>,
    /// Where it takes kubelet's connections ([`crate::lifecycle::handover`]).
    pub inbox: Option<PathBuf>,
}

impl Successor {
    /// Whether it still runs: one of its plugin sockets accepts connections.
    pub fn alive(&self) -> bool {
        self.sockets.iter().any(|s| node_agent::mode::serving(s))
    }
}

/// The instance waiting to take over from `me`, if one is there and alive
/// (a note left by a manager that died is not one).
pub fn successor(dir: &Path, me: &str) -> Option<Successor> {
    let s = read_successor(dir)?;
    (s.instance != me && s.alive()).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_owner_at_a_time_and_the_next_takes_over() {
        let tmp = tempfile::tempdir().unwrap();
        let Claim::Owned(first) = claim(tmp.path(), tmp.path(), "a").unwrap() else {
            panic!("a free lock was not taken")
        };
        // flock is per open file: a second open in this process is refused
        // like another process.
        match claim(tmp.path(), tmp.path(), "b").unwrap() {
            Claim::HeldBy(who) => assert!(who.contains("instance a"), "{who}"),
            Claim::Owned(_) => panic!("two owners"),
        }
        drop(first);
        // A manager of an earlier version takes no lock: its live socket
        // holds the state.
        let legacy =
            std::os::unix::net::UnixListener::bind(tmp.path().join(node_agent::mode::VCORE_SOCKET))
                .unwrap();
        match claim(tmp.path(), tmp.path(), "b").unwrap() {
            Claim::HeldBy(who) => assert!(who.contains("earlier version"), "{who}"),
            Claim::Owned(_) => panic!("owned beside an earlier manager"),
        }
        drop(legacy);
        assert!(matches!(
            claim(tmp.path(), tmp.path(), "b").unwrap(),
            Claim::Owned(_)
        ));
    }

    #[tokio::test]
    async fn a_waiting_manager_takes_over_once_the_owner_is_gone() {
        let tmp = tempfile::tempdir().unwrap();
        let Claim::Owned(first) = claim(tmp.path(), tmp.path(), "a").unwrap() else {
            panic!()
        };
        let dir = tmp.path().to_path_buf();
        let waiter = tokio::spawn(async move {
            wait(&dir, &dir, "b", &CancellationToken::new())
                .await
                .is_some()
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished(), "took over from a live owner");
        drop(first);
        assert!(waiter.await.unwrap());
        let cancel = CancellationToken::new();
        cancel.cancel();
        let Claim::Owned(_held) = claim(tmp.path(), tmp.path(), "c").unwrap() else {
            panic!()
        };
        assert!(wait(tmp.path(), tmp.path(), "d", &cancel).await.is_none());
    }

    #[test]
    fn a_successor_counts_only_while_its_socket_serves() {
        let tmp = tempfile::tempdir().unwrap();
        let sock = tmp.path().join("vcore-b.sock");
        let inbox = tmp.path().join("inbox-b.sock");
        announce(tmp.path(), "b", std::slice::from_ref(&sock), &inbox).unwrap();
        assert_eq!(successor(tmp.path(), "a"), None, "nothing listens");
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let b = successor(tmp.path(), "a").unwrap();
        assert_eq!((b.instance.as_str(), b.inbox.as_ref()), ("b", Some(&inbox)));
        assert_eq!(successor(tmp.path(), "b"), None, "not its own successor");
        withdraw(tmp.path(), "c");
        assert!(successor(tmp.path(), "a").is_some(), "another's note stays");
        withdraw(tmp.path(), "b");
        assert_eq!(successor(tmp.path(), "a"), None);
        drop(l);
    }
}
