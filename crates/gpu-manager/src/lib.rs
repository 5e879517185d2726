//! The vcuda manager daemon, as a library so tests and #7/#8 can reach its
//! parts. The binary (`src/main.rs`) only parses settings and calls
//! [`daemon::run`].
//!
//! * [`config`]: flags, environment, TOML file.
//! * [`nvml`]: GPU discovery (PCIe levels and NVLink), Xid events.
//! * [`ids`]: the advertised device IDs.
//! * [`manager`]: allocation state, Allocate / PreStartContainer decisions,
//!   recovery and releases, one module per job.
//! * [`world`]: the traits where the world plugs in (API server, kubelet,
//!   container runtime, checkpoint store); `doubles` (tests only): in-memory ones.
//! * [`plugin`]: the two device plugins.
//! * [`pods`], [`kube_api`]: which pod is asking; reflector and patches.
//! * [`kubelet`]: what kubelet recorded (pod-resources, checkpoint).
//! * [`vm`], [`registry`]: per-container vm directories and `vcuda.sock`.
//! * [`display`]: the manager's state for the display service and metrics.
//! * [`recovery`], [`runtime`]: reconciliation at start and in the periodic
//!   check with kubelet, the API server and the container runtime (Docker or
//!   CRI v1).
//! * [`events`]: refusals and wrong guesses as Warning Events on the Pod.
//! * [`checkpoint`], [`response`], [`extra`], [`health`].

pub mod checkpoint;
pub mod config;
pub mod daemon;
pub mod display;
#[cfg(test)]
pub mod doubles;
pub mod events;
pub mod extra;
pub mod health;
pub mod ids;
pub mod kube_api;
pub mod kubelet;
pub mod manager;
pub mod mode;
pub mod nvml;
pub mod plugin;
pub mod pods;
pub mod recovery;
pub mod registry;
pub mod response;
pub mod runtime;
pub mod vm;
pub mod world;
