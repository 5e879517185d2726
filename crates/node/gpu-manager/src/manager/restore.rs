//! Recovery at start: the checkpoint (an unreadable one is set aside),
//! reconciled with the API server, kubelet's device records and the
//! container runtime ([`crate::decide::recovery::judge`] decides per allocation).
//!
//! [`Manager::restore`] runs as named steps over [`AtStart`], what each of
//! them said; the decisions on that evidence are pure (tested in
//! `tests`).

use std::collections::BTreeMap;

use gpu_allocator::Placement;

use super::{Manager, now};
use crate::allocation::{Allocation, alloc_id};
use crate::decide::ids;
use crate::decide::pods;
use crate::decide::recovery::{self, Evidence, PodPhase, Verdict};
use crate::world::ApiHealth;
use crate::world::Held;
use crate::world::LiveContainer;
use crate::world::checkpoint::CheckpointError;

/// What recovery at start found and did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    /// Allocations kept from the checkpoint.
    pub kept: usize,
    /// Allocations rebuilt from the node (missing from the checkpoint).
    pub rebuilt: usize,
    /// Allocations released (their containers are gone).
    pub released: usize,
    /// vm directories removed that no allocation owned.
    pub orphans_removed: usize,
    /// The checkpoint could not be read and was set aside here.
    pub set_aside: Option<String>,
    /// Sources that could not be asked.
    pub unreachable: Vec<String>,
}

/// What the API server, kubelet and the container runtime said, each
/// `None` when it cannot be asked now (recovery and the periodic check).
#[derive(Debug, Default)]
pub(super) struct Sources {
    /// This node's pods by UID.
    pub api: Option<BTreeMap<String, PodPhase>>,
    /// Containers kubelet assigned devices to.
    pub kubelet: Option<Vec<Held>>,
    /// The runtime's containers that mount one of our vm directories.
    pub runtime: Option<Vec<LiveContainer>>,
    /// Sources that could not be asked, for logs and the report.
    pub unreachable: Vec<String>,
    /// The runtime is configured but could not be asked.
    pub runtime_blind: bool,
}

/// What becomes of a vm directory no allocation owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Orphan {
    /// A live container still mounts it: never pulled away.
    Mounted,
    /// Whether a container mounts it cannot be told now.
    Blind,
    /// Its container is gone.
    Remove,
}

impl Sources {
    /// The borrowed view [`recovery::judge`] decides on.
    pub fn evidence(&self) -> Evidence<'_> {
        Evidence {
            api: self.api.as_ref(),
            kubelet: self.kubelet.as_deref(),
            runtime: self.runtime.as_deref(),
        }
    }

    /// Whether a container of ours that the allocations lack (`allocated`
    /// false) is rebuilt: alive, and its pod active unless the API server
    /// cannot tell.
    pub fn rebuild_wanted(&self, c: &LiveContainer, allocated: bool) -> bool {
        c.alive
            && !allocated
            && self
                .api
                .as_ref()
                .is_none_or(|m| m.get(&c.pod_uid) == Some(&PodPhase::Active))
    }

    /// What becomes of the vm directory of `uid`/`container` that no
    /// allocation owns.
    pub fn orphan(&self, uid: &str, container: &str) -> Orphan {
        let mounted = self
            .runtime
            .iter()
            .flatten()
            .any(|x| x.alive && x.pod_uid == uid && x.container == container);
        if mounted {
            Orphan::Mounted
        } else if self.runtime_blind {
            Orphan::Blind
        } else {
            Orphan::Remove
        }
    }
}

/// Recovery's evidence: what the checkpoint said, and the node's sources.
#[derive(Debug, Default)]
pub(super) struct AtStart {
    /// The GPU UUIDs the checkpoint was written for (this node's when
    /// there is none).
    pub saved_gpus: Vec<String>,
    /// Its allocations (none when there is no readable checkpoint).
    pub saved: Vec<Allocation>,
    pub node: Sources,
}

/// What becomes of one checkpointed allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fate {
    /// A GPU it was placed on has another UUID now: dropped.
    GpuChanged,
    /// Judged on the node's evidence.
    Judged(Verdict),
    /// Booked moments ago, its pod waiting, no answer seen by kubelet
    /// (not verified, no record, no container): the manager process died
    /// between booking and answering, and its supervisor resends the
    /// Allocate. Kept for [`RESEND_S`].
    Unanswered,
}

/// How long a booking no answer reached kubelet for is kept at start for
/// the Allocate its supervisor resends ([`child_relay::PATIENCE`] and
/// the time a manager takes to start).
pub(super) const RESEND_S: u64 = 60;

