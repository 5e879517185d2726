//! A reclaimed borrower (docs/qos.md, "Memory") as a Warning Event on each
//! pod holding its claim. The registry names the claim by UID; the driver's
//! prepared claims give its namespace and name, and the claim's
//! `status.reservedFor` its pods (read when it happens: a claim may be
//! shared by several pods, and the checkpoint does not keep them).

use std::sync::{Arc, Weak};

use node_agent::events::{EventSink, MEMORY_RECLAIMED, PodEvent};
use node_agent::registry::Reclaimed;

use crate::driver::{ClaimSource, Driver};

/// Posts each reclaim of `driver`'s registry through `events`.
pub fn report(driver: &Arc<Driver>, claims: Arc<dyn ClaimSource>, events: Arc<dyn EventSink>) {
    let weak: Weak<Driver> = Arc::downgrade(driver);
    driver.registry().on_reclaim(Arc::new(move |r: &Reclaimed| {
        let Some(d) = weak.upgrade() else { return };
        let prepared = d.prepared();
        let name_of = |uid: &str| {
            prepared
                .iter()
                .find(|c| c.uid == uid)
                .map(|c| (c.namespace.clone(), c.name.clone()))
        };
        let Some((ns, name)) = name_of(&r.owner) else {
            return;
        };
        let mut r = r.clone();
        if let Some((fns, fname)) = name_of(&r.for_owner) {
            r.for_owner = format!("claim {fns}/{fname}");
        }
        let (claims, events) = (claims.clone(), events.clone());
        tokio::spawn(async move {
            let claim = match claims.claim(&ns, &name).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "the reclaimed claim's pods: reading {ns}/{name}");
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
                events.post(PodEvent {
                    namespace: ns.clone(),
                    name: p.name,
                    uid: p.uid,
                    reason: MEMORY_RECLAIMED,
                    note: format!("claim {ns}/{name} request {}: {}", r.slot, r.describe()),
                });
            }
        });
    }));
}
