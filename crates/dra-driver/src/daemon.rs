//! The driver on a node: discover GPUs (NVML from the host root), mirror
//! the driver with the interposer (the device plugin's vdriver volumes),
//! create the DeviceClasses, publish the slice, restore prepared claims
//! from the checkpoint, serve the kubelet plugin and registration sockets,
//! and republish on health changes (critical Xids), whenever the slice is
//! changed or deleted behind the driver's back (a watch), and periodically.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::display::DraSource;
use crate::driver::{Config, Driver};
use crate::grpc::{self, Sockets};
use crate::kube_api::KubeApi;
use crate::publish::Publisher;
use crate::slices::GpuDevice;

#[derive(Debug, Clone)]
pub struct Settings {
    pub node: String,
    pub host_root: PathBuf,
    /// `libnvidia-ml.so.1` (default: found in the host root's library dirs).
    pub nvml_library: Option<PathBuf>,
    pub volume_config: PathBuf,
    pub interposer: Option<PathBuf>,
    pub vdriver_dir: PathBuf,
    pub vm_dir: PathBuf,
    pub cdi_dir: PathBuf,
    pub state_dir: PathBuf,
    pub plugins_dir: PathBuf,
    pub registry_dir: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    pub xid_quiet_period: Duration,
    pub ignored_xids: Vec<u64>,
    pub resync_period: Duration,
    pub extra_devices: Vec<String>,
    /// The display service (gRPC socket, HTTP address; port 0 picks one):
    /// claims shown like containers. None: not served.
    pub display: Option<(PathBuf, std::net::SocketAddr)>,
    pub sample_period: Duration,
}

/// What a running driver tells its starter.
pub struct Ready {
    /// The display's HTTP address, when served.
    pub display_http: Option<std::net::SocketAddr>,
}

fn nvml_path(s: &Settings) -> anyhow::Result<PathBuf> {
    if let Some(p) = &s.nvml_library {
        return Ok(if p.is_absolute() {
            p.clone()
        } else {
            s.host_root.join(p)
        });
    }
    ["usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "lib64"]
        .iter()
        .map(|d| s.host_root.join(d).join("libnvidia-ml.so.1"))
        .find(|p| p.exists())
        .with_context(|| {
            format!(
                "no libnvidia-ml.so.1 under host root {}: is the NVIDIA driver installed? Or pass --nvml-library",
                s.host_root.display()
            )
        })
}

async fn kube_client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    let cfg = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p)
                .with_context(|| format!("reading kubeconfig {}", p.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(cfg)?)
}

