//! A real single-node Kubernetes (tests/k8s/cluster.sh, binaries from
//! tests/k8s/build-kubernetes.sh) and what the suites run on it share: the
//! constants, polling, the machine lock, clean-ups ([`util`]); the cluster,
//! kubectl, pods and images ([`cluster`]); helm with a test post-renderer
//! ([`helm`]); the lock that keeps side-by-side suites' figures out of
//! each other's heavy phases ([`host_load`]).

pub mod cluster;
pub mod helm;
pub mod host_load;
pub mod util;
pub mod webhook;

pub use util::k8s_bin;
