//! Compute-quota controller hook (issue #5, second part).
//!
//! Every kernel-launch wrapper calls [`before_launch`] before forwarding,
//! only when the process enforces quotas (`config::ENFORCING`). The watcher
//! thread calls [`tick`] every [`tick_interval`] (and while reconnecting),
//! which is where a controller refills tokens or samples utilisation.
//! [`on_attach`] hands over the container ledger's compute words
//! (`Ledger::compute_words`, shared by every process of the container) each
//! time the process (re-)registers; [`after_fork_child`] runs in a fork
//! child before anything else.
//!
//! Today every hook is a no-op: launches are never delayed.

use container_ledger::Ledger;
use std::time::Duration;

/// Called before each kernel launch. `cost_hint`: threads launched (grid
/// blocks x threads per block), 0 when unknown (graph launches). Must stay
/// cheap: the launch path budget is 50 ns over the driver.
#[inline(always)]
pub fn before_launch(cost_hint: u64) {
    let _ = cost_hint;
}

/// Periodic work on the watcher thread.
pub fn tick() {}

/// How often [`tick`] runs.
pub fn tick_interval() -> Duration {
    Duration::from_millis(100)
}

/// The process got (or changed) its ledger and slot.
pub fn on_attach(ledger: &Ledger, slot: usize) {
    let _ = (ledger, slot);
}

/// In a fork child, from the atfork handler (single-threaded, keep it
/// async-signal-safe in spirit: no locks that another thread may hold).
pub fn after_fork_child() {}
