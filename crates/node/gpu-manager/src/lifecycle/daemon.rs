//! Startup in order, each step logged with its time; a missing
//! prerequisite stops the daemon with one error that says what to fix.
//! Each step is a function; the long-running jobs are [`crate::lifecycle::tasks`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use node_agent::nvml::{self, Discovered};
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::decide::ids::{VCORE_RESOURCE, VCORE_SOCKET, VMEMORY_RESOURCE, VMEMORY_SOCKET};
use crate::decide::node_status;
use crate::decide::pods;
use crate::edge::display::ManagerSource;
use crate::edge::plugin::{self, Gate, PluginParts, VcorePlugin, VmemoryPlugin};
use crate::edge::served::{FromSupervisor, Plugins};
use crate::lifecycle::handover::Node;
use crate::lifecycle::owner::{self, Claim};
use crate::manager::{Manager, ManagerConfig, ManagerParts};
use crate::world::checkpoint::Checkpoint;
use crate::world::kube_api::{self, Patcher, PodWatch};
use crate::world::kubelet::KubeletRecords;
use crate::world::runtime;
use crate::world::{ContainerRuntime, World};
use node_agent::events::KubeEvents;
use node_agent::extra::ExtraConfig;
use node_agent::mode;

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

fn ms(t0: Instant) -> u64 {
    t0.elapsed().as_millis() as u64
}

