//! The token a daemon stops on.

use tokio_util::sync::CancellationToken;

/// Returns a token cancelled on the first SIGTERM or SIGINT, which is how
/// kubelet/the container runtime stops a DaemonSet pod. Must be called inside
/// a tokio runtime.
pub fn cancel_on_signals() -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
            () = t.cancelled() => {}
        }
        t.cancel();
    });
    Ok(token)
}
