//! Reconciliation of the manager's allocations with the truth on the node,
//! as pure decisions over the evidence each source gave (or `None` when
//! that source could not be asked). The rule: release only on positive
//! evidence that nobody uses the allocation; when in doubt keep it (the
//! checkpoint may over-state, never under-state, so no GPU is double-booked).

use std::collections::BTreeMap;

use crate::allocation::Allocation;
use crate::world::LiveContainer;
use crate::world::{Held, PodKey};

/// A pod as the API server sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    Active,
    /// Succeeded or Failed: its containers will not run again.
    Finished,
}

/// What each source said; `None`: unreachable (or not configured).
#[derive(Debug, Default, Clone, Copy)]
pub struct Evidence<'a> {
    /// Pods of this node by UID.
    pub api: Option<&'a BTreeMap<String, PodPhase>>,
    /// Containers kubelet assigned devices to (pod-resources / checkpoint).
    pub kubelet: Option<&'a [Held]>,
    /// Kubernetes containers of the runtime.
    pub runtime: Option<&'a [LiveContainer]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Keep, with why; `ids` are kubelet's device IDs when they differ from
    /// the recorded ones (vcore, vmemory).
    Keep {
        why: &'static str,
        ids: Option<(Vec<String>, Vec<String>)>,
    },
    Release(String),
}

/// kubelet's record of the allocation's container.
pub fn held_by<'a>(a: &Allocation, kubelet: &'a [Held]) -> Option<&'a Held> {
    kubelet.iter().find(|h| {
        h.container == a.container
            && match &h.pod {
                PodKey::Uid(u) => *u == a.pod_uid,
                PodKey::Name { namespace, name } => {
                    *namespace == a.namespace && *name == a.pod_name
                }
            }
    })
}

/// Whether the runtime has a container of the allocation that may run.
pub fn alive_in(a: &Allocation, runtime: &[LiveContainer]) -> bool {
    runtime
        .iter()
        .any(|c| c.alive && c.pod_uid == a.pod_uid && c.container == a.container)
}

impl Verdict {
    pub fn keeps(&self) -> bool {
        matches!(self, Verdict::Keep { .. })
    }
}

/// Decides one allocation. `age_s` is how old it is and `grace_s` how old
/// it must be before "no container and no kubelet record" counts (kubelet
/// records right after Allocate answers; the runtime creates the container
/// later).
pub fn judge(a: &Allocation, ev: &Evidence, age_s: u64, grace_s: u64) -> Verdict {
    if let Some(api) = ev.api {
        match api.get(&a.pod_uid) {
            None => return Verdict::Release("its pod is gone from the API server".into()),
            Some(PodPhase::Finished) => return Verdict::Release("its pod has finished".into()),
            Some(PodPhase::Active) => {}
        }
    }
    let held = ev.kubelet.and_then(|k| held_by(a, k));
    let ids = held.and_then(|h| {
        let get = |r: &str| h.ids.get(r).cloned().unwrap_or_default();
        let vcore = get(crate::decide::ids::VCORE_RESOURCE);
        let vmemory = get(crate::decide::ids::VMEMORY_RESOURCE);
        let differs = (!vcore.is_empty() && vcore != a.vcore_ids)
            || (!vmemory.is_empty() && vmemory != a.vmemory_ids);
        differs.then_some((vcore, vmemory))
    });
    if ev.runtime.is_some_and(|r| alive_in(a, r)) {
        return Verdict::Keep {
            why: "its container is running",
            ids,
        };
    }
    if held.is_some() {
        return Verdict::Keep {
            why: "kubelet holds its devices (container starting or restarting)",
            ids,
        };
    }
    if ev.runtime.is_some() && ev.kubelet.is_some() && age_s >= grace_s {
        return Verdict::Release(
            "no container of it is alive and kubelet holds no devices for it".into(),
        );
    }
    Verdict::Keep {
        why: "not enough evidence to release (a source is unreachable, or it is new)",
        ids: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};

    fn alloc() -> Allocation {
        Allocation {
            verified: true,
            created: 0,
            ..crate::world::checkpoint::sample_share("u1", 0)
        }
    }

    fn ctr(alive: bool) -> LiveContainer {
        LiveContainer {
            id: "x".into(),
            pod_uid: "u1".into(),
            pod_name: "p".into(),
            namespace: "ns".into(),
            container: "c".into(),
            alive,
            vm_source: None,
        }
    }

    fn held(ids: &[&str]) -> Held {
        Held {
            pod: PodKey::Name {
                namespace: "ns".into(),
                name: "p".into(),
            },
            container: "c".into(),
            ids: BTreeMap::from([(
                VCORE_RESOURCE.to_string(),
                ids.iter().map(|s| s.to_string()).collect(),
            )]),
        }
    }

    fn keep(v: &Verdict) -> bool {
        matches!(v, Verdict::Keep { .. })
    }

    #[test]
    fn the_api_server_decides_first() {
        let a = alloc();
        let gone = BTreeMap::new();
        let finished = BTreeMap::from([("u1".to_string(), PodPhase::Finished)]);
        let running = [ctr(true)];
        for api in [&gone, &finished] {
            let ev = Evidence {
                api: Some(api),
                runtime: Some(&running),
                kubelet: None,
            };
            assert!(!keep(&judge(&a, &ev, 100, 10)));
        }
    }

    #[test]
    fn running_or_held_is_kept_and_kubelets_ids_win() {
        let a = alloc();
        let active = BTreeMap::from([("u1".to_string(), PodPhase::Active)]);
        let running = [ctr(true)];
        let k = [held(&["vcore-0-07"])];
        let v = judge(
            &a,
            &Evidence {
                api: Some(&active),
                kubelet: Some(&k),
                runtime: Some(&running),
            },
            100,
            10,
        );
        assert_eq!(
            v,
            Verdict::Keep {
                why: "its container is running",
                ids: Some((vec!["vcore-0-07".into()], vec![]))
            }
        );
        // Exited but kubelet still holds it: it restarts.
        let exited = [ctr(false)];
        let v = judge(
            &a,
            &Evidence {
                api: Some(&active),
                kubelet: Some(&k),
                runtime: Some(&exited),
            },
            100,
            10,
        );
        assert!(keep(&v));
    }

    #[test]
    fn released_only_on_positive_evidence() {
        let a = alloc();
        let exited = [ctr(false)];
        let none: [Held; 0] = [];
        let other = [Held {
            container: "other".into(),
            ..held(&["vcore-0-00"])
        }];
        // Died while the manager was down: no live container, not held.
        for k in [&none[..], &other[..]] {
            let ev = Evidence {
                api: None,
                kubelet: Some(k),
                runtime: Some(&exited),
            };
            assert!(!keep(&judge(&a, &ev, 100, 10)));
            // Too new to tell.
            assert!(keep(&judge(&a, &ev, 1, 10)));
        }
        // The runtime unreachable, or kubelet unreachable: kept.
        let ev = Evidence {
            api: None,
            kubelet: Some(&none),
            runtime: None,
        };
        assert!(keep(&judge(&a, &ev, 100, 10)));
        let ev = Evidence {
            api: None,
            kubelet: None,
            runtime: Some(&exited),
        };
        assert!(keep(&judge(&a, &ev, 100, 10)));
        let _ = VMEMORY_RESOURCE;
    }
}
