//! Runs the API server emulator until SIGTERM/SIGINT.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
#[command(
    about = "Kubernetes API server emulator (pods and nodes) for tests and the simulated node"
)]
struct Args {
    /// Address to listen on (plain HTTP).
    #[arg(long, default_value = "127.0.0.1:6443")]
    listen: String,
    /// Write a kubeconfig pointing at this server here.
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// Create a Node object with this name at start.
    #[arg(long)]
    node: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let server = apiserver_emulator::ApiServer::start(&args.listen)
        .await
        .context("starting the API server emulator")?;
    if let Some(node) = &args.node {
        server.create_node(serde_json::json!({"metadata": {"name": node}}))?;
    }
    if let Some(p) = &args.kubeconfig_out {
        server.write_kubeconfig(p)?;
    }
    println!("{}", server.url());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    server.stop();
    Ok(())
}
