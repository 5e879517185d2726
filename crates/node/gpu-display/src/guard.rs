//! Escapes, seen from outside the process.
//!
//! Enforcement is in the process: a program that loads the real driver by
//! path, brings a driver of its own or issues ioctls is not limited by the
//! interposer, and nothing inside the process would say so. The sampler
//! already asks NVML, every period, which host PIDs use which GPU and how
//! much memory. So after each sample the guard attributes every GPU
//! process to its container — the registered PIDs of each share, and for
//! the rest the directory the process sees at `/etc/vcuda`, which is the
//! share's vm directory bind-mounted by the runtime (compared by device
//! and inode through `/proc/<pid>/root`) — and finds:
//!
//! * a process in a share container that never registered
//!   ([`Reason::Unregistered`]): under [`Policy::Kill`] it is ended;
//! * a share whose processes hold more than its memory quota on NVML's
//!   count ([`Reason::OverQuota`]): under [`Policy::Kill`] its largest
//!   process is ended, and the next largest each sample it stays over
//!   (registered ones too: a tenant that zeroed its ledger's counters is
//!   registered); under `report`, reported only, as NVML's count includes
//!   what the driver adds.
//!
//! Each finding is logged, counted (`vcuda_container_escapes_total`) and
//! handed to the daemon's hook (an Event on the pod) once: a process once,
//! an over-quota container once per excursion.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use crate::metrics::ManagerMetrics;
use crate::sampler::Snapshot;
use crate::source::ContainerView;

/// What to do with a process in a share that never registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Log, count, tell the pod (an Event).
    #[default]
    Report,
    /// As `Report`, and end the process (SIGKILL).
    Kill,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "report" => Ok(Policy::Report),
            "kill" => Ok(Policy::Kill),
            other => Err(format!(
                "escape policy {other:?}: expected \"report\" or \"kill\""
            )),
        }
    }
}

/// Why a container was reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    Unregistered,
    OverQuota,
}

impl Reason {
    /// The metric label and the Event reason's suffix.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Unregistered => "unregistered_process",
            Reason::OverQuota => "over_memory_quota",
        }
    }
}

/// One thing the guard saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Index into the containers judged.
    pub container: usize,
    pub reason: Reason,
    /// The unregistered process (host PID); for [`Reason::OverQuota`], the
    /// container's process holding the most (the one `kill` ends, as the
    /// kernel's OOM killer picks the largest).
    pub pid: Option<u32>,
    /// Bytes NVML counts: the process's, or the container's in all.
    pub bytes: u64,
    /// The container's memory quota.
    pub quota: u64,
}

impl Finding {
    /// One line for the log and the Event.
    pub fn describe(&self) -> String {
        match self.reason {
            Reason::Unregistered => format!(
                "process {} uses the GPU ({} MiB) without the vcuda interposer: it never registered, so no quota limits it",
                self.pid.unwrap_or(0),
                self.bytes >> 20
            ),
            Reason::OverQuota => format!(
                "the container's processes hold {} MiB of GPU memory on NVML's count, over its {} MiB quota (the largest: process {})",
                self.bytes >> 20,
                self.quota >> 20,
                self.pid.unwrap_or(0)
            ),
        }
    }
}

/// NVML counts more than the ledger for the same allocations (the driver's
/// own reservations): a container is over its quota past this much more.
pub fn over_quota_slack(quota: u64) -> u64 {
    (quota / 20).max(64 << 20)
}

/// Findings over one sample. `share_of` names the container a process is
/// in by what it sees at `/etc/vcuda` (an index into `containers`), for
/// the processes no container registered.
pub fn judge(
    snap: &Snapshot,
    containers: &[ContainerView],
    share_of: impl Fn(u32) -> Option<usize>,
) -> Vec<Finding> {
    let registered: HashMap<u32, usize> = containers
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.exclusive)
        .flat_map(|(i, c)| c.host_pids.iter().map(move |&p| (p, i)))
        .collect();
    let mut held = vec![0u64; containers.len()];
    // Per container: its process holding the most, (bytes, pid).
    let mut largest = vec![None::<(u64, u32)>; containers.len()];
    let mut count = |c: usize, pid: u32, bytes: u64| {
        held[c] += bytes;
        largest[c] = largest[c].max(Some((bytes, pid)));
    };
    let mut out = Vec::new();
    for g in &snap.gpus {
        for (&pid, p) in &g.processes {
            if let Some(&c) = registered.get(&pid) {
                count(c, pid, p.memory_used_bytes);
                continue;
            }
            let Some(c) =
                share_of(pid).filter(|&c| c < containers.len() && !containers[c].exclusive)
            else {
                continue;
            };
            count(c, pid, p.memory_used_bytes);
            out.push(Finding {
                container: c,
                reason: Reason::Unregistered,
                pid: Some(pid),
                bytes: p.memory_used_bytes,
                quota: containers[c].memory_quota_bytes,
            });
        }
    }
    for (c, &bytes) in held.iter().enumerate() {
        let quota = containers[c].memory_quota_bytes;
        if !containers[c].exclusive && bytes > quota.saturating_add(over_quota_slack(quota)) {
            out.push(Finding {
                container: c,
                reason: Reason::OverQuota,
                pid: largest[c].map(|(_, pid)| pid),
                bytes,
                quota,
            });
        }
    }
    out
}

