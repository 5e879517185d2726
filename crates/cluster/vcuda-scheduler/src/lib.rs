//! `vcuda-scheduler`: a kube-scheduler HTTP extender for vcuda's
//! device-plugin mode (docs/scheduler.md). kube-scheduler sees only node
//! totals (`tencent.com/vcuda-core: 400`); this extender sees each GPU:
//!
//! * [`cluster`]: the cluster rebuilt from API objects alone (each node's
//!   published GPU inventory, the pods holding GPUs there), nothing
//!   remembered, so replicas and restarts agree; [`changes`]: which nodes
//!   of it a watch event changed, rebuilt alone;
//! * [`extender`]: `filter` (per-GPU fit of every GPU container, with the
//!   reason a user can act on) and `prioritize` ([`policy`]: binpack or
//!   spread, per pod by annotation, topology for several GPUs);
//! * [`bind`]: the GPUs written where the manager reads them, reserved by
//!   an optimistic, conflict-checked bump of the node (no lock held);
//! * [`api`]: the extender protocol's wire types; [`kube_api`]: the API
//!   server behind the caches and bind; [`http`]: the endpoints; [`access`]:
//!   who may call them (loopback, or kube-scheduler's client certificate).

pub mod access;
pub mod api;
pub mod bind;
pub mod changes;
pub mod cluster;
pub mod extender;
pub mod http;
pub mod kube_api;
pub mod policy;

#[cfg(test)]
mod bind_tests;
#[cfg(test)]
mod tests;
