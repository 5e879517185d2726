//! `vcudactl`: reads gpu-manager's display service (gRPC `display.GPUDisplay`
//! on its unix socket) and prints the GPU tree, per-container usage against
//! quotas, or a refreshing view of both.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};
use vcuda_api::display::UsageResponse;
use vcuda_api::display::gpu_display_client::GpuDisplayClient;

mod table;

#[derive(Parser)]
#[command(
    version,
    about = "Inspect gpu-manager: GPU tree, per-container usage and quotas"
)]
struct Cli {
    /// gpu-manager's display socket.
    #[arg(
        long,
        global = true,
        env = "VCUDA_DISPLAY_SOCKET",
        default_value = "/var/run/gpu-manager.sock"
    )]
    socket: PathBuf,
    /// Give up on a call after this many seconds.
    #[arg(long, global = true, default_value_t = 5)]
    timeout: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The topology tree with used/free cores and memory per GPU.
    Graph,
    /// A table of containers: namespace, pod, container, GPUs, use against quota.
    Usage {
        /// Show the pod UID too.
        #[arg(long, short = 'w')]
        wide: bool,
    },
    /// The manager's version (and this tool's).
    Version,
    /// Usage and graph, refreshed until Ctrl-C.
    Top {
        /// Seconds between refreshes.
        #[arg(long, short = 'n', default_value_t = 2.0)]
        interval: f64,
        /// Stop after this many refreshes (0: until Ctrl-C).
        #[arg(long, default_value_t = 0)]
        iterations: u64,
        /// Show the pod UID too.
        #[arg(long, short = 'w')]
        wide: bool,
    },
}

/// Opens the socket, turning the usual failures into one clear sentence.
async fn connect(path: &Path, timeout: Duration) -> Result<GpuDisplayClient<Channel>> {
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "no gpu-manager socket at {shown}: gpu-manager is not running on this node, \
             or serves its display elsewhere (pass --socket or set VCUDA_DISPLAY_SOCKET)"
        ),
        Err(e) => bail!("cannot look at {shown}: {e}"),
        Ok(_) => {}
    }
    // Probe once ourselves: tonic's transport errors hide the OS reason.
    match tokio::time::timeout(timeout, UnixStream::connect(path)).await {
        Err(_) => bail!("gpu-manager did not accept a connection on {shown} within {timeout:?}"),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => bail!(
            "gpu-manager is not listening on {shown} (a socket left by a stopped manager?); \
             check that gpu-manager is running"
        ),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => bail!(
            "permission denied on {shown}: run vcudactl as root or as a member of the socket's group"
        ),
        Ok(Err(e)) => bail!("connecting to {shown}: {e}"),
        Ok(Ok(_probe)) => {}
    }
    let p = path.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let p = p.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
    });
    let ch = Endpoint::from_static("http://localhost")
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(connector)
        .await
        .with_context(|| format!("opening a gRPC channel on {shown}"))?;
    Ok(GpuDisplayClient::new(ch))
}

/// Names the RPC and what to do for the statuses an operator can act on.
fn rpc_error(path: &Path, method: &str, s: tonic::Status) -> anyhow::Error {
    let shown = path.display();
    match s.code() {
        tonic::Code::Unimplemented => anyhow::anyhow!(
            "the server on {shown} does not implement display.GPUDisplay/{method}: \
             gpu-manager is too old (or this is not gpu-manager); upgrade gpu-manager"
        ),
        tonic::Code::Unavailable => anyhow::anyhow!(
            "gpu-manager on {shown} is unavailable ({}); is it restarting?",
            s.message()
        ),
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => anyhow::anyhow!(
            "gpu-manager on {shown} did not answer {method} in time (raise --timeout)"
        ),
        _ => anyhow::anyhow!("{method} on {shown} failed: {}: {}", s.code(), s.message()),
    }
}

async fn usages(c: &mut GpuDisplayClient<Channel>, path: &Path) -> Result<UsageResponse> {
    Ok(c.print_usages(())
        .await
        .map_err(|s| rpc_error(path, "PrintUsages", s))?
        .into_inner())
}

async fn graph(c: &mut GpuDisplayClient<Channel>, path: &Path) -> Result<String> {
    Ok(c.print_graph(())
        .await
        .map_err(|s| rpc_error(path, "PrintGraph", s))?
        .into_inner()
        .graph)
}

async fn run(cli: Cli) -> Result<()> {
    let timeout = Duration::from_secs(cli.timeout.max(1));
    let path = cli.socket.as_path();
    let mut c = connect(path, timeout).await?;
    let mut out = std::io::stdout().lock();
    match cli.cmd {
        Cmd::Graph => write!(out, "{}", graph(&mut c, path).await?)?,
        Cmd::Usage { wide } => write!(
            out,
            "{}",
            table::usage_table(&usages(&mut c, path).await?, wide)
        )?,
        Cmd::Version => {
            let v = c
                .version(())
                .await
                .map_err(|s| rpc_error(path, "Version", s))?
                .into_inner();
            writeln!(out, "gpu-manager {}", v.version)?;
            writeln!(out, "vcudactl {}", env!("CARGO_PKG_VERSION"))?;
        }
        Cmd::Top {
            interval,
            iterations,
            wide,
        } => {
            let tty = out.is_terminal();
            let period = Duration::from_secs_f64(interval.max(0.1));
            let mut n = 0u64;
            loop {
                let u = usages(&mut c, path).await?;
                let g = graph(&mut c, path).await?;
                if tty {
                    // Home and clear: redraw in place.
                    write!(out, "\x1b[H\x1b[2J")?;
                } else if n > 0 {
                    writeln!(out)?;
                }
                writeln!(
                    out,
                    "vcudactl top: {} every {:.1}s (Ctrl-C to quit)\n",
                    path.display(),
                    period.as_secs_f64()
                )?;
                write!(out, "{}", table::usage_table(&u, wide))?;
                writeln!(out)?;
                write!(out, "{g}")?;
                out.flush()?;
                n += 1;
                if iterations > 0 && n >= iterations {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(period) => {}
                    _ = tokio::signal::ctrl_c() => break,
                }
            }
        }
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("vcudactl: {e:#}");
        std::process::exit(1);
    }
}
