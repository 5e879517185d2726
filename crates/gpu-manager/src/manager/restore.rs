//! Recovery at start: the checkpoint (an unreadable one is set aside),
//! reconciled with the API server, kubelet's device records and the
//! container runtime ([`crate::recovery::judge`] decides per allocation).

use std::collections::BTreeMap;

use gpu_allocator::{MEMORY_UNIT_BYTES, Placement};

use super::{Manager, now, short_bus_id};
use crate::checkpoint::{Allocation, alloc_id};
use crate::ids;
use crate::kube_api::ApiHealth;
use crate::kubelet::Held;
use crate::pods;
use crate::recovery::{self, Evidence, PodPhase, Verdict};
use crate::runtime::LiveContainer;

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

impl Manager {
    /// The evidence sources, each `None` when it cannot be asked now.
    pub(super) async fn gather(
        &self,
    ) -> (
        Option<BTreeMap<String, PodPhase>>,
        Option<Vec<Held>>,
        Option<Vec<LiveContainer>>,
        Vec<String>,
        // The runtime is configured but could not be asked.
        bool,
    ) {
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
        let runtime = match runtime.map(|r| {
            r.map(|v| {
                v.into_iter()
                    .filter(|c| {
                        self.vm
                            .dir(&c.pod_uid, &c.container)
                            .is_ok_and(|d| c.vm_source.as_deref() == Some(d.as_path()))
                    })
                    .collect::<Vec<_>>()
            })
        }) {
            Ok(r) => r,
            Err(e) => {
                unreachable.push(e.to_string());
                runtime_blind = true;
                None
            }
        };
        (api, kubelet, runtime, unreachable, runtime_blind)
    }

