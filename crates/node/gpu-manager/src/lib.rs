//! The vcuda manager daemon (device-plugin mode), as a library so tests can
//! reach its parts. The binary (`src/main.rs`) only parses settings and calls
//! [`daemon::run`].
//!
//! What either mode needs (NVML, driver mirror, vm directories, `vcuda.sock`,
//! container edits, mode exclusion, the node's configuration) is
//! `node-agent`'s; this crate is the device-plugin mode on it.
//!
//! * [`config`]: the node's configuration plus the device-plugin settings.
//! * [`ids`]: the advertised device IDs.
//! * [`manager`]: allocation state, Allocate / PreStartContainer decisions,
//!   recovery and releases, one module per job.
//! * [`world`]: the traits where the world plugs in (API server, kubelet,
//!   container runtime, checkpoint store); `doubles` (tests only): in-memory ones.
//! * [`mig`]: MIG devices served whole, a plugin per profile.
//! * [`plugin`]: the two device plugins; [`served`]: how they reach the
//!   kubelet; [`supervise`]: the supervisor that keeps the kubelet's
//!   sockets and connections across a crash of the manager.
//! * [`pods`], [`kube_api`]: which pod is asking; reflector and patches.
//! * [`kubelet`]: what kubelet recorded (pod-resources, checkpoint).
//! * [`display`]: the manager's state for the display service and metrics.
//! * [`recovery`], [`runtime`]: reconciliation at start and in the periodic
//!   check with kubelet, the API server and the container runtime (Docker or
//!   CRI v1).
//! * [`events`]: refusals and wrong guesses as Warning Events on the Pod.
//! * [`tasks`]: the long-running jobs (pod release, allocation check).
//! * [`checkpoint`]; [`response`]: the Allocate response from the
//!   container edits; [`health`]: Xid health into the advertised devices.

pub mod allocation;
pub mod checkpoint;
pub mod config;
pub mod daemon;
pub mod display;
#[cfg(test)]
pub mod doubles;
pub mod handover;
pub mod health;
pub mod ids;
pub mod kube_api;
pub mod kubelet;
pub mod manager;
pub mod mig;
pub mod node_status;
pub mod owner;
pub mod plugin;
pub mod pods;
pub mod recovery;
pub mod response;
pub mod runtime;
pub mod served;
pub mod supervise;
pub mod tasks;
pub mod uninstall;
pub mod world;