/// What the guard needs from the host; an in-memory double in tests.
pub trait World: Send + 'static {
    /// (device, inode) of what process `pid` sees at `/etc/vcuda`.
    fn quota_dir_of(&self, pid: u32) -> Option<(u64, u64)>;
    /// (device, inode) of a vm directory on the host.
    fn dir_id(&self, dir: &Path) -> Option<(u64, u64)>;
    /// Ends the process.
    fn kill(&self, pid: u32) -> std::io::Result<()>;
}

/// The host, through `/proc` (the daemons run with hostPID).
pub struct Host;

impl World for Host {
    fn quota_dir_of(&self, pid: u32) -> Option<(u64, u64)> {
        let m = std::fs::metadata(format!("/proc/{pid}/root/etc/vcuda")).ok()?;
        Some((m.dev(), m.ino()))
    }

    fn dir_id(&self, dir: &Path) -> Option<(u64, u64)> {
        let m = std::fs::metadata(dir).ok()?;
        Some((m.dev(), m.ino()))
    }

    fn kill(&self, pid: u32) -> std::io::Result<()> {
        // SAFETY: kill(2) with a PID NVML reported on a GPU; sends a signal.
        if unsafe { libc::kill(pid as i32, libc::SIGKILL) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Called once per new finding, with the container it is about (the
/// daemon posts an Event on the pod).
pub type Notify = Arc<dyn Fn(&ContainerView, &Finding) + Send + Sync>;

/// The guard: judges each sample and acts on what is new.
pub struct Guard<W: World> {
    world: W,
    policy: Policy,
    metrics: ManagerMetrics,
    notify: Option<Notify>,
    /// Processes already reported (dropped once NVML no longer lists them).
    seen_pids: HashSet<u32>,
    /// Containers (pod uid, container) over quota at the last sample.
    over: HashSet<(String, String)>,
}

impl<W: World> Guard<W> {
    pub fn new(world: W, policy: Policy, metrics: ManagerMetrics, notify: Option<Notify>) -> Self {
        Guard {
            world,
            policy,
            metrics,
            notify,
            seen_pids: HashSet::new(),
            over: HashSet::new(),
        }
    }

    /// Judges `snap` against `containers` and acts on what is new; returns
    /// the findings of this sample.
    pub fn check(&mut self, snap: &Snapshot, containers: &[ContainerView]) -> Vec<Finding> {
        let dirs: HashMap<(u64, u64), usize> = containers
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((self.world.dir_id(c.vm_dir.as_deref()?)?, i)))
            .collect();
        let findings = judge(snap, containers, |pid| {
            dirs.get(&self.world.quota_dir_of(pid)?).copied()
        });
        let listed: HashSet<u32> = snap
            .gpus
            .iter()
            .flat_map(|g| g.processes.keys().copied())
            .collect();
        self.seen_pids.retain(|p| listed.contains(p));
        let mut over = HashSet::new();
        for f in &findings {
            let c = &containers[f.container];
            let new = match f.reason {
                Reason::Unregistered => self.seen_pids.insert(f.pid.unwrap_or(0)),
                Reason::OverQuota => {
                    let key = (c.pod_uid.clone(), c.container.clone());
                    over.insert(key.clone());
                    !self.over.contains(&key)
                }
            };
            if new {
                self.report(c, f);
            }
            // An unregistered process is ended once; a container over its
            // quota loses its largest process each sample it stays over.
            if new || f.reason == Reason::OverQuota {
                self.end(c, f);
            }
        }
        self.over = over;
        findings
    }

    fn report(&self, c: &ContainerView, f: &Finding) {
        tracing::warn!(
            namespace = %c.namespace, pod = %c.pod_name, container = %c.container,
            reason = f.reason.label(), "escape: {}", f.describe()
        );
        self.metrics
            .escape(&c.namespace, &c.pod_name, &c.container, f.reason.label());
        if let Some(n) = &self.notify {
            n(c, f);
        }
    }

    /// Under [`Policy::Kill`], ends the finding's process.
    fn end(&self, c: &ContainerView, f: &Finding) {
        let (Policy::Kill, Some(pid)) = (self.policy, f.pid) else {
            return;
        };
        match self.world.kill(pid) {
            Ok(()) => tracing::warn!(
                pid, pod = %c.pod_name, reason = f.reason.label(),
                "escape: process ended (escape policy kill)"
            ),
            Err(e) => tracing::error!(pid, error = %e, "escape: ending the process"),
        }
    }
}

#[cfg(test)]
mod tests;
