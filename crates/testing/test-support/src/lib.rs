//! What vcuda's tests and benchmarks share, as one dev-dependency:
//!
//! * [`require`]: what a test needs from the machine ([`Capability`]); a
//!   missing one fails the test under CI (`VCUDA_REQUIRE_ALL=1` or the
//!   capability's own `VCUDA_REQUIRE_*`, set by tests/run.sh) and skips it,
//!   saying why, elsewhere;
//! * [`paths`], [`process`]: the checkout, the build, processes and sockets;
//! * [`sim`]: a simulated node installed by the real `gpu-sim`;
//! * [`shim`]: the interposer's side (a vdriver mirror over a sim node, the
//!   manager's registration server, workloads, the accuracy matrix);
//! * [`docker`], [`nvidia`]: the private Docker engine, NVIDIA's real drivers;
//! * [`k8s`]: the real-node cluster (tests/k8s/cluster.sh) and its helpers;
//! * behind features: [`kubelet`] (the kubelet emulator), [`manager`] (the
//!   real gpu-manager on a sim node), [`dra`] (the DRA driver in-process),
//!   [`dra_binary`] (the supervised DRA driver binary on a sim node),
//!   [`allocator`] (the allocator over a node file).
//!
//! The base depends on no daemon crate, so cuda-shim's benches can use it.

pub mod docker;
pub mod hostile;
pub mod k8s;
pub mod ledger;
pub mod nvidia;
pub mod paths;
pub mod process;
pub mod require;
pub mod sets;
pub mod shim;
pub mod sim;

#[cfg(feature = "allocator")]
pub mod allocator;
#[cfg(feature = "dra")]
pub mod dra;
#[cfg(feature = "dra")]
pub mod dra_binary;
#[cfg(feature = "kubelet")]
pub mod kubelet;
#[cfg(feature = "manager")]
pub mod manager;

pub use docker::Docker;
#[cfg(feature = "kubelet")]
pub use kubelet::{kubelet_with_plugin, options_rpc_floor};
pub use nvidia::{NvidiaDriver, nvidia_drivers};
pub use paths::{artifact, shipped_interposer, target_dir, workspace_root};
pub use process::{cmdline, http_get, kv};
pub use require::{Capability, is_root, missing, require};
pub use sim::{SimNode, compile_c, sample_ctx_cost};
