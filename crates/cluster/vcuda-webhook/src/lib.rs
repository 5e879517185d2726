//! `vcuda-webhook`: the admission webhook of vcuda (docs/webhook.md).
//!
//! * [`validate`]: a vcuda request no node of the cluster could place is
//!   refused at `kubectl apply` with the message Allocate would give, and
//!   placement annotations are vcuda's alone;
//! * [`mutate`]: the extender's scheduler name, and on DRA clusters the
//!   rewrite of `vcuda-core`/`vcuda-memory` limits into a claim;
//! * [`review`]: the AdmissionReview wire; [`http`]: the endpoints;
//!   [`world`]: the cluster it reads and writes, [`kube_api`] behind it;
//! * [`certs`], [`rotate`]: its own CA and serving certificate, renewed
//!   and patched into the configurations (`--self-managed`).

pub mod certs;
pub mod http;
pub mod kube_api;
pub mod mutate;
pub mod review;
pub mod rotate;
pub mod validate;
pub mod world;

#[cfg(test)]
mod tests;