    /// Recovery at start: the checkpoint (an unreadable one is set aside),
    /// reconciled with the API server, kubelet's device records and the
    /// container runtime. Allocations of containers that are gone are
    /// released; live ones keep their capacity and get their vm files,
    /// ledger and socket back; live containers missing from the checkpoint
    /// are rebuilt from the node; vm directories nobody owns are removed.
    pub async fn restore(&self) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        let saved = match self.checkpoint.load() {
            Ok(s) => s,
            Err(e) => {
                let aside = self.checkpoint.set_aside();
                tracing::warn!(
                    error = %e, set_aside = ?aside.as_ref().map(|v| v.iter().map(|p| p.display().to_string()).collect::<Vec<_>>()),
                    "the allocation checkpoint is unreadable; set aside, rebuilding the allocations from the node"
                );
                report.set_aside = Some(match aside {
                    Ok(v) => v
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    Err(e2) => format!("(could not move it: {e2})"),
                });
                None
            }
        };
        let (uuids, allocs) = saved.unwrap_or_else(|| (self.uuids(), Vec::new()));
        if uuids != self.uuids() {
            tracing::warn!(
                checkpoint = ?uuids, node = ?self.uuids(),
                "checkpoint was written for other GPUs; allocations on GPUs whose UUID changed are dropped"
            );
        }
        let (api, kubelet, runtime, unreachable, runtime_blind) = self.gather().await;
        for u in &unreachable {
            tracing::warn!(
                source = %u,
                "recovery: source unreachable; its evidence is skipped and nothing is released on its account (retried every --allocation-check-period)"
            );
        }
        report.unreachable = unreachable;
        let ev = Evidence {
            api: api.as_ref(),
            kubelet: kubelet.as_deref(),
            runtime: runtime.as_deref(),
        };
        let now = now();
        let mut kept = Vec::new();
        {
            let mut st = self.st();
            for mut a in allocs {
                let p = Placement::from(&a.placement);
                let same = p.gpus().iter().all(|&g| {
                    uuids
                        .get(g)
                        .is_some_and(|u| Some(u) == self.gpus.get(g).map(|x| &x.uuid))
                });
                if !same {
                    tracing::warn!(id = %a.id(), "dropping checkpointed allocation: its GPU changed");
                    continue;
                }
                match recovery::judge(&a, &ev, now.saturating_sub(a.created), 0) {
                    Verdict::Release(why) => {
                        tracing::info!(id = %a.id(), why, "recovery: releasing");
                        report.released += 1;
                        continue;
                    }
                    Verdict::Keep { why, ids } => {
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
                if let Err(e) = st.allocator.commit(a.id(), &p) {
                    tracing::error!(id = %a.id(), error = %e, "recovery: checkpointed allocation does not fit; dropped");
                    continue;
                }
                st.allocs.insert(a.id(), a.clone());
                kept.push(a);
            }
        }
        report.kept = kept.len();
        // Live containers the checkpoint does not know (lost, stale or
        // corrupt checkpoint): rebuilt from their vm directory, kubelet's
        // IDs and the runtime's view of their GPUs.
        for c in runtime.iter().flatten() {
            if !c.alive
                || self
                    .st()
                    .allocs
                    .contains_key(&alloc_id(&c.pod_uid, &c.container))
            {
                continue;
            }
            let Ok(dir) = self.vm.dir(&c.pod_uid, &c.container) else {
                continue;
            };
            if c.vm_source.as_deref() != Some(dir.as_path()) {
                continue; // not one of ours
            }
            if api
                .as_ref()
                .is_some_and(|m| m.get(&c.pod_uid) != Some(&PodPhase::Active))
            {
                continue;
            }
            match self.rebuild(c, kubelet.as_deref()).await {
                Ok(a) => {
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
                Err(e) => {
                    tracing::error!(container = %c.id, pod = %c.pod_uid, error = %e, "recovery: cannot rebuild the allocation of a live container")
                }
            }
        }
        for a in &kept {
            if let Err(e) = self.open_files(a) {
                tracing::error!(id = %a.id(), error = %e, "recovery: re-creating the container's files");
            }
        }
        // vm directories no allocation owns: their containers are gone
        // (unless a live container still mounts one: never pulled away).
        for (uid, c) in self.vm.list() {
            let id = alloc_id(&uid, &c);
            if self.st().allocs.contains_key(&id) {
                continue;
            }
            let mounted = runtime
                .iter()
                .flatten()
                .any(|x| x.alive && x.pod_uid == uid && x.container == c);
            if mounted {
                tracing::warn!(
                    id,
                    "vm directory of a live container without an allocation is kept"
                );
                continue;
            }
            if runtime_blind {
                // Whether a container still mounts it cannot be told now.
                tracing::warn!(
                    id,
                    "vm directory without an allocation is kept: the container runtime is unreachable"
                );
                continue;
            }
            self.vm.remove(&uid, &c);
            report.orphans_removed += 1;
        }
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

    /// An allocation for a live container the checkpoint lost: GPUs from
    /// its environment or devices (else the quota file's bus id), sizes
    /// from kubelet's device IDs (else the quota file), the pod from the
    /// runtime's labels and the API server.
    async fn rebuild(
        &self,
        c: &LiveContainer,
        kubelet: Option<&[Held]>,
    ) -> Result<Allocation, String> {
        let dir = self
            .vm
            .dir(&c.pod_uid, &c.container)
            .map_err(|e| e.to_string())?;
        let cfg = quota_config::read_config(&dir.join(quota_config::CONFIG_FILE)).ok();
        let seen = self.runtime.gpus(&c.id).await.map_err(|e| e.to_string())?;
        let mut gpus: Vec<usize> = seen
            .visible
            .iter()
            .filter_map(|u| self.gpus.iter().position(|g| &g.uuid == u))
            .collect();
        if gpus.is_empty() {
            gpus = seen
                .devices
                .iter()
                .filter_map(|d| d.strip_prefix("/dev/nvidia")?.parse::<u32>().ok())
                .filter_map(|m| self.gpus.iter().position(|g| g.minor == m))
                .collect();
        }
        if gpus.is_empty()
            && let Some(cfg) = &cfg
            && let Some(g) = self
                .gpus
                .iter()
                .position(|g| short_bus_id(&g.pci_bus_id) == cfg.bus_id)
        {
            gpus.push(g);
        }
        gpus.sort_unstable();
        gpus.dedup();
        if gpus.is_empty() {
            return Err("no GPU found in its environment, devices or vcuda.config".into());
        }
        let probe = Allocation {
            pod_uid: c.pod_uid.clone(),
            namespace: c.namespace.clone(),
            pod_name: c.pod_name.clone(),
            container: c.container.clone(),
            container_index: 0,
            cores: 0,
            memory_units: 0,
            memory_limit: 0,
            placement: crate::checkpoint::PlacementRecord::Exclusive { gpus: vec![] },
            soft_limit: None,
            vcore_ids: vec![],
            vmemory_ids: vec![],
            verified: false,
            created: now(),
        };
        let held = kubelet.and_then(|k| recovery::held_by(&probe, k));
        let ids_of = |r: &str| held.and_then(|h| h.ids.get(r).cloned()).unwrap_or_default();
        let (vcore_ids, vmemory_ids) = (ids_of(ids::VCORE_RESOURCE), ids_of(ids::VMEMORY_RESOURCE));
        let shared = match &cfg {
            Some(cfg) => cfg.enable,
            None => gpus.len() == 1 && !vcore_ids.is_empty() && vcore_ids.len() < 100,
        };
        let cores = if !vcore_ids.is_empty() {
            vcore_ids.len() as u32
        } else if shared {
            cfg.as_ref().map_or(0, |c| c.utilization.max(0) as u32)
        } else {
            100 * gpus.len() as u32
        };
        let memory_limit = if !vmemory_ids.is_empty() {
            vmemory_ids.len() as u64
        } else {
            cfg.as_ref().map_or(0, |c| c.gpu_memory / MEMORY_UNIT_BYTES)
        };
        let (memory_units, placement) = if shared {
            let units = cfg
                .as_ref()
                .map_or(memory_limit, |c| c.gpu_memory / MEMORY_UNIT_BYTES);
            (
                units,
                Placement::Share {
                    gpu: gpus[0],
                    cores,
                    memory_units: units,
                },
            )
        } else {
            (
                gpus.iter().map(|&g| self.gpus[g].memory_units()).sum(),
                Placement::Exclusive { gpus: gpus.clone() },
            )
        };
        if cores == 0 || (shared && memory_units == 0) {
            return Err(
                "its size is unknown (no kubelet record and no readable vcuda.config)".into(),
            );
        }
        let pod = self
            .pods
            .pods()
            .into_iter()
            .find(|p| pods::uid(p) == c.pod_uid);
        let container_index = pod
            .as_ref()
            .and_then(|p| {
                pods::gpu_containers(p)
                    .into_iter()
                    .find(|(_, n)| *n == c.container)
            })
            .map_or(0, |(i, _)| i);
        Ok(Allocation {
            container_index,
            cores,
            memory_units,
            memory_limit,
            placement: (&placement).into(),
            soft_limit: cfg
                .as_ref()
                .filter(|c| !c.hard_limit)
                .map(|c| c.limit.max(0) as u32),
            verified: held.is_some(),
            vcore_ids,
            vmemory_ids,
            ..probe
        })
    }
}
