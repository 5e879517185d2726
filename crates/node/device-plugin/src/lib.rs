//! Serve kubelet device plugins (`deviceplugin/v1beta1`).
//!
//! A plugin implements [`DevicePluginService`]; [`PluginRuntime`] serves any
//! number of them from one process, each on its own unix socket in the
//! device-plugin dir, and takes care of what every plugin needs and is easy to
//! get wrong:
//!
//! * registration with kubelet, retried with capped exponential backoff while
//!   kubelet is absent;
//! * `ListAndWatch` streams that send the device list at once and after every
//!   change;
//! * kubelet restarts: kubelet deletes every socket in the dir when it starts,
//!   so the runtime watches the dir (inotify, plus a periodic check) and
//!   re-binds and re-registers in the same process, keeping plugin state;
//! * validation of `Allocate`, `PreStartContainer` and
//!   `GetPreferredAllocation` input (`InvalidArgument` naming the bad field);
//! * graceful shutdown that removes the sockets;
//! * a supervisor's relay ([`RelayedPlugin`], [`serve_inbox`]): the kubelet's
//!   connections and streams outlive the process that answers them.

mod client;
mod error;
mod grpc;
mod relay;
mod runtime;
mod service;
pub mod validate;

pub use client::connect_unix;
pub use error::Error;
pub use relay::{RelayedPlugin, serve_inbox};
pub use runtime::{PluginRuntime, PluginStatus, RuntimeHandle, RuntimeOptions, all_registered};
pub use service::{DeviceList, DevicePluginService, device};
pub use tokio_util::sync::CancellationToken;
pub use vcuda_api::deviceplugin::v1beta1 as api;
