//! Warning Events about a claim, posted on the pods it is reserved for: a
//! claim is not a pod, and `kubectl describe pod` is where a tenant looks.
//! The claim's `status.reservedFor` is read when it happens (a claim may be
//! shared by several pods, and the checkpoint does not keep them).

use std::sync::Arc;

use gpu_display::guard::Notify;
use node_agent::events::{ESCAPE, EventSink, PodEvent};

use crate::driver::ClaimSource;

/// Posts Events on a claim's pods.
#[derive(Clone)]
pub struct ClaimEvents {
    pub claims: Arc<dyn ClaimSource>,
    pub events: Arc<dyn EventSink>,
    /// The runtime the lookups run on: callers include the display's
    /// sampler thread, which is no runtime's.
    pub rt: tokio::runtime::Handle,
}

impl ClaimEvents {
    /// One `reason` Event with `note` on each pod claim `ns`/`name` is
    /// reserved for, once its reservations are read.
    pub fn post(&self, ns: String, name: String, reason: &'static str, note: String) {
        let this = self.clone();
        self.rt.spawn(async move {
            let claim = match this.claims.claim(&ns, &name).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, reason, "the pods of claim {ns}/{name}: reading it");
                    return;
                }
            };
            let pods = claim
                .status
                .and_then(|s| s.reserved_for)
                .unwrap_or_default()
                .into_iter()
                .filter(|c| {
                    c.resource == "pods" && c.api_group.as_deref().unwrap_or("").is_empty()
                });
            for p in pods {
                this.events.post(PodEvent {
                    namespace: ns.clone(),
                    name: p.name,
                    uid: p.uid,
                    reason,
                    note: note.clone(),
                });
            }
        });
    }

    /// The escape guard's notice (gpu-display's `guard`) as a `VcudaEscape`
    /// Event on the claim's pods: the display shows a claim as a container
    /// whose pod is the claim (namespace, name) and whose container is the
    /// request.
    pub fn on_escape(&self) -> Notify {
        let this = self.clone();
        Arc::new(move |c, f| {
            let note = format!(
                "claim {}/{} request {}: {}",
                c.namespace,
                c.pod_name,
                c.container,
                f.describe()
            );
            this.post(c.namespace.clone(), c.pod_name.clone(), ESCAPE, note);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube_api::ApiError;
    use gpu_display::ContainerView;
    use gpu_display::guard::{Finding, Reason};
    use k8s_openapi::api::resource::v1::ResourceClaim;
    use node_agent::events::MemoryEvents;

    /// One claim, reserved for two pods and a non-pod consumer.
    struct OneClaim;

    #[async_trait::async_trait]
    impl ClaimSource for OneClaim {
        async fn claim(&self, ns: &str, name: &str) -> Result<ResourceClaim, ApiError> {
            Ok(serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": ns, "uid": "claim-uid"},
                "spec": {},
                "status": {"reservedFor": [
                    {"resource": "pods", "name": "web-0", "uid": "u0"},
                    {"resource": "pods", "name": "web-1", "uid": "u1"},
                    {"apiGroup": "batch", "resource": "jobs", "name": "j", "uid": "u2"},
                ]}
            }))
            .unwrap())
        }
    }

    /// The DRA driver's escape guard posts `VcudaEscape` on every pod the
    /// escaping claim is reserved for (the manager posts it on the pod),
    /// naming the claim, the request and what was seen; from a thread that
    /// is no runtime's, as the sampler's is.
    #[test]
    fn an_escape_in_a_claim_is_an_event_on_each_of_its_pods() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let sink = Arc::new(MemoryEvents::default());
        let events = ClaimEvents {
            claims: Arc::new(OneClaim),
            events: sink.clone(),
            rt: rt.handle().clone(),
        };
        let view = ContainerView {
            pod_uid: "claim-uid".into(),
            pod_name: "shared-gpu".into(),
            namespace: "team-a".into(),
            container: "gpu".into(),
            ..Default::default()
        };
        let finding = Finding {
            container: 0,
            reason: Reason::Unregistered,
            pid: Some(4242),
            bytes: 512 << 20,
            quota: 1 << 30,
        };
        let notify = events.on_escape();
        std::thread::spawn(move || notify(&view, &finding))
            .join()
            .unwrap();
        let t0 = std::time::Instant::now();
        while sink.posted().len() < 2 && t0.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let posted = sink.posted();
        let pods: Vec<_> = posted
            .iter()
            .map(|e| (e.name.as_str(), e.uid.as_str()))
            .collect();
        assert_eq!(pods, [("web-0", "u0"), ("web-1", "u1")]);
        for e in &posted {
            assert_eq!((e.namespace.as_str(), e.reason), ("team-a", ESCAPE));
            assert!(
                e.note
                    .starts_with("claim team-a/shared-gpu request gpu: process 4242")
                    && e.note.contains("without the vcuda interposer"),
                "{}",
                e.note
            );
        }
    }
}
