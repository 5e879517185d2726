//! Releases: a pod deleted or finished (on every change of the pod
//! watch), containers that died with nobody releasing them (the periodic
//! check), and GPU health from Xid events.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use super::{Manager, now};
use crate::allocation::Allocation;
use crate::decide::ids;
use crate::decide::pods;
use crate::decide::recovery::{self, Verdict};
use crate::world::ApiHealth;

impl Manager {
    /// Marks a GPU (un)healthy: its advertised IDs and new placements (a
    /// GPU in MIG mode keeps its IDs Unhealthy whatever its health).
    pub fn set_gpu_health(&self, gpu: usize, healthy: bool) {
        let usable = {
            let mut st = self.st();
            if gpu >= st.healthy.len() || st.healthy[gpu] == healthy {
                return;
            }
            st.healthy[gpu] = healthy;
            let _ = st.allocator.set_healthy(gpu, healthy);
            st.allocator.usage(gpu).takes_placements()
        };
        let f = |id: &str| ids::gpu_of(id) == Some(gpu);
        self.vcore.set_health_where(usable, f);
        self.vmemory.set_health_where(usable, f);
        tracing::warn!(gpu, healthy, "GPU health changed");
    }

    /// Frees an allocation, then its vm directory and socket (outside the
    /// state lock).
    pub fn release(&self, id: &str) -> Option<Allocation> {
        let a = {
            let mut st = self.st();
            let a = st.allocs.remove(id)?;
            let _ = st.allocator.release(id);
            // Written with the next write (Allocate or periodic check), no
            // sync of its own: a checkpoint that over-states is corrected
            // by recovery.
            self.changed_lazily(&mut st);
            a
        };
        self.close_files(id, &a.pod_uid, &a.container);
        tracing::info!(id, "released");
        Some(a)
    }

    /// Releases allocations of pods the API server no longer has or that
    /// finished; run on every change of the pod watch, so a deleted pod's
    /// capacity is free as soon as the API server says so.
    pub fn release_deleted_pods(&self) -> usize {
        if self.pods.health() != ApiHealth::Ok {
            return 0;
        }
        // Allocations first, then pods: an allocation made in between has
        // its pod in the (newer) pod list.
        let allocs: Vec<(String, String)> = {
            let st = self.st();
            st.allocs
                .values()
                .map(|a| (a.id(), a.pod_uid.clone()))
                .collect()
        };
        let pods = self.pods.pods();
        let by_uid: BTreeMap<&str, &Arc<Pod>> = pods.iter().map(|p| (pods::uid(p), p)).collect();
        let mut n = 0;
        for (id, uid) in allocs {
            let why = match by_uid.get(uid.as_str()) {
                None => "pod is gone",
                Some(p) => match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
                    Some("Succeeded" | "Failed") => "pod finished",
                    _ => continue,
                },
            };
            tracing::info!(id, why, "releasing");
            if self.release(&id).is_some() {
                n += 1;
            }
        }
        n
    }

    /// Periodic check (`--allocation-check-period`): what the watch missed
    /// (deleted or finished pods), containers that died with nobody
    /// releasing them (runtime and kubelet agree; older than `grace`),
    /// annotations missing on complete pods, dead interposer PIDs, and a
    /// checkpoint write that failed before.
    pub async fn check_allocations(&self, grace: Duration) {
        self.release_deleted_pods();
        let snapshot: Vec<Allocation> = self.allocations();
        let sources = self.gather().await;
        for u in &sources.unreachable {
            tracing::debug!(source = %u, "periodic check: source unreachable");
        }
        let ev = sources.evidence();
        let now = now();
        for a in &snapshot {
            if let Verdict::Release(why) =
                recovery::judge(a, &ev, now.saturating_sub(a.created), grace.as_secs())
            {
                tracing::info!(id = %a.id(), why, "periodic check: releasing");
                self.release(&a.id());
            }
        }
        if self.pods.health() == ApiHealth::Ok {
            let pods = self.pods.pods();
            let mut patched = BTreeSet::new();
            for p in &pods {
                let uid = pods::uid(p);
                if pods::annotation(p, pods::GPU_ASSIGNED) == Some("true")
                    || !patched.insert(uid.to_string())
                {
                    continue;
                }
                let job = {
                    let st = self.st();
                    let any = st.allocs.values().any(|a| a.pod_uid == uid);
                    any.then(|| self.patch_if_complete(&st, p)).flatten()
                };
                if let Some(job) = job {
                    self.patcher.submit(job);
                }
            }
        }
        let pruned = self.registry().prune();
        if pruned > 0 {
            tracing::info!(pruned, "dead interposer PIDs pruned");
        }
        // Releases since the last write, or a write that failed.
        if self.checkpoint_dirty() {
            let _ = self.flush().await;
        }
    }
}
