//! The driver on a node: discover GPUs (NVML from the host root), mirror
//! the driver with the interposer (the device plugin's vdriver volumes),
//! create the DeviceClasses, publish the slice, restore prepared claims
//! from the checkpoint, serve the kubelet plugin and registration sockets,
//! then run the [`SliceController`] over the GPUs' health (critical Xids)
//! and the slice watch. Each step is a function.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use node_agent::nvml::Discovered;
use tokio_util::sync::CancellationToken;

use crate::controller::SliceController;
use crate::display::DraSource;
use crate::driver::{Config, Driver, RescanError};
use crate::dynamic::DynamicGpu;
use crate::grpc::{self, Sockets};
use crate::kube_api::KubeApi;
use crate::publish::Publisher;
use crate::slices::GpuDevice;
use crate::topology;

/// Where the display service listens (port 0 picks one).
#[derive(Debug, Clone)]
pub struct DisplayAt {
    /// The gRPC socket (`vcudactl`).
    pub socket: PathBuf,
    /// The query port (HTTP: metrics, usage, probes) and, if asked for,
    /// the probe and metrics listeners.
    pub http: node_agent::config::Listeners,
}

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
    /// How a GPU with a recent critical Xid is published.
    pub unhealthy: crate::slices::Unhealthy,
    pub resync_period: Duration,
    pub extra_devices: Vec<String>,
    /// The display service: claims shown like containers. None: not
    /// served.
    pub display: Option<DisplayAt>,
    pub sample_period: Duration,
    pub escape_policy: gpu_display::guard::Policy,
    /// `--mig-geometry`, applied at start (empty: no GPU named).
    pub mig_geometry: node_agent::geometry::Geometry,
    /// `--mig-dynamic`: GPUs (index or UUID) partitioned per claim.
    pub mig_dynamic: Vec<String>,
    /// `--mig-rescan-period`: how often the static MIG devices are read
    /// again; `None`: only at start.
    pub mig_rescan_period: Option<Duration>,
}

/// What a running driver tells its starter.
pub struct Ready {
    /// The display's HTTP address, when served.
    pub display_http: Option<std::net::SocketAddr>,
}

