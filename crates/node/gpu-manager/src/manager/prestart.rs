//! PreStartContainer: kubelet names the devices, not the pod, at
//! Allocate, so the manager guessed the pod; here the guess is checked
//! against kubelet's records. A wrong guess withdraws the allocation and
//! fails the container, which must never start with another pod's quota.

use std::collections::BTreeMap;

use super::refusal::Refusal;

use super::Manager;
use crate::allocation::Allocation;
use crate::decide::ids;
use crate::decide::pods;
use crate::world::PatchJob;
use crate::world::{Holder, PodKey};
use node_agent::events::{self, PodEvent};

impl Manager {
    /// `PreStartContainer`: check the pod guessed at Allocate against what
    /// kubelet recorded. A wrong guess withdraws the allocation and fails
    /// the container, which must never start with another pod's quota.
    pub async fn pre_start(&self, resource: &str, device_ids: &[String]) -> Result<(), Refusal> {
        let found = {
            let st = self.st();
            st.allocs
                .values()
                .find(|a| {
                    let held = if resource == ids::VCORE_RESOURCE {
                        &a.vcore_ids
                    } else {
                        &a.vmemory_ids
                    };
                    held.iter().any(|i| device_ids.contains(i))
                })
                .cloned()
        };
        let Some(a) = found else {
            if resource == ids::VCORE_RESOURCE {
                return Err(Refusal::precondition(format!(
                    "devices {device_ids:?} have no allocation in the manager (it was withdrawn or never made); \
                     delete the pod to have it allocated again"
                )));
            }
            return Ok(());
        };
        if a.verified {
            return Ok(());
        }
        let mut holder: Option<Holder> = None;
        for (res, list) in [
            (ids::VCORE_RESOURCE, &a.vcore_ids),
            (ids::VMEMORY_RESOURCE, &a.vmemory_ids),
        ] {
            if list.is_empty() {
                continue;
            }
            match self.kubelet.holder(res, list).await {
                Ok(Some(h)) => {
                    holder = Some(h);
                    break;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, id = %a.id(), "cannot read kubelet's device records; allocation stays unverified");
                    return Ok(());
                }
            }
        }
        let Some(h) = holder else {
            tracing::debug!(id = %a.id(), "kubelet has not recorded the devices yet; verifying at a later PreStart");
            return Ok(());
        };
        let same_pod = match &h.pod {
            PodKey::Name { namespace, name } => *namespace == a.namespace && *name == a.pod_name,
            PodKey::Uid(u) => *u == a.pod_uid,
        };
        if same_pod && h.container == a.container {
            let mut st = self.st();
            if let Some(x) = st.allocs.get_mut(&a.id()) {
                x.verified = true;
            }
            // Written with the next write: "verified" is re-established
            // from kubelet.
            self.changed_lazily(&mut st);
            return Ok(());
        }
        self.release(&a.id());
        self.st().withdrawn.insert(a.pod_uid.clone());
        // The guessed pod may have been annotated assigned already.
        self.patcher.submit(PatchJob {
            namespace: a.namespace.clone(),
            name: a.pod_name.clone(),
            uid: a.pod_uid.clone(),
            annotations: BTreeMap::from([(pods::GPU_ASSIGNED.to_string(), "false".to_string())]),
        });
        // A rare error path: the withdrawal is written before answering.
        let _ = self.flush().await;
        let msg = wrong_guess(&h, &a);
        // On both pods: the one whose container fails now (kubelet's
        // holder) and the one that waits to be allocated again.
        let holder = self.pods.pods().into_iter().find(|p| match &h.pod {
            PodKey::Name { namespace, name } => {
                pods::namespace(p) == namespace && pods::name(p) == name
            }
            PodKey::Uid(u) => pods::uid(p) == u,
        });
        let mut targets = vec![(a.namespace.clone(), a.pod_name.clone(), a.pod_uid.clone())];
        if let Some(p) = holder {
            targets.push((
                pods::namespace(&p).into(),
                pods::name(&p).into(),
                pods::uid(&p).into(),
            ));
        }
        for (namespace, name, uid) in targets {
            self.events.post(PodEvent {
                namespace,
                name,
                uid,
                reason: events::WRONG_POD_GUESS,
                note: msg.clone(),
            });
        }
        Err(Refusal::precondition(msg))
    }
}

fn wrong_guess(h: &Holder, a: &Allocation) -> String {
    format!(
        "kubelet gave these devices to {h}, but at Allocate the manager assigned them to pod {}/{} container {} \
         (uid {}; chosen from the pending pods by predicate time): the allocation is withdrawn and this container \
         fails so that it never runs with another pod's quota; delete the pod to have it allocated again",
        a.namespace, a.pod_name, a.container, a.pod_uid
    )
}
