use std::path::PathBuf;

/// Errors of the device-plugin runtime. Each names the file or peer that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("binding plugin socket {path}: {source} (is the device-plugin dir writable?)")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("connecting to {path}: timed out after {timeout_ms} ms")]
    ConnectTimeout { path: PathBuf, timeout_ms: u64 },
    #[error("registering {resource} with kubelet at {path}: {code:?}: {message}")]
    Register {
        resource: String,
        path: PathBuf,
        code: tonic::Code,
        message: String,
    },
    #[error("watching device-plugin dir {path}: {source}")]
    Watch {
        path: PathBuf,
        #[source]
        source: notify::Error,
    },
    #[error("invalid plugin configuration: {0}")]
    Config(String),
    #[error("plugin task for {resource} failed: {reason}")]
    Task { resource: String, reason: String },
}
