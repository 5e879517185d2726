//! The vcuda manager daemon (device-plugin mode), as a library so tests can
//! reach its parts. The binary (`src/main.rs`) only parses settings and calls
//! [`lifecycle::daemon::run`].
//!
//! What either mode needs (NVML, driver mirror, vm directories, `vcuda.sock`,
//! container edits, mode exclusion, the node's configuration) is
//! `node-agent`'s; this crate is the device-plugin mode on it, in four
//! floors a newcomer can tell apart:
//!
//! * [`lifecycle`]: start, run, hand over and stop — the daemon's tasks,
//!   its supervisor (kubelet's sockets and connections kept across a crash),
//!   the handover between two instances, ownership of the state, uninstall.
//! * [`edge`]: the protocols: the two device plugins kubelet calls, how
//!   their sockets reach kubelet, the display service's view of the state.
//!   Refusals become `tonic::Status` here and nowhere else.
//! * [`manager`] and [`decide`]: the decisions. `manager` holds the
//!   allocation state and answers Allocate / PreStartContainer, recovers and
//!   releases, one module per job; `decide` holds the pure ones it calls —
//!   which pod asks, reconciliation over evidence, the Allocate response, the
//!   advertised IDs, Xid health, the node's status.
//! * [`world`]: the ports — the traits where the world plugs in (API server,
//!   kubelet, container runtime, checkpoint store) with their types, the
//!   adapters that implement them, and (tests only) in-memory doubles.
//!
//! Beside them: [`config`] (the node's configuration plus the device-plugin
//! settings), [`allocation`] (the manager's core record) and [`mig`] (MIG
//! devices served whole, a plugin per profile).

pub mod allocation;
pub mod config;
pub mod decide;
pub mod edge;
pub mod lifecycle;
pub mod manager;
pub mod mig;
pub mod world;
