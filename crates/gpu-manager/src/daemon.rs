//! Startup in order, each step logged with its time; a missing
//! prerequisite stops the daemon with one error that says what to fix.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use device_plugin::PluginRuntime;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::Checkpoint;
use crate::config::Settings;
use crate::display::ManagerSource;
use crate::events::KubeEvents;
use crate::extra::ExtraConfig;
use crate::ids::{VCORE_RESOURCE, VCORE_SOCKET, VMEMORY_RESOURCE, VMEMORY_SOCKET};
use crate::kube_api::{self, Patcher, PodWatch};
use crate::kubelet::KubeletRecords;
use crate::manager::{Manager, ManagerConfig, ManagerParts};
use crate::plugin::{VcorePlugin, VmemoryPlugin};
use crate::runtime;
use crate::world::{ContainerRuntime, World};
use crate::{health, nvml};

/// A Kubernetes label value from free text (GPU model names have spaces).
fn label_value(s: &str) -> String {
    let v: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    v.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .chars()
        .take(63)
        .collect()
}

/// [`vdriver::mirror`], its error naming the host root and the destination.
pub fn mirror_driver(
    host_root: &Path,
    volumes: &vdriver::VolumeConfig,
    dest: &Path,
    interposer: Option<&Path>,
) -> anyhow::Result<vdriver::MirrorReport> {
    vdriver::mirror(host_root, volumes, dest, interposer).with_context(|| {
        format!(
            "mirroring the NVIDIA driver of host root {} into {}",
            host_root.display(),
            dest.display()
        )
    })
}

/// Starts `display` (gRPC on `socket`, HTTP on `query_addr`), sampling
/// the GPUs through `nvml` every `sample_period`.
pub async fn start_display(
    display: &gpu_display::Display,
    nvml: &Arc<nvml_wrapper::Nvml>,
    socket: PathBuf,
    query_addr: SocketAddr,
    sample_period: Duration,
    cancel: &CancellationToken,
) -> anyhow::Result<gpu_display::Running> {
    let reader = gpu_display::NvmlReader::new(nvml.clone(), sample_period);
    display
        .start(
            &gpu_display::DisplayOptions {
                socket,
                query_addr,
                sample_period,
                ..Default::default()
            },
            Some(Box::new(reader)),
            cancel.clone(),
        )
        .await
        .context("starting the display service")
}