/// Runs until `cancel`; returns once the sockets are served through `ready`.
pub async fn run(
    s: Settings,
    cancel: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<Ready>>,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    gpu_manager::mode::refuse_if_device_plugins_serving(&s.registry_dir)
        .map_err(anyhow::Error::msg)?;
    let nvml_path = nvml_path(&s)?;
    let nvml = gpu_manager::nvml::load(&nvml_path)?;
    let found = gpu_manager::nvml::discover(&nvml)?;
    let gpus: Vec<_> = found.topology.gpus().to_vec();
    let volumes = vdriver::VolumeConfig::load(&s.volume_config)
        .with_context(|| format!("loading --volume-config {}", s.volume_config.display()))?;
    gpu_manager::daemon::mirror_driver(
        &s.host_root,
        &volumes,
        &s.vdriver_dir,
        s.interposer.as_deref(),
    )?;
    let api = KubeApi {
        client: kube_client(s.kubeconfig.as_deref()).await?,
    };
    let publisher = Publisher::new(&s.node, &found.driver_version);
    publisher
        .ensure_classes(&api)
        .await
        .map_err(anyhow::Error::msg)?;
    let mut devices: Vec<GpuDevice> = gpus
        .iter()
        .zip(&found.names)
        .map(|(g, n)| GpuDevice {
            info: g.clone(),
            model: n.clone(),
            healthy: true,
        })
        .collect();
    let published = publisher
        .reconcile(&api, &devices)
        .await
        .map_err(anyhow::Error::msg)?;
    tracing::info!(?published, gpus = devices.len(), "ResourceSlice published");
    let driver = Arc::new(Driver::start(
        Config {
            node: s.node.clone(),
            vm_root: s.vm_dir.clone(),
            vdriver_dir: s.vdriver_dir.clone(),
            cdi_dir: s.cdi_dir.clone(),
            state_dir: s.state_dir.clone(),
            driver_version: gpu_manager::nvml::driver_major_minor(&found.driver_version),
            extra_devices: s.extra_devices.clone(),
        },
        gpus.clone(),
        Arc::new(api.clone()),
    )?);
    let sockets = Sockets::new(&s.plugins_dir, &s.registry_dir);
    grpc::serve(driver.clone(), &sockets, cancel.clone()).await?;
    tracing::info!(ms = t0.elapsed().as_millis() as u64, plugin = %sockets.plugin.display(), registration = %sockets.registration.display(), "DRA driver serving");
    let healthy = Arc::new(std::sync::Mutex::new(vec![true; gpus.len()]));
    let mut display_http = None;
    let _display = match &s.display {
        None => None,
        Some((socket, addr)) => {
            let display = gpu_display::Display::new(Arc::new(DraSource {
                driver: driver.clone(),
                node: s.node.clone(),
                models: found.names.clone(),
                healthy: healthy.clone(),
            }));
            let running = gpu_manager::daemon::start_display(
                &display,
                &nvml,
                socket.clone(),
                *addr,
                s.sample_period,
                &cancel,
            )
            .await?;
            display.set_ready(true);
            display_http = Some(running.http_addr);
            Some((display, running))
        }
    };
    if let Some(r) = ready {
        let _ = r.send(Ready { display_http });
    }

    let (stx, mut srx) = tokio::sync::mpsc::unbounded_channel();
    crate::kube_api::watch_slices(api.client.clone(), &s.node, stx, cancel.clone());
    let (xtx, mut xrx) = tokio::sync::mpsc::unbounded_channel();
    let uuids = gpus.iter().map(|g| g.uuid.clone()).collect();
    gpu_manager::nvml::watch_xids(
        nvml.clone(),
        uuids,
        s.ignored_xids.clone(),
        xtx,
        cancel.clone(),
    );
    let mut last_xid: HashMap<usize, Instant> = HashMap::new();
    let tick = (s.xid_quiet_period / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut timer = tokio::time::interval(tick);
    let mut resync = Instant::now();
    loop {
        let mut changed = false;
        tokio::select! {
            _ = cancel.cancelled() => break,
            ev = xrx.recv() => {
                let Some(ev) = ev else { break };
                last_xid.insert(ev.gpu, Instant::now());
                driver.set_healthy(
                    ev.gpu,
                    false,
                    &format!(
                        "critical Xid {}: out of the ResourceSlice until {} s pass without another",
                        ev.xid,
                        s.xid_quiet_period.as_secs()
                    ),
                );
                if let Some(d) = devices.get_mut(ev.gpu) && d.healthy {
                    tracing::warn!(gpu = ev.gpu, xid = ev.xid, "GPU unhealthy after a critical Xid: taken out of the ResourceSlice");
                    d.healthy = false;
                    changed = true;
                }
            }
            Some(()) = srx.recv() => {
                while srx.try_recv().is_ok() {}
                changed = true;
            }
            _ = timer.tick() => {
                let now = Instant::now();
                last_xid.retain(|&gpu, t| {
                    if now.duration_since(*t) < s.xid_quiet_period {
                        return true;
                    }
                    driver.set_healthy(gpu, true, "");
                    if let Some(d) = devices.get_mut(gpu) {
                        tracing::info!(gpu, "no critical Xid for the quiet period: GPU back in the ResourceSlice");
                        d.healthy = true;
                        changed = true;
                    }
                    false
                });
                if now.duration_since(resync) >= s.resync_period {
                    resync = now;
                    changed = true;
                    // A backstop: closed connections release PIDs already.
                    let pruned = driver.registry().prune();
                    if pruned > 0 {
                        tracing::info!(pruned, "dead PIDs removed from pids.config");
                    }
                }
            }
        }
        if changed {
            *healthy
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                devices.iter().map(|d| d.healthy).collect();
            match publisher.reconcile(&api, &devices).await {
                Ok(p) => tracing::debug!(?p, "ResourceSlice reconciled"),
                Err(e) => {
                    tracing::warn!(error = %e, "publishing the ResourceSlice (retried at the next resync)")
                }
            }
        }
    }
    driver.shutdown();
    Ok(())
}
