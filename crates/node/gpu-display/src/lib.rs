//! Display service of gpu-manager: what operators and Prometheus see.
//!
//! * gRPC `display.GPUDisplay` (PrintGraph, PrintUsages, Version) on a unix
//!   socket, for `vcudactl` and the original's clients;
//! * HTTP on the query port: `/graph`, `/usage`, `/version`, `/metrics`
//!   (alias `/metric`), `/healthz`, `/readyz`; optionally the probes and
//!   the metrics each on a listener of its own;
//! * Prometheus metrics per GPU, per container and for the manager;
//! * a sampler thread reading NVML every sample period; scrapes read its
//!   last snapshot, never NVML.
//!
//! The manager implements [`DisplaySource`] (a narrow view of its state),
//! bumps [`ManagerMetrics`], and starts everything with [`Display::start`].

mod grpc;
pub mod guard;
mod http;
pub mod metrics;
pub mod sampler;
pub mod source;
pub mod usage;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use metrics::ManagerMetrics;
use metrics::MetricsRegistry;
pub use sampler::{
    GpuReader, GpuSample, MigSample, NvmlReader, Sampler, SamplerStats, Snapshot, SnapshotCell,
};
pub use source::{
    ContainerView, DisplaySource, DynamicMigView, GpuRef, GpuView, LostMigView, Unhealthy,
};

/// Default unix socket of the display service (the original's).
pub const DEFAULT_SOCKET: &str = "/var/run/gpu-manager.sock";
/// Default `--query-addr`.
pub const DEFAULT_QUERY_ADDR: &str = "127.0.0.1";
/// Default `--query-port`.
pub const DEFAULT_QUERY_PORT: u16 = 5678;