/// Runs the manager until `cancel`: its plugins on sockets of its own, or
/// through the supervisor it runs under (`sup`, [`crate::lifecycle::supervise`]).
pub async fn run(
    settings: Settings,
    cancel: CancellationToken,
    sup: Option<FromSupervisor>,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let s = Arc::new(settings);
    let instance = match &sup {
        Some(sup) => sup.instance.clone(),
        None => node_agent::mode::instance_id(),
    };
    tracing::info!(node = %s.node_name, share_mode = s.share_mode, host_root = %s.host_root.display(), %instance, "gpu-manager starting");
    match node_agent::registry::budget::raise_open_files() {
        Ok(n) => tracing::debug!(open_files = n, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    let (volumes, extra) = check_configuration(&s)?;
    let other_stopped = node_agent::mode::await_other_mode_stopped(
        || node_agent::mode::refuse_if_dra_serving(&s.device_plugin_path),
        node_agent::mode::OTHER_MODE_PATIENCE,
        &cancel,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    if !other_stopped {
        tracing::info!("told to stop while waiting for the other mode's daemon: stopping");
        return Ok(());
    }
    tracing::info!(ms = ms(t0), "step 1/6: configuration checked");
    let (nvml, mut found) = discover(&s, t0)?;
    if !s.mig_geometry.gpus.is_empty() {
        found = apply_mig_geometry(&s, &nvml, found).await?;
    }
    let dynamic;
    (found, dynamic) = super::dynamic_mig::enable(&s, &nvml, found)?;
    let allocator = found.allocator();
    eprintln!("{}", allocator.render());
    // The mirror's time is reported apart: it depends on the driver's size.
    let tm = Instant::now();
    let report = node_agent::mirror_driver(
        &s.host_root,
        &volumes,
        &s.vdriver_path,
        s.interposer.as_deref(),
    )?;
    let mirror_ms = ms(tm);
    tracing::info!(ms = ms(t0), mirror_ms, driver = %report.driver_version, "step 3/6: driver mirrored");
    // The pod watch outlives `cancel`: a stopping manager drains the
    // admissions the watch shows (`Node::drain`); it ends with this run.
    let watch_stop = CancellationToken::new();
    let _watch_guard = watch_stop.clone().drop_guard();
    let (client, pods) = sync_api(&s, &found, &watch_stop).await?;
    tracing::info!(
        ms = ms(t0),
        pods = pods.pods().len(),
        "step 4/6: API server in sync"
    );

    let shared = &s.mig_shared_profiles;
    let mig = crate::mig::MigPlugins::new(
        &s.mig_resource_prefix,
        found.topology.gpus(),
        &crate::manager::served_whole(&found.mig, shared),
        crate::mig::MigContext {
            host_root: s.host_root.clone(),
            vdriver_dir: s.vdriver_path.clone(),
            extra_devices: extra.devices.clone(),
        },
    )
    .with_record(&s.checkpoint_path, found.topology.gpus());
    let mgr = build_manager(&s, allocator, &found, extra, client.clone(), pods).await;
    if !shared.is_empty() {
        let gpus = found.topology.gpus();
        mgr.set_shared_instances(crate::manager::shared_instances(
            &s.host_root,
            gpus,
            &found.mig,
            shared,
        ));
    }
    let claim =
        owner::claim(&s.checkpoint_path, &s.device_plugin_path, &instance).with_context(|| {
            format!(
                "taking the ownership lock in --checkpoint-path {}",
                s.checkpoint_path.display()
            )
        })?;
    let successor = matches!(claim, Claim::HeldBy(_));
    let (display, running) =
        start_display(&s, &mgr, &found, &nvml, &mig, successor, &cancel).await?;
    let metrics = display.metrics();
    let (gate_control, gate) = plugin::gate();
    let node = Node {
        settings: s.clone(),
        mgr: mgr.clone(),
        nvml,
        client: client.clone(),
        metrics: metrics.clone(),
        gate: gate_control,
        instance: instance.clone(),
        mig: mig.clone(),
    };
    let mut held = match claim {
        Claim::Owned(o) => Some(node.take_over(o, &cancel).await),
        Claim::HeldBy(who) => {
            tracing::info!(owner = %who, "another manager owns this node's state (a rolling update with surge?): registering beside it; Allocate waits for its handover");
            None
        }
    };

    let sockets = plugin_sockets(&s.device_plugin_path, &instance);
    // The plugins stop only when told, after the signal: a manager that
    // handed the node over must exit with kubelet's streams still open.
    let stop_plugins = CancellationToken::new();
    let watchers = [mgr.vcore.watchers(), mgr.vmemory.watchers()];
    let plugins = start_plugins(&s, &mgr, &metrics, &gate, &sockets, sup, &stop_plugins).await?;
    // Devices destroyed while no manager ran (the record): their pods are
    // told now, not at the first rescan (none without one).
    let (kubelet, events) = (mgr.kubelet(), mgr.events());
    mig.settle_recorded(kubelet.as_ref(), &mgr.pods_now(), events.as_ref())
        .await;
    mig.start(&s.device_plugin_path, &instance, stop_plugins.clone())?;
    if let Some(period) = s.mig_rescan_period
        && found.mig.iter().any(|m| m.enabled)
    {
        // Instances an operator made or destroyed meanwhile are advertised
        // or withdrawn (a GPU's MIG mode itself is read at start).
        let (gpus, mig, mgr) = (found.topology.gpus().to_vec(), mig.clone(), mgr.clone());
        let s = s.clone();
        node_agent::mig::spawn_rescan(
            period,
            node.nvml.clone(),
            gpus.len(),
            cancel.clone(),
            move |states| {
                let shared = &s.mig_shared_profiles;
                if !shared.is_empty() {
                    let found =
                        crate::manager::shared_instances(&s.host_root, &gpus, &states, shared);
                    mgr.set_shared_instances(found);
                }
                let whole = crate::manager::served_whole(&states, shared);
                mig.refresh(&gpus, &whole).map_err(|e| format!("{e:#}"))?;
                settle_lost_mig(&mig, &mgr);
                Ok(())
            },
        );
    }
    // Run by the manager that holds the node only: two beside each other
    // (a rolling update) would both make instances for the same pods.
    let mut dynamic_mig = (!dynamic.is_empty()).then(|| super::dynamic_mig::DynamicMig {
        settings: s.clone(),
        nvml: node.nvml.clone(),
        gpus: found.topology.gpus().to_vec(),
        dynamic,
        mig: mig.clone(),
        mgr: mgr.clone(),
        client: client.clone(),
    });
    let mut handed_over = false;
    if plugins
        .registered([VCORE_RESOURCE, VMEMORY_RESOURCE], &cancel)
        .await
    {
        let ms = ms(t0);
        tracing::info!(
            ms,
            mirror_ms,
            ready_excluding_mirror_ms = ms.saturating_sub(mirror_ms),
            "step 6/6: registered with kubelet; ready"
        );
        display.set_ready(true);
        if held.is_none() {
            held = node.succeed(&sockets, &plugins, &cancel).await;
        }
        if let Some(h) = held.take() {
            // Placed pods must find the devices at admission: write what
            // the kubelet will report only once it watches both lists.
            node_status::kubelet_listing(&[&mgr.vcore, &mgr.vmemory], watchers).await;
            let (vcore, vmemory) = (
                node_status::healthy(&mgr.vcore),
                node_status::healthy(&mgr.vmemory),
            );
            node_status::set_allocatable(&client, &s.node_name, vcore, vmemory).await;
            let dynamic_stop = cancel.child_token();
            if let Some(d) = dynamic_mig.take() {
                let period = s.mig_rescan_period.unwrap_or(Duration::from_secs(10));
                d.spawn(period, dynamic_stop.clone());
            }
            (held, handed_over) = node.hold(h, &plugins, &cancel).await;
            // Handed over (or stopping): the successor partitions now.
            dynamic_stop.cancel();
        }
    }
    cancel.cancelled().await;
    if handed_over {
        // Closing kubelet's connections (a graceful stop would) ends its
        // streams, and kubelet ≥ 1.26 then drops the successor's
        // registration: leave them to the successor, which holds copies.
        tracing::info!(
            "shutting down: the node is the successor's; leaving kubelet's connections open"
        );
        std::process::exit(0);
    }
    tracing::info!("shutting down");
    display.set_ready(false);
    if held.is_some() && node.withdraw().await {
        node.drain().await;
    }
    stop_plugins.cancel();
    let plugins = plugins.wait().await.context("stopping the device plugins");
    mig.stopped().await;
    node.stop(held).await;
    running.wait().await;
    plugins?;
    Ok(())
}

/// Tells the pods holding lost MIG devices, and withdraws those no pod
/// holds: the kubelet's `List`, off the caller's loop.
fn settle_lost_mig(mig: &crate::mig::MigPlugins, mgr: &Arc<Manager>) {
    if !mig.has_lost() {
        return;
    }
    let (mig, mgr) = (mig.clone(), mgr.clone());
    tokio::spawn(async move {
        let pods = mgr.pods_now();
        let (kubelet, events) = (mgr.kubelet(), mgr.events());
        mig.settle_lost(kubelet.as_ref(), &pods, events.as_ref())
            .await;
    });
}

/// This instance's two plugin sockets (vcore, vmemory).
pub fn plugin_sockets(dir: &Path, instance: &str) -> [PathBuf; 2] {
    [VCORE_SOCKET, VMEMORY_SOCKET].map(|s| dir.join(mode::device_plugin_socket(s, instance)))
}

/// Plugin sockets of managers that died without removing them (nobody
/// accepts on them; kubelet removes them only when it restarts).
pub fn remove_stale_sockets(dir: &Path) {
    for p in mode::device_plugin_sockets(dir) {
        if !mode::serving(&p) {
            match std::fs::remove_file(&p) {
                Ok(()) => tracing::info!(socket = %p.display(), "removed a stale plugin socket"),
                Err(e) => {
                    tracing::warn!(socket = %p.display(), error = %e, "removing a stale plugin socket")
                }
            }
        }
    }
}

/// Step 1: the prerequisites that need nothing else.
fn check_configuration(s: &Settings) -> anyhow::Result<(vdriver::VolumeConfig, ExtraConfig)> {
    if !s.device_plugin_path.is_dir() {
        bail!(
            "kubelet's device-plugin directory {} does not exist: is kubelet running on this node, and is --device-plugin-path right?",
            s.device_plugin_path.display()
        );
    }
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
    Ok((volumes, extra))
}

/// Step 2: the GPUs, from NVML.
fn discover(s: &Settings, t0: Instant) -> anyhow::Result<(Arc<nvml_wrapper::Nvml>, Discovered)> {
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
    node_agent::mig::log(&found.mig);
    tracing::info!(
        ms = ms(t0), gpus = topo.len(), nvlink = topo.has_nvlink(),
        driver = %found.driver_version, nvml = %nvml_path.display(), "step 2/6: GPUs discovered"
    );
    Ok((nvml, found))
}

/// `--mig-geometry`, before anything is served: instances pods hold (the
/// kubelet's records of the MIG resources; all of them when it does not
/// answer) or processes use are never destroyed. The GPUs are read again
/// when an instance was made or destroyed.
async fn apply_mig_geometry(
    s: &Settings,
    nvml: &Arc<nvml_wrapper::Nvml>,
    found: Discovered,
) -> anyhow::Result<Discovered> {
    use crate::world::KubeletSource;
    let mig_uuids = || {
        found
            .mig
            .iter()
            .flat_map(|m| &m.devices)
            .map(|d| d.uuid.clone())
    };
    let resources: std::collections::BTreeSet<String> = found
        .mig
        .iter()
        .flat_map(|m| &m.devices)
        .map(|d| gpu_pods::mig_resource_name(&s.mig_resource_prefix, &d.profile))
        .collect();
    let names: Vec<&str> = resources.iter().map(String::as_str).collect();
    let kubelet = KubeletRecords::new(&s.pod_resources_socket, &s.device_plugin_path);
    let held = match kubelet.held(&names).await {
        Ok(h) => h
            .into_iter()
            .flat_map(|h| h.ids.into_values().flatten())
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "kubelet's records unread: every MIG instance counts as held");
            mig_uuids().collect()
        }
    };
    let devices = (0..found.topology.len() as u32)
        .map(|i| nvml.device_by_index(i))
        .collect::<Result<Vec<_>, _>>()
        .context("NVML device handles for --mig-geometry")?;
    let gpus: Vec<node_agent::geometry::GpuRef> = found
        .topology
        .gpus()
        .iter()
        .map(|g| node_agent::geometry::GpuRef {
            index: g.index,
            uuid: &g.uuid,
        })
        .collect();
    let driver = node_agent::mig_nvml::NvmlMig {
        nvml,
        devices: &devices,
    };
    // A GPU not yet in MIG mode that holds pods' shares stays whole.
    let shared = super::dynamic_mig::holding_shares(s);
    let whole = node_agent::geometry::left_whole(
        "mig-geometry",
        super::dynamic_mig::PODS_HOLD,
        s.mig_geometry.gpus.keys(),
        &found,
        shared.as_ref(),
    );
    let mut geometry = s.mig_geometry.clone();
    geometry.gpus.retain(|name, _| !whole.contains(name));
    let changed =
        node_agent::geometry::apply_at_start(&driver, &gpus, &geometry, &held, &s.checkpoint_path);
    if !changed {
        return Ok(found);
    }
    let again = nvml::discover(nvml)?;
    node_agent::mig::log(&again.mig);
    Ok(again)
}

/// Step 4: this node's pods from the API server (degraded without it),
/// watched until `stop`, and the node's labels.
async fn sync_api(
    s: &Settings,
    found: &Discovered,
    stop: &CancellationToken,
) -> anyhow::Result<(kube::Client, PodWatch)> {
    let client = daemon_kit::apiserver::client(s.kubeconfig.as_deref()).await?;
    let pods = PodWatch::start(client.clone(), &s.node_name, stop.clone());
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
    if s.share_mode && found.topology.len() >= 2 {
        // Pods with tencent.com/vcuda-gpus select nodes whose manager
        // serves shares on several GPUs (docs/multi-gpu.md).
        labels.insert(pods::MULTI_GPU_LABEL.into(), "true".into());
    }
    kube_api::label_node(&client, &s.node_name, &labels).await;
    Ok((client, pods))
}

/// Step 5: the manager over the world (API server, kubelet, checkpoint,
/// container runtime).
async fn build_manager(
    s: &Settings,
    allocator: gpu_allocator::Allocator,
    found: &Discovered,
    extra: ExtraConfig,
    client: kube::Client,
    pods: PodWatch,
) -> Arc<Manager> {
    let kind = runtime::Kind::parse(&s.container_runtime).unwrap_or(runtime::Kind::Auto);
    let runtime: Arc<dyn ContainerRuntime> =
        runtime::select(kind, &s.container_runtime_endpoint).await;
    Manager::new(ManagerParts {
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
            events: Arc::new(KubeEvents::start(
                client,
                node_agent::events::MANAGER,
                s.node_name.clone(),
            )),
            kubelet: Arc::new(KubeletRecords::new(
                &s.pod_resources_socket,
                &s.device_plugin_path,
            )),
            checkpoint: Arc::new(Checkpoint::new(&s.checkpoint_path)),
            runtime,
        },
    })
}

