//! Logging set-up for binaries.

/// Installs the global subscriber the daemons share: stderr, filtered by
/// `RUST_LOG` (default `info`), colours only when stderr is a terminal.
/// Panics if a global subscriber is already set.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