/// Errors of the display service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("NVML: {what}: {source}")]
    Nvml {
        what: String,
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("starting the sampler thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("display socket {}: {source}", path.display())]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "display socket {} is in use by a running server (another gpu-manager?); stop it or pick another --display-socket",
        path.display()
    )]
    SocketInUse { path: PathBuf },
    #[error(
        "binding the query port {addr}: {source} (is another gpu-manager running? see --query-addr/--query-port)"
    )]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("binding the probe port {addr}: {source} (see --health-port, --metrics-addr)")]
    BindProbes {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("binding the metrics port {addr}: {source} (see --metrics-port, --metrics-addr)")]
    BindMetrics {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Where and how often to serve.
#[derive(Debug, Clone)]
pub struct DisplayOptions {
    /// Unix socket of the gRPC service.
    pub socket: PathBuf,
    /// Permissions of the socket (root and the socket's group).
    pub socket_mode: u32,
    /// HTTP listen address (`--query-addr:--query-port`); port 0 picks one.
    pub query_addr: SocketAddr,
    /// The probe listener's address (`--health-port`): `/healthz` and
    /// `/readyz` alone; `None`: the probes are served on the query port
    /// only.
    pub health_addr: Option<SocketAddr>,
    /// The metrics listener's address (`--metrics-port`): `/metrics` alone,
    /// for Prometheus, so the query port can stay node-local; `None`: the
    /// metrics are served on the query port only.
    pub metrics_addr: Option<SocketAddr>,
    /// NVML sampling period (`--sample-period`).
    pub sample_period: Duration,
    /// Bind the socket even when a live server answers on it (a manager
    /// started beside the one it replaces); refused otherwise.
    pub take_over_socket: bool,
    /// What the escape guard does after each sample ([`guard`]); `None`:
    /// no guard.
    pub escape_policy: Option<guard::Policy>,
}

impl Default for DisplayOptions {
    fn default() -> Self {
        DisplayOptions {
            socket: PathBuf::from(DEFAULT_SOCKET),
            socket_mode: 0o660,
            query_addr: SocketAddr::new(DEFAULT_QUERY_ADDR.parse().unwrap(), DEFAULT_QUERY_PORT),
            health_addr: None,
            metrics_addr: None,
            sample_period: Duration::from_secs(1),
            take_over_socket: false,
            escape_policy: Some(guard::Policy::Report),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) source: Arc<dyn DisplaySource>,
    pub(crate) metrics: MetricsRegistry,
    pub(crate) snapshot: Arc<SnapshotCell>,
    pub(crate) stats: Arc<SamplerStats>,
    pub(crate) ready: AtomicBool,
    pub(crate) on_escape: std::sync::OnceLock<guard::Notify>,
}

impl Shared {
    /// `/graph` and `PrintGraph`: the source's tree, then the MIG devices
    /// the last sample found (they are no share or whole GPU of its tree).
    pub(crate) fn graph(&self) -> String {
        let mut out = self.source.graph_text();
        let snap = self.snapshot.load();
        let mig: Vec<(u32, &MigSample)> = snap
            .gpus
            .iter()
            .flat_map(|g| g.mig.iter().map(move |m| (g.index, m)))
            .collect();
        if !mig.is_empty() {
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str("MIG devices:\n");
            for (gpu, m) in mig {
                out.push_str(&format!(
                    "├─ GPU{gpu} {} {}: memory {}/{} MiB used, {} process(es)\n",
                    m.uuid,
                    m.profile,
                    m.memory_used_bytes >> 20,
                    m.memory_total_bytes >> 20,
                    m.processes
                ));
            }
        }
        out
    }

    pub(crate) fn render_metrics(&self) -> String {
        let src = &self.source;
        self.metrics.render(
            &src.node_name(),
            &src.gpus(),
            &src.containers(),
            &metrics::MigState {
                lost: src.lost_mig_devices(),
                dynamic: src.dynamic_mig(),
            },
            &self.snapshot.load(),
            &self.stats,
        )
    }
}

/// The display service of one manager. Cheap to clone.
#[derive(Clone)]
pub struct Display {
    shared: Arc<Shared>,
}

impl Display {
    pub fn new(source: Arc<dyn DisplaySource>) -> Display {
        let version = source.version();
        Display {
            shared: Arc::new(Shared {
                source,
                metrics: MetricsRegistry::new(&version),
                snapshot: Arc::new(SnapshotCell::default()),
                stats: Arc::new(SamplerStats::default()),
                ready: AtomicBool::new(false),
                on_escape: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Handle for the manager's counters (allocations, latency, recovery).
    pub fn metrics(&self) -> ManagerMetrics {
        self.shared.metrics.manager.clone()
    }

    /// What `/readyz` answers: set once the device plugins are registered
    /// and recovery is done.
    pub fn set_ready(&self, ready: bool) {
        self.shared.ready.store(ready, Ordering::Release);
        self.shared.metrics.manager.set_ready(ready);
    }

    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Acquire)
    }

    /// The `/metrics` text, as a scrape would get it now.
    pub fn render_metrics(&self) -> String {
        self.shared.render_metrics()
    }

    /// The sampler's latest snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.shared.snapshot.load()
    }

    /// Figures about the sampler (ticks, its thread's CPU time).
    pub fn sampler_stats(&self) -> Arc<SamplerStats> {
        self.shared.stats.clone()
    }

    /// Publishes a snapshot directly (tests and benchmarks without NVML).
    pub fn store_snapshot(&self, s: Snapshot) {
        self.shared.snapshot.store(s);
    }

    /// Starts the sampler thread; it stops when the returned handle drops.
    pub fn start_sampler(
        &self,
        reader: impl GpuReader,
        period: Duration,
    ) -> Result<Sampler, Error> {
        self.start_guarded_sampler(reader, period, None)
    }

    /// Tells the daemon about each new escape (an Event on the pod). Set
    /// once, before [`Display::start`].
    pub fn on_escape(&self, notify: guard::Notify) {
        let _ = self.shared.on_escape.set(notify);
    }

    /// [`Display::start_sampler`], with the escape guard judging each
    /// sample under `policy` (none: no guard).
    pub fn start_guarded_sampler(
        &self,
        reader: impl GpuReader,
        period: Duration,
        policy: Option<guard::Policy>,
    ) -> Result<Sampler, Error> {
        let after = policy.map(|policy| {
            let shared = self.shared.clone();
            let mut g = guard::Guard::new(
                guard::Host,
                policy,
                shared.metrics.manager.clone(),
                shared.on_escape.get().cloned(),
            );
            Box::new(move |s: &Snapshot| {
                g.check(s, &shared.source.containers());
            }) as sampler::AfterSample
        });
        Sampler::spawn_with(
            reader,
            period,
            self.shared.snapshot.clone(),
            self.shared.stats.clone(),
            after,
        )
    }

    /// Serves gRPC `display.GPUDisplay` on the unix socket `path` until
    /// `cancel`; removes the socket when done (if still its own). Binds it
    /// again should another process remove it meanwhile.
    pub fn serve_grpc(
        &self,
        path: &Path,
        mode: u32,
        cancel: CancellationToken,
    ) -> Result<JoinHandle<()>, Error> {
        grpc::serve(self.shared.clone(), path, mode, false, cancel)
    }

    /// [`Display::serve_grpc`], taking the path over from a live server.
    pub fn serve_grpc_taking_over(
        &self,
        path: &Path,
        mode: u32,
        cancel: CancellationToken,
    ) -> Result<JoinHandle<()>, Error> {
        grpc::serve(self.shared.clone(), path, mode, true, cancel)
    }

    /// Serves HTTP on `addr` until `cancel`; returns the bound address.
    pub async fn serve_http(
        &self,
        addr: SocketAddr,
        cancel: CancellationToken,
    ) -> Result<(SocketAddr, JoinHandle<()>), Error> {
        http::serve(self.shared.clone(), addr, http::Endpoints::All, cancel).await
    }

    /// The query port and, when asked for, the probe and metrics
    /// listeners; on an error, those already up stop.
    async fn serve_listeners(
        &self,
        opts: &DisplayOptions,
        cancel: CancellationToken,
    ) -> Result<Bound, Error> {
        let wanted = [
            (Some(opts.query_addr), http::Endpoints::All),
            (opts.health_addr, http::Endpoints::Probes),
            (opts.metrics_addr, http::Endpoints::Metrics),
        ];
        let mut bound = [None; 3];
        let mut tasks = Vec::new();
        for (i, (addr, endpoints)) in wanted.into_iter().enumerate() {
            let Some(addr) = addr else { continue };
            match http::serve(self.shared.clone(), addr, endpoints, cancel.clone()).await {
                Ok((at, task)) => {
                    bound[i] = Some(at);
                    tasks.push(task);
                }
                Err(e) => {
                    cancel.cancel();
                    for t in tasks {
                        let _ = t.await;
                    }
                    return Err(e);
                }
            }
        }
        let [query, health, metrics] = bound;
        Ok(Bound {
            query: query.expect("always asked for"),
            health,
            metrics,
            tasks,
        })
    }

    /// Everything: sampler (when a reader is given), gRPC and HTTP.
    pub async fn start(
        &self,
        opts: &DisplayOptions,
        reader: Option<Box<dyn GpuReader>>,
        cancel: CancellationToken,
    ) -> Result<Running, Error> {
        let sampler = match reader {
            Some(r) => Some(self.start_guarded_sampler(
                BoxedReader(r),
                opts.sample_period,
                opts.escape_policy,
            )?),
            None => None,
        };
        let grpc = grpc::serve(
            self.shared.clone(),
            &opts.socket,
            opts.socket_mode,
            opts.take_over_socket,
            cancel.clone(),
        )?;
        let bound = match self.serve_listeners(opts, cancel.clone()).await {
            Ok(v) => v,
            Err(e) => {
                cancel.cancel();
                let _ = grpc.await;
                return Err(e);
            }
        };
        tracing::info!(socket = %opts.socket.display(), http = %bound.query, probes = ?bound.health, metrics = ?bound.metrics, "display service up");
        let mut tasks = vec![grpc];
        tasks.extend(bound.tasks);
        Ok(Running {
            http_addr: bound.query,
            health_addr: bound.health,
            metrics_addr: bound.metrics,
            socket: opts.socket.clone(),
            sampler,
            tasks,
        })
    }
}

/// The HTTP listeners [`Display::start`] bound.
struct Bound {
    query: SocketAddr,
    health: Option<SocketAddr>,
    metrics: Option<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
}

struct BoxedReader(Box<dyn GpuReader>);

impl GpuReader for BoxedReader {
    fn sample(&mut self) -> Result<Vec<sampler::GpuSample>, Error> {
        self.0.sample()
    }
}

/// The running display service (see [`Display::start`]).
pub struct Running {
    pub http_addr: SocketAddr,
    /// The probe listener's bound address, when one was asked for.
    pub health_addr: Option<SocketAddr>,
    /// The metrics listener's bound address, when one was asked for.
    pub metrics_addr: Option<SocketAddr>,
    pub socket: PathBuf,
    sampler: Option<Sampler>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Waits for the servers to stop (after the cancel token fired) and
    /// stops the sampler.
    pub async fn wait(self) {
        for t in self.tasks {
            let _ = t.await;
        }
        if let Some(s) = self.sampler {
            tokio::task::spawn_blocking(move || s.stop()).await.ok();
        }
    }
}