impl AtStart {
    /// Decides a checkpointed allocation: on GPUs whose UUID is unchanged
    /// on this node (`node_gpus`), judged on the sources' evidence at
    /// `now`.
    pub fn fate(&self, a: &Allocation, node_gpus: &[String], now: u64) -> Fate {
        let p = Placement::from(&a.placement);
        let same = p.gpus().iter().all(|&g| {
            self.saved_gpus
                .get(g)
                .is_some_and(|u| node_gpus.get(g) == Some(u))
        });
        if !same {
            return Fate::GpuChanged;
        }
        let (ev, age) = (self.node.evidence(), now.saturating_sub(a.created));
        // A container of it, even a dead one, was made from an answer.
        let made = ev.runtime.is_some_and(|r| {
            r.iter()
                .any(|c| c.pod_uid == a.pod_uid && c.container == a.container)
        });
        match recovery::judge(a, &ev, age, 0) {
            Verdict::Release(_)
                if !a.verified && !made && recovery::judge(a, &ev, age, RESEND_S).keeps() =>
            {
                Fate::Unanswered
            }
            v => Fate::Judged(v),
        }
    }
}

/// Paths for messages, comma-separated.
fn joined(paths: &[std::path::PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Manager {
    /// The evidence sources, each `None` when it cannot be asked now.
    pub(super) async fn gather(&self) -> Sources {
        let mut unreachable = Vec::new();
        let mut runtime_blind = false;
        let api = (self.pods.health() == ApiHealth::Ok).then(|| {
            self.pods
                .pods()
                .iter()
                .map(|p| {
                    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                    let ph = if matches!(phase, Some("Succeeded" | "Failed")) {
                        PodPhase::Finished
                    } else {
                        PodPhase::Active
                    };
                    (pods::uid(p).to_string(), ph)
                })
                .collect::<BTreeMap<_, _>>()
        });
        if api.is_none() {
            unreachable.push(format!("API server ({:?})", self.pods.health()));
        }
        let (kubelet, runtime) = tokio::join!(
            self.kubelet
                .held(&[ids::VCORE_RESOURCE, ids::VMEMORY_RESOURCE]),
            self.runtime.containers()
        );
        let kubelet = kubelet
            .map_err(|e| unreachable.push(format!("kubelet: {e}")))
            .ok();
        // Only containers that mount one of our vm directories are ours (a
        // pod UID alone could be another node's or another manager's).
        let runtime = match runtime {
            Ok(r) => r.map(|v| v.into_iter().filter(|c| self.mounts_ours(c)).collect()),
            Err(e) => {
                unreachable.push(e.to_string());
                runtime_blind = true;
                None
            }
        };
        Sources {
            api,
            kubelet,
            runtime,
            unreachable,
            runtime_blind,
        }
    }

    /// Whether `c` mounts its own vm directory of this manager.
    fn mounts_ours(&self, c: &LiveContainer) -> bool {
        self.shares
            .vm()
            .dir(&c.pod_uid, &c.container)
            .is_ok_and(|d| c.vm_source.as_deref() == Some(d.as_path()))
    }

    /// Recovery at start: the checkpoint (an unreadable one is set aside),
    /// reconciled with the API server, kubelet's device records and the
    /// container runtime. Allocations of containers that are gone are
    /// released; live ones keep their capacity and get their vm files,
    /// ledger and socket back; live containers missing from the checkpoint
    /// are rebuilt from the node; vm directories nobody owns are removed.
    pub async fn restore(&self) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        let start = self.evidence_at_start(&mut report).await;
        let mut kept = self.keep_checkpointed(&start, &mut report);
        report.kept = kept.len();
        self.rebuild_lost(&start.node, &mut kept, &mut report).await;
        for a in &kept {
            if let Err(e) = self.open_files(a) {
                tracing::error!(id = %a.id(), error = %e, "recovery: re-creating the container's files");
            }
        }
        self.remove_orphans(&start.node, &mut report);
        // Written even when nothing changed: a migrated or set-aside
        // checkpoint is replaced by slot files before the first Allocate.
        self.st().changed();
        let _ = self.flush().await;
        tracing::info!(
            kept = report.kept,
            rebuilt = report.rebuilt,
            released = report.released,
            orphans_removed = report.orphans_removed,
            unreachable = report.unreachable.len(),
            "recovery done"
        );
        report
    }

    /// Step 1: what the checkpoint and each source said; an unreadable
    /// checkpoint is set aside, unreachable sources are logged.
    async fn evidence_at_start(&self, report: &mut RecoveryReport) -> AtStart {
        let saved = match self.checkpoint.load() {
            Ok(s) => s,
            Err(e) => {
                // Unreadable, or another version's (a rolled-back upgrade):
                // kept aside either way, never read in part, and the node's
                // own records (kubelet, runtime) rebuild the allocations.
                let aside = self.checkpoint.set_aside();
                let why = match e {
                    CheckpointError::Version { .. } => "written in another format",
                    _ => "unreadable",
                };
                tracing::warn!(
                    error = %e, set_aside = ?aside.as_ref().map(|v| v.iter().map(|p| p.display().to_string()).collect::<Vec<_>>()),
                    "the allocation checkpoint is {why}; set aside, rebuilding the allocations from the node"
                );
                report.set_aside = Some(match aside {
                    Ok(v) => joined(&v),
                    Err(e2) => format!("(could not move it: {e2})"),
                });
                None
            }
        };
        let (saved_gpus, saved) = saved.unwrap_or_else(|| (self.uuids(), Vec::new()));
        if saved_gpus != self.uuids() {
            tracing::warn!(
                checkpoint = ?saved_gpus, node = ?self.uuids(),
                "checkpoint was written for other GPUs; allocations on GPUs whose UUID changed are dropped"
            );
        }
        let node = self.gather().await;
        for u in &node.unreachable {
            tracing::warn!(
                source = %u,
                "recovery: source unreachable; its evidence is skipped and nothing is released on its account (retried every --allocation-check-period)"
            );
        }
        report.unreachable = node.unreachable.clone();
        AtStart {
            saved_gpus,
            saved,
            node,
        }
    }

    /// Step 2: the checkpointed allocations the evidence keeps, with
    /// kubelet's device IDs adopted, committed to the allocator.
    fn keep_checkpointed(&self, start: &AtStart, report: &mut RecoveryReport) -> Vec<Allocation> {
        let (node_gpus, now) = (self.uuids(), now());
        let mut kept = Vec::new();
        let mut st = self.st();
        for a in &start.saved {
            let mut a = a.clone();
            match start.fate(&a, &node_gpus, now) {
                Fate::GpuChanged => {
                    tracing::warn!(id = %a.id(), "dropping checkpointed allocation: its GPU changed");
                    continue;
                }
                Fate::Unanswered => {
                    tracing::info!(id = %a.id(), "recovery: keeping a booking kubelet got no answer for, for the Allocate the supervisor resends");
                    st.resendable.insert(a.id(), std::time::Instant::now());
                }
                Fate::Judged(Verdict::Release(why)) => {
                    tracing::info!(id = %a.id(), why, "recovery: releasing");
                    report.released += 1;
                    continue;
                }
                Fate::Judged(Verdict::Keep { why, ids }) => {
                    if let Some((vcore, vmemory)) = ids {
                        tracing::info!(id = %a.id(), ?vcore, "recovery: kubelet's device IDs adopted");
                        if !vcore.is_empty() {
                            a.vcore_ids = vcore;
                        }
                        if !vmemory.is_empty() {
                            a.vmemory_ids = vmemory;
                        }
                    }
                    tracing::debug!(id = %a.id(), why, "recovery: keeping");
                }
            }
            if let Err(e) = st.allocator.commit(a.id(), &Placement::from(&a.placement)) {
                tracing::error!(id = %a.id(), error = %e, "recovery: checkpointed allocation does not fit; dropped");
                continue;
            }
            st.allocs.insert(a.id(), a.clone());
            kept.push(a);
        }
        kept
    }

    /// Step 3: live containers the checkpoint does not know (lost, stale or
    /// corrupt checkpoint), rebuilt from their vm directory, kubelet's IDs
    /// and the runtime's view of their GPUs.
    async fn rebuild_lost(
        &self,
        node: &Sources,
        kept: &mut Vec<Allocation>,
        report: &mut RecoveryReport,
    ) {
        for c in node.runtime.iter().flatten() {
            let allocated = self
                .st()
                .allocs
                .contains_key(&alloc_id(&c.pod_uid, &c.container));
            if !node.rebuild_wanted(c, allocated) {
                continue;
            }
            let a = match self.rebuild(c, node.kubelet.as_deref()).await {
                Ok(a) => a,
                Err(e) => {
                    tracing::error!(container = %c.id, pod = %c.pod_uid, error = %e, "recovery: cannot rebuild the allocation of a live container");
                    continue;
                }
            };
            let p = Placement::from(&a.placement);
            let mut st = self.st();
            match st.allocator.commit(a.id(), &p) {
                Ok(()) => {
                    tracing::warn!(id = %a.id(), placement = %p, "recovery: allocation rebuilt from the node");
                    st.allocs.insert(a.id(), a.clone());
                    kept.push(a);
                    report.rebuilt += 1;
                }
                Err(e) => {
                    tracing::error!(id = %a.id(), error = %e, "recovery: a live container's GPUs conflict with another allocation; not recorded")
                }
            }
        }
    }

    /// Step 4: vm directories no allocation owns; their containers are
    /// gone (unless a live container still mounts one: never pulled away).
    fn remove_orphans(&self, node: &Sources, report: &mut RecoveryReport) {
        for (uid, c) in self.shares.vm().list() {
            let id = alloc_id(&uid, &c);
            if self.st().allocs.contains_key(&id) {
                continue;
            }
            match node.orphan(&uid, &c) {
                Orphan::Mounted => tracing::warn!(
                    id,
                    "vm directory of a live container without an allocation is kept"
                ),
                Orphan::Blind => tracing::warn!(
                    id,
                    "vm directory without an allocation is kept: the container runtime is unreachable"
                ),
                Orphan::Remove => {
                    self.shares.vm().remove(&uid, &c);
                    report.orphans_removed += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
