//! A reclaimed borrower (docs/qos.md, "Memory") as a Warning Event on each
//! pod holding its claim. The registry names the claim by UID; the driver's
//! prepared claims give its namespace and name ([`ClaimEvents`] its pods).

use std::sync::{Arc, Weak};

use node_agent::events::MEMORY_RECLAIMED;
use node_agent::registry::Reclaimed;

use crate::claim_events::ClaimEvents;
use crate::driver::Driver;

/// Posts each reclaim of `driver`'s registry through `events`.
pub fn report(driver: &Arc<Driver>, events: ClaimEvents) {
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
        let note = format!("claim {ns}/{name} request {}: {}", r.slot, r.describe());
        events.post(ns, name, MEMORY_RECLAIMED, note);
    }));
}