/// Runs until `cancel`; returns once the sockets are served through `ready`.
pub async fn run(
    s: Settings,
    cancel: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<Ready>>,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let other_stopped = node_agent::mode::await_other_mode_stopped(
        || node_agent::mode::refuse_if_device_plugins_serving(&s.registry_dir),
        node_agent::mode::OTHER_MODE_PATIENCE,
        &cancel,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    if !other_stopped {
        tracing::info!("told to stop while waiting for the other mode's daemon: stopping");
        return Ok(());
    }
    match node_agent::registry::budget::raise_open_files() {
        Ok(n) => tracing::debug!(open_files = n, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    let nvml_path = node_agent::config::nvml_path(&s.host_root, s.nvml_library.as_deref())?;
    let nvml = node_agent::nvml::load(&nvml_path)?;
    let mut found = node_agent::nvml::discover(&nvml)?;
    if !s.mig_geometry.gpus.is_empty() {
        found = crate::geometry::apply(&s, &nvml, found).await?;
    }
    let dynamic = start_dynamic(&s, &nvml, &mut found).await?;
    node_agent::mig::log(&found.mig);
    let volumes = vdriver::VolumeConfig::load(&s.volume_config)
        .with_context(|| format!("loading --volume-config {}", s.volume_config.display()))?;
    node_agent::mirror_driver(
        &s.host_root,
        &volumes,
        &s.vdriver_dir,
        s.interposer.as_deref(),
    )?;
    let api = KubeApi {
        client: daemon_kit::apiserver::client(s.kubeconfig.as_deref()).await?,
    };
    let driver = Arc::new(start_driver(&s, &api, &found, &dynamic, &nvml)?);
    let events = node_agent::events::KubeEvents::start(
        api.client.clone(),
        node_agent::events::DRA_DRIVER,
        s.node.clone(),
    );
    let claim_events = crate::claim_events::ClaimEvents {
        claims: Arc::new(api.clone()),
        events: Arc::new(events),
        rt: tokio::runtime::Handle::current(),
    };
    crate::reclaims::report(&driver, claim_events.clone());
    driver
        .registry()
        .memory_witness(node_agent::nvml::memory_witness(nvml.clone()));
    let mut inherited = crate::supervise::inherited(&s.plugins_dir, &s.registry_dir)?;
    let (sockets, listeners, was_registered) = match inherited.as_mut() {
        Some(i) => (
            i.sockets.clone(),
            Some((i.inbox.try_clone()?, i.registration.try_clone()?)),
            i.registered,
        ),
        None => (Sockets::new(&s.plugins_dir, &s.registry_dir), None, false),
    };
    let registration = grpc::serve_on(driver.clone(), &sockets, listeners, cancel.clone()).await?;
    // A supervisor's earlier child was registered on these sockets: the
    // kubelet keeps that registration and does not notify again.
    registration
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .registered |= was_registered;
    tracing::info!(ms = t0.elapsed().as_millis() as u64, plugin = %sockets.plugin.display(), registration = %sockets.registration.display(), "DRA driver serving");
    let healthy = Arc::new(Mutex::new(vec![true; devices_len(&found)]));
    let display =
        start_display(&s, &driver, &found, &nvml, &healthy, &claim_events, &cancel).await?;
    if let Some(r) = ready {
        let _ = r.send(Ready {
            display_http: display.as_ref().map(|(_, r)| r.http_addr),
        });
    }
    // The kubelet prepares only for a registered driver, and refuses a pod
    // it cannot prepare for a minute or more (it retries at its resync):
    // the slice, which lets the scheduler send claims here, waits for it.
    if !registered(&registration, &cancel).await {
        return Ok(());
    }
    if let Some(i) = inherited.as_mut() {
        i.report_registered();
    }
    for p in sockets.remove_older() {
        tracing::info!(path = %p.display(), "removed an earlier instance's socket");
    }
    let (publisher, devices) = publish(&s, &api, &found, dynamic).await?;
    if let Some((d, _)) = &display {
        d.set_ready(true);
    }
    tracing::info!(
        ms = t0.elapsed().as_millis() as u64,
        "registered and published: ready"
    );

    let (stx, slice_changed) = tokio::sync::mpsc::unbounded_channel();
    crate::kube_api::watch_slices(api.client.clone(), &s.node, stx, cancel.clone());
    let (mtx, mig_changed) = tokio::sync::mpsc::unbounded_channel();
    if let Some(period) = s.mig_rescan_period
        && devices.iter().any(|d| publisher.is_dynamic(d.info.index))
    {
        spawn_dynamic_rescan(period, &driver, &nvml, devices.len(), mtx.clone(), &cancel);
    }
    if let Some(period) = s.mig_rescan_period {
        let watched: Vec<(usize, Option<Vec<node_agent::mig::MigDevice>>)> = devices
            .iter()
            .filter(|d| d.mig.is_some() && !publisher.is_dynamic(d.info.index))
            .map(|d| (d.info.index, d.mig.clone()))
            .collect();
        if !watched.is_empty() {
            // Instances an operator made or destroyed meanwhile are
            // published or withdrawn (a GPU's MIG mode is read at start).
            let mut watched = watched;
            node_agent::mig::spawn_rescan(
                period,
                nvml.clone(),
                devices.len(),
                cancel.clone(),
                move |states| {
                    let changed = mig_changes(&mut watched, &states);
                    if !changed.is_empty() {
                        // A closed controller is a driver stopping: nothing to do.
                        let _ = mtx.send(changed);
                    }
                    Ok(())
                },
            );
        }
    }
    let health = node_agent::health::watch(
        nvml.clone(),
        devices.iter().map(|d| d.info.uuid.clone()).collect(),
        s.ignored_xids.clone(),
        s.xid_quiet_period,
        // An Xid inside a GPU instance is that instance's (docs/mig.md).
        node_agent::health::InstanceXids::Instance,
        &cancel,
    );
    SliceController {
        api: Arc::new(api),
        publisher,
        driver: driver.clone(),
        devices,
        healthy,
        xid_quiet_period: s.xid_quiet_period,
        resync_period: s.resync_period,
        events: Some(claim_events.clone()),
        told: Default::default(),
    }
    .run(health, slice_changed, mig_changed, cancel)
    .await;
    driver.shutdown();
    Ok(())
}

/// Every `period`, the dynamic GPUs' instances read again under the
/// checkpoint lock ([`Driver::rescan_dynamic`]): an instance an operator
/// destroyed under a prepared claim makes its device Unhealthy in the
/// kubelet's health stream, and the controller tells the claim's pods (an
/// empty [`crate::controller::MigChange`]).
fn spawn_dynamic_rescan(
    period: Duration,
    driver: &Arc<Driver>,
    nvml: &Arc<nvml_wrapper::Nvml>,
    count: usize,
    changed: tokio::sync::mpsc::UnboundedSender<crate::controller::MigChange>,
    cancel: &CancellationToken,
) {
    let (driver, nvml, cancel) = (driver.clone(), nvml.clone(), cancel.clone());
    tokio::spawn(async move {
        let mut failures = node_agent::mig::FailureLog::default();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(period) => {}
            }
            let n = nvml.clone();
            let read = move || node_agent::mig::read_again(&n, count).map_err(RescanError::Read);
            let r = driver.rescan_dynamic(read).await;
            if failures.note(r, "reading the dynamic MIG instances again") == Some(true) {
                let _ = changed.send(Vec::new());
            }
        }
    });
}

/// What [`node_agent::mig::spawn_rescan`] read, for the `watched` GPUs (in
/// MIG mode at start, not dynamic): those whose devices changed since the
/// last read, with what they are now; `watched` updated.
fn mig_changes(
    watched: &mut [(usize, Option<Vec<node_agent::mig::MigDevice>>)],
    states: &[node_agent::mig::MigGpu],
) -> crate::controller::MigChange {
    let mut changed = Vec::new();
    for (gpu, was) in watched {
        let now = states
            .get(*gpu)
            .and_then(|m| m.enabled.then(|| m.devices.clone()));
        if *was != now {
            *was = now.clone();
            changed.push((*gpu, now));
        }
    }
    changed
}

fn devices_len(found: &Discovered) -> usize {
    found.topology.gpus().len()
}

/// Waits until the kubelet says it registered this instance; false when
/// cancelled first. Says what it waits for while it does.
async fn registered(state: &Mutex<grpc::RegistrationState>, cancel: &CancellationToken) -> bool {
    let t0 = Instant::now();
    let mut next_notice = Duration::from_secs(5);
    loop {
        if state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .registered
        {
            return true;
        }
        if t0.elapsed() >= next_notice {
            tracing::warn!(
                secs = t0.elapsed().as_secs(),
                "the kubelet has not registered the driver yet: no ResourceSlice is published until it does (is --registry-dir the kubelet's plugins_registry?)"
            );
            next_notice += Duration::from_secs(30);
        }
        tokio::select! {
            _ = cancel.cancelled() => return false,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// The DeviceClasses and the node's slice, every GPU healthy.
async fn publish(
    s: &Settings,
    api: &KubeApi,
    found: &Discovered,
    dynamic: BTreeMap<usize, DynamicGpu>,
) -> anyhow::Result<(Publisher, Vec<GpuDevice>)> {
    let publisher = Publisher::new(&s.node, &found.driver_version, s.unhealthy);
    publisher.set_dynamic(dynamic);
    publisher
        .ensure_classes(api)
        .await
        .map_err(anyhow::Error::msg)?;
    let domains = topology::nvlink_domains(&found.topology);
    let devices: Vec<GpuDevice> = found
        .topology
        .gpus()
        .iter()
        .zip(&found.names)
        .zip(domains)
        .map(|((g, n), nvlink_domain)| GpuDevice {
            info: g.clone(),
            model: n.clone(),
            xid: None,
            mig: mig_devices(found, g.index),
            pcie_root: topology::pcie_root(&s.host_root, &g.pci_bus_id),
            nvlink_domain,
            instance_xids: Default::default(),
            placement_xids: Default::default(),
        })
        .collect();
    let published = publisher
        .reconcile(api, &devices)
        .await
        .map_err(anyhow::Error::msg)?;
    tracing::info!(?published, gpus = devices.len(), "ResourceSlice published");
    Ok((publisher, devices))
}

/// GPU `index`'s MIG devices while it is in MIG mode.
fn mig_devices(found: &Discovered, index: usize) -> Option<Vec<node_agent::mig::MigDevice>> {
    let m = found.mig.get(index)?;
    m.enabled.then(|| m.devices.clone())
}

/// `--mig-dynamic`'s GPUs in MIG mode and what they offer (the GPUs read
/// again when there are any), under the checkpoint lock as a geometry
/// is: the instances of prepared claims are not foreign.
async fn start_dynamic(
    s: &Settings,
    nvml: &Arc<nvml_wrapper::Nvml>,
    found: &mut Discovered,
) -> anyhow::Result<BTreeMap<usize, DynamicGpu>> {
    if s.mig_dynamic.is_empty() {
        return Ok(BTreeMap::new());
    }
    let store = crate::checkpoint::Store::new(&s.state_dir);
    let (_lock, checkpoint) = match store.lock().await {
        Ok(l) => (Some(l), store.load(&s.node)),
        Err(e) => (None, Err(e)),
    };
    // A GPU prepared claims hold (whole or a share) is not put in MIG mode.
    let shared = crate::geometry::shared_gpus(&checkpoint);
    let whole = node_agent::geometry::left_whole(
        "mig-dynamic",
        crate::geometry::CLAIMS_HOLD,
        &s.mig_dynamic,
        found,
        shared.as_ref(),
    );
    let named: Vec<String> = s
        .mig_dynamic
        .iter()
        .filter(|n| !whole.contains(*n))
        .cloned()
        .collect();
    // Unlike a geometry's (which must destroy nothing a claim may hold),
    // an unread checkpoint holds no instance here: every instance is then
    // foreign and no placement overlapping one is published.
    let held = match checkpoint {
        Ok(c) => crate::geometry::held(Ok(c), &[]),
        Err(e) => {
            tracing::warn!(error = %e, "checkpoint unread: every MIG instance counts as an operator's");
            Default::default()
        }
    };
    let dynamic = crate::dynamic_start::start(nvml, found, &named, &held)?;
    if !dynamic.is_empty() {
        *found = node_agent::nvml::discover(nvml)?;
    }
    Ok(dynamic)
}

/// The driver, its prepared claims restored from the checkpoint.
fn start_driver(
    s: &Settings,
    api: &KubeApi,
    found: &Discovered,
    dynamic: &BTreeMap<usize, DynamicGpu>,
    nvml: &Arc<nvml_wrapper::Nvml>,
) -> anyhow::Result<Driver> {
    let mut inventory = inventory(s, found);
    inventory.dynamic = dynamic.clone();
    let driver = Driver::start(
        Config {
            node: s.node.clone(),
            vm_root: s.vm_dir.clone(),
            vdriver_dir: s.vdriver_dir.clone(),
            cdi_dir: s.cdi_dir.clone(),
            state_dir: s.state_dir.clone(),
            driver_version: node_agent::nvml::driver_major_minor(&found.driver_version),
            extra_devices: s.extra_devices.clone(),
        },
        inventory,
        Arc::new(api.clone()),
    )?;
    if dynamic.is_empty() {
        return Ok(driver);
    }
    let p = crate::partition::NvmlPartitioner {
        nvml: nvml.clone(),
        gpus: found.topology.len() as u32,
    };
    Ok(driver.with_partitioner(Arc::new(p)))
}

/// The GPUs and MIG devices claims can be prepared on.
fn inventory(s: &Settings, found: &Discovered) -> crate::plan::Inventory {
    let gpus = found.topology.gpus().to_vec();
    let mig = gpus.iter().map(|g| mig_devices(found, g.index)).collect();
    crate::plan::Inventory {
        gpus,
        mig,
        host_root: s.host_root.clone(),
        ..Default::default()
    }
}

/// The display service over the prepared claims, when configured.
async fn start_display(
    s: &Settings,
    driver: &Arc<Driver>,
    found: &Discovered,
    nvml: &Arc<nvml_wrapper::Nvml>,
    healthy: &Arc<Mutex<Vec<bool>>>,
    events: &crate::claim_events::ClaimEvents,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<(gpu_display::Display, gpu_display::Running)>> {
    let Some(at) = &s.display else {
        return Ok(None);
    };
    let display = gpu_display::Display::new(Arc::new(DraSource {
        driver: driver.clone(),
        node: s.node.clone(),
        models: found.names.clone(),
        healthy: healthy.clone(),
    }));
    display.on_escape(events.on_escape());
    let opts = gpu_display::DisplayOptions {
        socket: at.socket.clone(),
        sample_period: s.sample_period,
        escape_policy: Some(s.escape_policy),
        ..at.http.display_options()
    };
    let running = node_agent::display::start(&display, nvml, &opts, cancel).await?;
    Ok(Some((display, running)))
}