/// Each reclaim of borrowed memory (docs/qos.md, "Memory") as a Warning
/// Event on the borrower's pod, naming the pod whose allocation needed it.
fn report_reclaims(mgr: &Arc<Manager>) {
    // Weak: the registry that keeps this sink lives inside the manager.
    let (events, m) = (mgr.events(), Arc::downgrade(mgr));
    mgr.registry().on_reclaim(Arc::new(move |r| {
        let Some(allocs) = m.upgrade().map(|m| m.allocations()) else {
            return;
        };
        let find =
            |uid: &str, c: &str| allocs.iter().find(|a| a.pod_uid == uid && a.container == c);
        let Some(a) = find(&r.owner, &r.slot) else {
            return;
        };
        let mut r = r.clone();
        if let Some(f) = find(&r.for_owner, &r.for_slot) {
            r.for_owner = format!("{}/{}", f.namespace, f.pod_name);
        }
        events.post(node_agent::events::PodEvent {
            namespace: a.namespace.clone(),
            name: a.pod_name.clone(),
            uid: a.pod_uid.clone(),
            reason: node_agent::events::MEMORY_RECLAIMED,
            note: format!("container {}: {}", a.container, r.describe()),
        })
    }));
}

/// The display service over the manager's state.
async fn start_display(
    s: &Settings,
    mgr: &Arc<Manager>,
    found: &Discovered,
    nvml: &Arc<nvml_wrapper::Nvml>,
    mig: &crate::mig::MigPlugins,
    take_over_socket: bool,
    cancel: &CancellationToken,
) -> anyhow::Result<(gpu_display::Display, gpu_display::Running)> {
    let display = gpu_display::Display::new(Arc::new(ManagerSource {
        mgr: mgr.clone(),
        node: s.node_name.clone(),
        models: found.names.clone(),
        mig: Some(mig.clone()),
    }));
    let events = mgr.events();
    display.on_escape(Arc::new(move |c, f| {
        events.post(node_agent::events::PodEvent {
            namespace: c.namespace.clone(),
            name: c.pod_name.clone(),
            uid: c.pod_uid.clone(),
            reason: node_agent::events::ESCAPE,
            note: format!("container {}: {}", c.container, f.describe()),
        })
    }));
    report_reclaims(mgr);
    mgr.registry()
        .memory_witness(node_agent::nvml::memory_witness(nvml.clone()));
    let opts = gpu_display::DisplayOptions {
        socket: s.display_socket.clone(),
        sample_period: s.sample_period,
        take_over_socket,
        escape_policy: Some(s.escape_policy),
        ..s.http.display_options()
    };
    let running = node_agent::display::start(&display, nvml, &opts, cancel).await?;
    tracing::info!(
        "display: HTTP on {}, probes on {}, metrics on {}, socket {}",
        running.http_addr,
        running
            .health_addr
            .map_or("the query port".into(), |a| a.to_string()),
        running
            .metrics_addr
            .map_or("the query port".into(), |a| a.to_string()),
        running.socket.display()
    );
    Ok((display, running))
}

/// Step 6: the two device plugins, on this instance's sockets (or its
/// supervisor's).
async fn start_plugins(
    s: &Settings,
    mgr: &Arc<Manager>,
    metrics: &gpu_display::ManagerMetrics,
    gate: &Gate,
    sockets: &[PathBuf; 2],
    sup: Option<FromSupervisor>,
    cancel: &CancellationToken,
) -> anyhow::Result<Plugins> {
    let name = crate::edge::served::file_name;
    let parts = || PluginParts {
        manager: mgr.clone(),
        metrics: metrics.clone(),
        gate: gate.clone(),
    };
    let (vcore, vmemory) = (VcorePlugin(parts()), VmemoryPlugin(parts()));
    Plugins::start(
        &s.device_plugin_path,
        [
            (VCORE_RESOURCE, name(&sockets[0]), Arc::new(vcore)),
            (VMEMORY_RESOURCE, name(&sockets[1]), Arc::new(vmemory)),
        ],
        sup,
        cancel,
    )
    .await
}
