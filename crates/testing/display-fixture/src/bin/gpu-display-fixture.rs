//! The display service without a manager: serves gRPC and HTTP for a
//! container list read from a JSON file (`gpu_display_fixture::FixtureState`),
//! with utilization sampled from a real (or simulated) NVML. For tests and
//! for trying dashboards; prints `ready http=<addr> socket=<path>` once up.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use gpu_display::{Display, DisplayOptions, GpuReader, NvmlReader};
use gpu_display_fixture::StaticSource;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// JSON description of node, GPUs and containers; re-read when it changes.
    #[arg(long)]
    state: PathBuf,
    /// libnvidia-ml.so.1 to sample; no sampling without it.
    #[arg(long)]
    nvml_lib: Option<PathBuf>,
    #[arg(long, default_value = gpu_display::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[arg(long, default_value = gpu_display::DEFAULT_QUERY_ADDR)]
    query_addr: String,
    /// 0 picks a free port (printed on the ready line).
    #[arg(long, default_value_t = gpu_display::DEFAULT_QUERY_PORT)]
    query_port: u16,
    /// NVML sampling period, e.g. 1s or 500ms.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    sample_period: Duration,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .unwrap_or((s, "s"));
    let n: u64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        _ => Err(format!("bad duration {s:?}: use ms or s")),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let source = StaticSource::from_file(&args.state)
        .with_context(|| format!("reading {}", args.state.display()))?;
    let display = Display::new(Arc::new(source));
    let reader = match &args.nvml_lib {
        Some(lib) => {
            Some(Box::new(NvmlReader::open(lib, args.sample_period)?) as Box<dyn GpuReader>)
        }
        None => None,
    };
    let ip = args.query_addr.parse().context("--query-addr")?;
    let opts = DisplayOptions {
        socket: args.socket,
        query_addr: SocketAddr::new(ip, args.query_port),
        sample_period: args.sample_period,
        ..Default::default()
    };
    let cancel = CancellationToken::new();
    let running = display.start(&opts, reader, cancel.clone()).await?;
    display.set_ready(true);
    println!(
        "ready http={} socket={}",
        running.http_addr,
        running.socket.display()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    cancel.cancel();
    running.wait().await;
    Ok(())
}
