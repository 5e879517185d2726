//! What every vcuda daemon starts with: logs on stderr ([`init_logging`]),
//! a token cancelled on SIGTERM/SIGINT ([`cancel_on_signals`]) and the API
//! server client ([`apiserver`]), and the reflector task every watch runs
//! on ([`reflect`]). Kept apart from the node floor so the
//! scheduler extender, which runs cluster-wide, builds none of NVML, gRPC,
//! the driver mirror or the metrics.

pub mod apiserver;
mod logging;
pub mod reflect;
mod signals;

pub use logging::init_logging;
pub use signals::cancel_on_signals;
