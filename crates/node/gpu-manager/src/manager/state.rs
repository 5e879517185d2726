//! What the state lock guards, and what a poisoned lock means.
//!
//! A panic while the lock is held may leave the allocator and the
//! allocations out of step. The daemon does not go on as a zombie: the
//! lock is taken over (so readers and releases keep working), but
//! [`Manager::health`] fails from then on (`/healthz`, so the liveness
//! probe restarts the pod), Allocate answers Unavailable, and the
//! checkpoint is no longer written (it keeps the last record made before
//! the panic, which recovery at the next start reconciles with the node).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::MutexGuard;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gpu_allocator::Allocator;

use super::Manager;
use crate::allocation::Allocation;

pub(super) struct State {
    pub allocator: Allocator,
    pub allocs: BTreeMap<String, Allocation>,
    /// vcuda-memory IDs allocated before their container's vcuda-core
    /// (kubelet allocates a container's resources in map order).
    pub orphan_memory: Vec<Vec<String>>,
    pub healthy: Vec<bool>,
    /// Pods whose allocation was withdrawn after a wrong guess: candidates
    /// again even while their `gpu-assigned` annotation is being reverted.
    pub withdrawn: BTreeSet<String>,
    /// Bumped by every change of `allocs`.
    pub version: u64,
    /// The newest `version` the checkpoint holds.
    pub durable: u64,
    /// The last checkpoint write failed (logged once it works again).
    pub write_failed: bool,
    /// When the last Allocate started (the lazy flush waits for a pause).
    pub last_allocate: Instant,
    /// Bookings restored at start that no answer is known to have reached
    /// kubelet for, by id, with when they were restored: the manager
    /// process died between booking and answering, and its supervisor
    /// sends the same Allocate to this one ([`Manager::allocate_vcore`]).
    pub resendable: BTreeMap<String, Instant>,
}

impl State {
    pub fn new(allocator: Allocator, gpus: usize) -> State {
        State {
            allocator,
            allocs: BTreeMap::new(),
            orphan_memory: Vec::new(),
            healthy: vec![true; gpus],
            withdrawn: BTreeSet::new(),
            version: 0,
            durable: 0,
            write_failed: false,
            last_allocate: Instant::now(),
            resendable: BTreeMap::new(),
        }
    }

    /// Marks the allocations changed; returns the version a write must
    /// reach to cover the change.
    pub fn changed(&mut self) -> u64 {
        self.version += 1;
        self.version
    }
}

impl Manager {
    /// The state lock, taken over if a panic poisoned it (see the module).
    pub(super) fn st(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| {
            if !self.poison_seen.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    "a panic left the manager's state half-changed; /healthz fails from now on so that the liveness probe restarts \
                     the manager (recovery rebuilds the state from the checkpoint and the node); Allocate answers Unavailable"
                );
            }
            p.into_inner()
        })
    }

    /// Whether the daemon can go on (`/healthz`): fails for good once a
    /// panic poisoned the state.
    pub fn health(&self) -> Result<(), Poisoned> {
        if self.state.is_poisoned() {
            return Err(Poisoned);
        }
        Ok(())
    }
}

/// The manager's state was left half-changed by a panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the manager's state was poisoned by a panic (see the log); a restart rebuilds it")]
pub struct Poisoned;