pub async fn run(settings: Settings, cancel: CancellationToken) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let s = Arc::new(settings);
    tracing::info!(node = %s.node_name, share_mode = s.share_mode, host_root = %s.host_root.display(), "gpu-manager starting");

    // 1. Prerequisites that need nothing else.
    if !s.device_plugin_path.is_dir() {
        bail!(
            "kubelet's device-plugin directory {} does not exist: is kubelet running on this node, and is --device-plugin-path right?",
            s.device_plugin_path.display()
        );
    }
    crate::mode::refuse_if_dra_serving(&s.device_plugin_path).map_err(anyhow::Error::msg)?;
    let volumes = vdriver::VolumeConfig::load(&s.volume_config)
        .with_context(|| format!("loading --volume-config {}", s.volume_config.display()))?;
    let extra = match &s.extra_config {
        Some(p) => ExtraConfig::load(p)?,
        None => ExtraConfig::default(),
    };
    if let Some(i) = &s.interposer
        && !i.is_file()
    {
        bail!(
            "--interposer {} does not exist: build cuda-shim or fix the path",
            i.display()
        );
    }
    tracing::info!(
        ms = t0.elapsed().as_millis() as u64,
        "step 1/6: configuration checked"
    );

    // 2. GPUs.
    let nvml_path = s.nvml_path()?;
    let nvml = nvml::load(&nvml_path)?;
    let found = nvml::discover(&nvml)?;
    let topo = &found.topology;
    for (g, name) in topo.gpus().iter().zip(&found.names) {
        tracing::info!(
            gpu = g.index, name, uuid = %g.uuid, minor = g.minor, bus = %g.pci_bus_id,
            memory_mib = g.memory_bytes >> 20, numa = ?g.numa_node, "GPU"
        );
    }
    tracing::info!(
        ms = t0.elapsed().as_millis() as u64, gpus = topo.len(), nvlink = topo.has_nvlink(),
        driver = %found.driver_version, nvml = %nvml_path.display(), "step 2/6: GPUs discovered"
    );
    let allocator = gpu_allocator::Allocator::new(found.topology.clone());
    eprintln!("{}", allocator.render());

    // 3. Driver mirror (its time is reported apart: it depends on the driver's size).
    let tm = Instant::now();
    let report = mirror_driver(
        &s.host_root,
        &volumes,
        &s.vdriver_path,
        s.interposer.as_deref(),
    )?;
    let mirror_ms = tm.elapsed().as_millis() as u64;
    tracing::info!(ms = t0.elapsed().as_millis() as u64, mirror_ms, driver = %report.driver_version, "step 3/6: driver mirrored");

    // 4. API server: this node's pods.
    let client = kube_api::client(s.kubeconfig.as_deref()).await?;
    let pods = PodWatch::start(client.clone(), &s.node_name, cancel.clone());
    if let Err(e) = pods.ready(s.api_timeout).await {
        // Degrade rather than crash-loop: running containers need the
        // manager (sockets, recovery); the watch keeps retrying.
        tracing::error!(
            "the API server did not list this node's pods within {} s ({e}): check --kubeconfig or the service account, and that the API server is reachable; \
             going on without it: nothing is released on its account and Allocate answers Unavailable until it answers",
            s.api_timeout.as_secs()
        );
    }
    let mut labels: BTreeMap<String, String> = s.node_labels.iter().cloned().collect();
    if let Some(model) = found.names.first() {
        labels
            .entry("tencent.com/gpu-model".into())
            .or_insert_with(|| label_value(model));
    }
    kube_api::label_node(&client, &s.node_name, &labels).await;
    tracing::info!(
        ms = t0.elapsed().as_millis() as u64,
        pods = pods.pods().len(),
        "step 4/6: API server in sync"
    );

    // 5. State: recovery (checkpoint reconciled with the node), health,
    // display and samples, pod-deletion watch, periodic checks.
    let kind = runtime::Kind::parse(&s.container_runtime).unwrap_or(runtime::Kind::Auto);
    let runtime: Arc<dyn ContainerRuntime> =
        runtime::select(kind, &s.container_runtime_endpoint).await;
    let mgr = Manager::new(ManagerParts {
        config: ManagerConfig {
            node_name: s.node_name.clone(),
            share_mode: s.share_mode,
            vm_root: s.virtual_manager_path.clone(),
            vdriver_dir: s.vdriver_path.clone(),
        },
        allocator,
        driver_version: nvml::driver_major_minor(&found.driver_version),
        extra,
        world: World {
            pods: Arc::new(pods),
            patcher: Arc::new(Patcher::start(client.clone(), None)),
            events: Arc::new(KubeEvents::start(client, s.node_name.clone())),
            kubelet: Arc::new(KubeletRecords::new(
                &s.pod_resources_socket,
                &s.device_plugin_path,
            )),
            checkpoint: Arc::new(Checkpoint::new(&s.checkpoint_path)),
            runtime,
        },
    });
    let tr = Instant::now();
    let report = mgr.restore().await;
    let recovery = tr.elapsed();
    let restored = report.kept + report.rebuilt;
    tracing::info!(
        recovery_ms = recovery.as_millis() as u64,
        kept = report.kept,
        rebuilt = report.rebuilt,
        released = report.released,
        orphans_removed = report.orphans_removed,
        set_aside = ?report.set_aside,
        unreachable = ?report.unreachable,
        "recovery finished"
    );
    let (xtx, xrx) = tokio::sync::mpsc::unbounded_channel();
    let uuids = mgr.gpus().iter().map(|g| g.uuid.clone()).collect();
    nvml::watch_xids(
        nvml.clone(),
        uuids,
        s.ignored_xids.clone(),
        xtx,
        cancel.clone(),
    );
    health::spawn(mgr.clone(), xrx, s.xid_quiet_period, cancel.clone());
    let display = gpu_display::Display::new(Arc::new(ManagerSource {
        mgr: mgr.clone(),
        node: s.node_name.clone(),
        models: found.names.clone(),
    }));
    let metrics = display.metrics();
    let query_addr = tokio::net::lookup_host((s.query_addr.as_str(), s.query_port))
        .await
        .ok()
        .and_then(|mut a| a.next())
        .with_context(|| {
            format!(
                "--query-addr {:?} is not an address of this host",
                s.query_addr
            )
        })?;
    let running = start_display(
        &display,
        &nvml,
        s.display_socket.clone(),
        query_addr,
        s.sample_period,
        &cancel,
    )
    .await?;
    tracing::info!(
        "display: HTTP on {}, socket {}",
        running.http_addr,
        running.socket.display()
    );
    {
        let (mgr, c, period) = (mgr.clone(), cancel.clone(), s.allocation_check_period);
        // A fresh allocation has no container yet: "no container, no kubelet
        // record" counts only after this long.
        let grace = (period * 2).max(Duration::from_secs(10));
        tokio::spawn(async move {
            let mut t = tokio::time::interval(period);
            t.tick().await;
            loop {
                tokio::select! {
                    _ = c.cancelled() => return,
                    _ = t.tick() => mgr.check_allocations(grace).await,
                }
            }
        });
    }
    mgr.spawn_lazy_flush(cancel.clone());
    {
        // Deleted pods free their capacity as soon as the watch sees it.
        let (mgr, c) = (mgr.clone(), cancel.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = c.cancelled() => return,
                    _ = mgr.pod_changes() => { mgr.release_deleted_pods(); }
                }
            }
        });
    }
    tracing::info!(
        ms = t0.elapsed().as_millis() as u64,
        restored,
        "step 5/6: state ready"
    );

    // 6. Device plugins.
    let handle = PluginRuntime::new(&s.device_plugin_path)
        .plugin(
            VCORE_RESOURCE,
            VCORE_SOCKET,
            Arc::new(VcorePlugin(mgr.clone(), metrics.clone())),
        )
        .plugin(
            VMEMORY_RESOURCE,
            VMEMORY_SOCKET,
            Arc::new(VmemoryPlugin(mgr.clone(), metrics.clone())),
        )
        .start(cancel.clone())
        .context("starting the device plugins")?;
    let mut statuses: Vec<_> = [VCORE_RESOURCE, VMEMORY_RESOURCE]
        .iter()
        .filter_map(|r| handle.status(r))
        .collect();
    let registered = async {
        for st in &mut statuses {
            let _ = st.wait_for(|s| s.registered).await;
        }
    };
    tokio::pin!(registered);
    let ready = tokio::select! {
        _ = &mut registered => true,
        _ = tokio::time::sleep(Duration::from_secs(5)) => {
            tracing::warn!("kubelet has not accepted the registration within 5 s; still trying (is kubelet running?)");
            tokio::select! {
                _ = &mut registered => true,
                _ = cancel.cancelled() => false,
            }
        }
        _ = cancel.cancelled() => false,
    };
    if ready {
        let ms = t0.elapsed().as_millis() as u64;
        tracing::info!(
            ms,
            mirror_ms,
            ready_excluding_mirror_ms = ms.saturating_sub(mirror_ms),
            "step 6/6: registered with kubelet; ready"
        );
        metrics.set_recovery_duration(recovery);
        display.set_ready(true);
    }
    cancel.cancelled().await;
    tracing::info!("shutting down");
    // Releases not yet written (they wait for the next write).
    let _ = mgr.flush().await;
    display.set_ready(false);
    let plugins = handle.wait().await.context("stopping the device plugins");
    running.wait().await;
    plugins?;
    Ok(())
}
