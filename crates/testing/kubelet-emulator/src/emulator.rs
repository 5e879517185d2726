//! The emulated kubelet device manager.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use device_plugin::api::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, DevicePluginOptions, Empty, HEALTHY, KUBELET_SOCKET,
    ListAndWatchResponse, PreStartContainerRequest, PreferredAllocationRequest, RegisterRequest,
    VERSION,
    device_plugin_client::DevicePluginClient,
    registration_server::{Registration, RegistrationServer},
};
use device_plugin::{CancellationToken, connect_unix};
use prost::Message;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use vcuda_api::podresources::v1 as pr;

use crate::checkpoint::{CheckpointData, CheckpointError, DevicesPerNuma, PodDevicesEntry};

mod plugin_calls;
mod services;
use plugin_calls::{allocate_devices, device_states, dial_plugin, preferred_devices};
use services::{PodResourcesSvc, RegistrationSvc};

/// File name of kubelet's device-manager checkpoint in the device-plugin dir.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// How long the emulator waits to connect to a plugin, like kubelet's
/// dial (pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go: 10 s).
const RPC_TIMEOUT: Duration = Duration::from_secs(10);
/// kubelet's deadline on PreStartContainer
/// (`KubeletPreStartContainerRPCTimeoutInSecs`, endpoint.go); Allocate and
/// GetPreferredAllocation have none there, nor here.
const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    #[error("binding {path}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cleaning device-plugin dir {path}: {source}")]
    Cleanup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("resource {0} has no registered plugin")]
    UnknownResource(String),
    #[error("plugin of {0} is registered but not connected")]
    NotConnected(String),
    #[error("{resource}: {requested} devices requested, only {available} healthy and unallocated")]
    Insufficient {
        resource: String,
        requested: usize,
        available: usize,
    },
    #[error("{resource}: {rpc} failed: {code:?}: {message}")]
    Rpc {
        resource: String,
        rpc: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("timed out after {0:?} waiting for the condition")]
    WaitTimeout(Duration),
}

/// Health and NUMA nodes of one device as the emulator sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceState {
    pub healthy: bool,
    pub numa: Vec<i64>,
}

/// What the emulator knows of one resource.
#[derive(Clone, Debug)]
pub struct ResourceView {
    pub endpoint: String,
    pub options: DevicePluginOptions,
    pub devices: BTreeMap<String, DeviceState>,
    /// A ListAndWatch stream is open.
    pub connected: bool,
    /// Successful Register calls, over all restarts.
    pub registrations: u64,
    /// ListAndWatch messages received, over all restarts.
    pub updates: u64,
    pub registered_at: Option<Instant>,
    pub last_update: Option<Instant>,
}

impl ResourceView {
    pub fn healthy_ids(&self) -> Vec<String> {
        self.devices
            .iter()
            .filter(|(_, d)| d.healthy)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// Everything tests may wait on.
#[derive(Clone, Debug, Default)]
pub struct View {
    pub resources: BTreeMap<String, ResourceView>,
    /// Times [`KubeletEmulator::restart`] ran.
    pub restarts: u64,
}

/// Who a container belongs to (what kubelet knows from the API server).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub uid: String,
    pub name: String,
    pub namespace: String,
}

#[derive(Default)]
struct State {
    entries: Vec<PodDevicesEntry>,
    /// Pod names by UID: API-server knowledge, so it survives restarts.
    pods: BTreeMap<String, PodRef>,
    clients: HashMap<String, Endpoint>,
}

struct Endpoint {
    seq: u64,
    client: DevicePluginClient<Channel>,
    cancel: CancellationToken,
}

struct Running {
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

struct Inner {
    dir: PathBuf,
    pod_resources_socket: PathBuf,
    view: watch::Sender<View>,
    state: Mutex<State>,
    /// Serialises admissions, as kubelet's device manager does.
    admit_lock: tokio::sync::Mutex<()>,
    running: tokio::sync::Mutex<Option<Running>>,
    seq: std::sync::atomic::AtomicU64,
    /// Held across every change of the recorded allocations and its
    /// checkpoint write, and across the reload at boot: the file on disk is
    /// always the latest state, and a restart never reloads a snapshot that
    /// an admission or release made stale while the reload was under way.
    write_lock: Mutex<()>,
}

/// Emulated kubelet device manager; cheap to clone.
#[derive(Clone)]
pub struct KubeletEmulator {
    inner: Arc<Inner>,
}

impl KubeletEmulator {
    /// Starts like kubelet: cleans the dir of sockets, loads the checkpoint,
    /// serves `Registration` on `<dir>/kubelet.sock` and pod-resources on
    /// `pod_resources_socket`.
    pub async fn start(
        dir: impl Into<PathBuf>,
        pod_resources_socket: impl Into<PathBuf>,
    ) -> Result<Self, EmulatorError> {
        let inner = Arc::new(Inner {
            dir: dir.into(),
            pod_resources_socket: pod_resources_socket.into(),
            view: watch::Sender::new(View::default()),
            state: Mutex::default(),
            admit_lock: tokio::sync::Mutex::new(()),
            running: tokio::sync::Mutex::new(None),
            seq: Default::default(),
            write_lock: Mutex::new(()),
        });
        let emu = Self { inner };
        emu.boot().await?;
        Ok(emu)
    }

    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.inner.dir.join(CHECKPOINT_FILE)
    }

    /// Watch channel of the device view (changes on registration, every
    /// ListAndWatch message and disconnects).
    pub fn view(&self) -> watch::Receiver<View> {
        self.inner.view.subscribe()
    }

    /// Waits until `cond` holds for the view; returns that view.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        cond: impl Fn(&View) -> bool,
    ) -> Result<View, EmulatorError> {
        let mut rx = self.view();
        match tokio::time::timeout(timeout, rx.wait_for(|v| cond(v))).await {
            Ok(Ok(v)) => Ok(v.clone()),
            _ => Err(EmulatorError::WaitTimeout(timeout)),
        }
    }

    /// Current allocations, as they would be checkpointed.
    pub fn allocations(&self) -> Vec<PodDevicesEntry> {
        self.inner.state.lock().unwrap().entries.clone()
    }

    async fn boot(&self) -> Result<(), EmulatorError> {
        let inner = &self.inner;
        remove_sockets(&inner.dir)?;
        let _ = std::fs::remove_file(&inner.pod_resources_socket);
        // Allocations come back from the checkpoint, as in kubelet.
        {
            let _w = inner.write_lock.lock().unwrap();
            let data = CheckpointData::load(&inner.dir.join(CHECKPOINT_FILE))?.unwrap_or_default();
            inner.state.lock().unwrap().entries = data.pod_device_entries;
        }
        let cancel = CancellationToken::new();
        let mut tasks = Vec::new();

        let reg = bind(&inner.dir.join(KUBELET_SOCKET))?;
        let svc = RegistrationServer::new(RegistrationSvc {
            emu: self.clone(),
            cancel: cancel.clone(),
        });
        let c = cancel.clone();
        tasks.push(tokio::spawn(async move {
            let r = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(UnixListenerStream::new(reg), c.cancelled_owned())
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "registration server failed");
            }
        }));

        if let Some(parent) = inner.pod_resources_socket.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let prl = bind(&inner.pod_resources_socket)?;
        let svc = pr::pod_resources_lister_server::PodResourcesListerServer::new(PodResourcesSvc {
            emu: self.clone(),
        });
        let c = cancel.clone();
        tasks.push(tokio::spawn(async move {
            let r = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(UnixListenerStream::new(prl), c.cancelled_owned())
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "pod-resources server failed");
            }
        }));
        *inner.running.lock().await = Some(Running { cancel, tasks });
        tracing::info!(dir = %inner.dir.display(), "kubelet emulator started");
        Ok(())
    }

    /// Stops serving; plugin connections are dropped. Sockets stay, as after
    /// a kubelet crash.
    pub async fn stop(&self) {
        let running = self.inner.running.lock().await.take();
        if let Some(r) = running {
            r.cancel.cancel();
            for t in r.tasks {
                // Open streams may keep a graceful shutdown waiting; don't.
                let mut t = t;
                if tokio::time::timeout(Duration::from_secs(2), &mut t)
                    .await
                    .is_err()
                {
                    t.abort();
                }
            }
        }
        let mut st = self.inner.state.lock().unwrap();
        for (_, ep) in st.clients.drain() {
            ep.cancel.cancel();
        }
        drop(st);
        self.inner
            .view
            .send_modify(|v| v.resources.values_mut().for_each(|r| r.connected = false));
    }

    /// Like a kubelet restart: stop, delete every socket in the dir, start
    /// again with the allocations of the checkpoint. Plugins must notice and
    /// register again on their own.
    pub async fn restart(&self) -> Result<(), EmulatorError> {
        self.stop().await;
        self.inner.view.send_modify(|v| v.restarts += 1);
        self.boot().await
    }

    /// Admits one container: chooses device IDs for each `(resource, count)`,
    /// asks the plugin's preference when offered, calls Allocate and, when the
    /// plugin requires it, PreStartContainer. Returns the plugin responses by
    /// resource. A container admitted before gets its recorded responses.
    pub async fn admit(
        &self,
        pod: &PodRef,
        container: &str,
        requests: &[(&str, usize)],
    ) -> Result<BTreeMap<String, ContainerAllocateResponse>, EmulatorError> {
        let _g = self.inner.admit_lock.lock().await;
        self.inner
            .state
            .lock()
            .unwrap()
            .pods
            .insert(pod.uid.clone(), pod.clone());
        let mut out = BTreeMap::new();
        let mut added = Vec::new();
        for &(resource, count) in requests {
            match self.admit_one(pod, container, resource, count).await {
                Ok((resp, new)) => {
                    out.insert(resource.to_string(), resp);
                    added.extend(new);
                }
                Err(e) => {
                    // All or nothing, so a failed admission leaks no devices.
                    self.update_entries(|entries| entries.retain(|x| !added.contains(x)))?;
                    // Refused: kubelet lists the pod no more, unless
                    // another of its containers was admitted.
                    let mut st = self.inner.state.lock().unwrap();
                    if !st.entries.iter().any(|x| x.pod_uid == pod.uid) {
                        st.pods.remove(&pod.uid);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    async fn admit_one(
        &self,
        pod: &PodRef,
        container: &str,
        resource: &str,
        count: usize,
    ) -> Result<(ContainerAllocateResponse, Option<PodDevicesEntry>), EmulatorError> {
        let rpc_err = |rpc, status: Status| EmulatorError::Rpc {
            resource: resource.to_string(),
            rpc,
            code: status.code(),
            message: status.message().to_string(),
        };
        let (mut client, allocated) = match self.prior(pod, container, resource)? {
            Prior::Admitted(resp) => return Ok((resp, None)),
            Prior::New { client, allocated } => (client, allocated),
        };
        let (options, devices) = {
            let v = self.inner.view.borrow();
            let r = v
                .resources
                .get(resource)
                .ok_or_else(|| EmulatorError::UnknownResource(resource.to_string()))?;
            (r.options, r.devices.clone())
        };
        let available: Vec<String> = devices
            .iter()
            .filter(|(id, d)| d.healthy && !allocated.contains(*id))
            .map(|(id, _)| id.clone())
            .collect();
        if count == 0 || count > available.len() {
            return Err(EmulatorError::Insufficient {
                resource: resource.to_string(),
                requested: count,
                available: available.len(),
            });
        }
        let preferred = if options.get_preferred_allocation_available {
            preferred_devices(&mut client, &available, count)
                .await
                .map_err(|s| rpc_err("GetPreferredAllocation", s))?
        } else {
            Vec::new()
        };
        let chosen = choose_devices(&preferred, &available, count);
        let resp = allocate_devices(&mut client, &chosen)
            .await
            .map_err(|s| rpc_err("Allocate", s))?;

        // kubelet records the allocation (podDevices, its checkpoint and so
        // pod-resources) as soon as Allocate succeeds, before PreStart.
        let entry = PodDevicesEntry {
            pod_uid: pod.uid.clone(),
            container_name: container.to_string(),
            resource_name: resource.to_string(),
            device_ids: per_numa(&chosen, &devices),
            alloc_resp: resp.encode_to_vec(),
        };
        self.update_entries(|entries| entries.push(entry.clone()))?;

        if options.pre_start_required {
            let mut req = Request::new(PreStartContainerRequest {
                devices_ids: chosen.clone(),
            });
            req.set_timeout(PRE_START_TIMEOUT);
            if let Err(s) = client.pre_start_container(req).await {
                // The caller (admit) frees the container's devices, as
                // deleting the failed pod would.
                self.update_entries(|entries| entries.retain(|x| *x != entry))?;
                return Err(rpc_err("PreStartContainer", s));
            }
        }
        tracing::info!(pod = %pod.uid, container, resource, devices = ?chosen, "admitted");
        Ok((resp, Some(entry)))
    }

    /// The recorded response when the container was admitted before, else
    /// the plugin's client and the devices the resource has handed out.
    fn prior(&self, pod: &PodRef, container: &str, resource: &str) -> Result<Prior, EmulatorError> {
        let st = self.inner.state.lock().unwrap();
        if let Some(e) = st.entries.iter().find(|e| {
            e.pod_uid == pod.uid && e.container_name == container && e.resource_name == resource
        }) {
            let resp =
                ContainerAllocateResponse::decode(e.alloc_resp.as_slice()).unwrap_or_default();
            return Ok(Prior::Admitted(resp));
        }
        let ep = st.clients.get(resource).ok_or_else(|| {
            if self.inner.view.borrow().resources.contains_key(resource) {
                EmulatorError::NotConnected(resource.to_string())
            } else {
                EmulatorError::UnknownResource(resource.to_string())
            }
        })?;
        let allocated = st
            .entries
            .iter()
            .filter(|e| e.resource_name == resource)
            .flat_map(|e| e.device_ids.values().flatten().cloned())
            .collect();
        Ok(Prior::New {
            client: ep.client.clone(),
            allocated,
        })
    }

    /// Makes the emulator hold `pods` before admitting them, so `List`
    /// shows them all while one is admitted: kubelet 1.20's pod-resources
    /// `List` answers from every pod its pod manager holds
    /// (`podsProvider.GetPods()` in `pkg/kubelet/apis/podresources/server_v1.go`),
    /// where newer ones list only the active pods. A refused admission
    /// still drops its pod.
    pub fn hold_pods(&self, pods: &[&PodRef]) {
        let mut st = self.inner.state.lock().unwrap();
        for p in pods {
            st.pods.insert(p.uid.clone(), (*p).clone());
        }
    }

    /// Frees every device of the pod.
    pub fn release_pod(&self, pod_uid: &str) -> Result<(), EmulatorError> {
        self.inner.state.lock().unwrap().pods.remove(pod_uid);
        self.update_entries(|entries| entries.retain(|e| e.pod_uid != pod_uid))
    }

    /// Changes the recorded allocations and writes the checkpoint, as one
    /// step under `write_lock`.
    fn update_entries(
        &self,
        change: impl FnOnce(&mut Vec<PodDevicesEntry>),
    ) -> Result<(), EmulatorError> {
        let _w = self.inner.write_lock.lock().unwrap();
        change(&mut self.inner.state.lock().unwrap().entries);
        self.store_checkpoint()
    }

    fn write_checkpoint(&self) -> Result<(), EmulatorError> {
        let _w = self.inner.write_lock.lock().unwrap();
        self.store_checkpoint()
    }

    /// Writes the current state; the caller holds `write_lock`.
    fn store_checkpoint(&self) -> Result<(), EmulatorError> {
        let entries = self.inner.state.lock().unwrap().entries.clone();
        let registered_devices = self
            .inner
            .view
            .borrow()
            .resources
            .iter()
            .map(|(r, v)| (r.clone(), v.devices.keys().cloned().collect()))
            .collect();
        CheckpointData {
            pod_device_entries: entries,
            registered_devices,
        }
        .store(&self.checkpoint_path())?;
        Ok(())
    }

    /// Dials a freshly registered plugin and follows its ListAndWatch stream.
    async fn connect_plugin(self, req: RegisterRequest, cancel: CancellationToken) {
        let resource = req.resource_name.clone();
        let seq = self
            .inner
            .seq
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let path = self.inner.dir.join(&req.endpoint);
        let Some((client, options, stream)) = dial_plugin(&path, &resource).await else {
            return;
        };
        let ep_cancel = cancel.child_token();
        // A re-registration replaces the endpoint calls go to; the older
        // client is not disconnected and its stream still feeds the devices
        // (kubelet's `registerClient` only overwrites the map entry).
        self.inner.state.lock().unwrap().clients.insert(
            resource.clone(),
            Endpoint {
                seq,
                client,
                cancel: ep_cancel.clone(),
            },
        );
        self.inner.view.send_modify(|v| {
            let r = v
                .resources
                .entry(resource.clone())
                .or_insert_with(|| ResourceView {
                    endpoint: String::new(),
                    options,
                    devices: BTreeMap::new(),
                    connected: false,
                    registrations: 0,
                    updates: 0,
                    registered_at: None,
                    last_update: None,
                });
            r.endpoint = req.endpoint.clone();
            r.options = options;
            r.connected = true;
            r.registrations += 1;
            r.registered_at = Some(Instant::now());
        });
        tracing::info!(%resource, endpoint = %req.endpoint, "plugin connected");
        self.follow_devices(&resource, stream, &ep_cancel).await;
        // Whichever client's stream ended, kubelet ≥ 1.26 disconnects the
        // resource's *current* client and marks its devices unhealthy
        // (`pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go`,
        // `runClient` → `getClient(name)` → `disconnectClient`): an older
        // instance stopping drops the newer one's registration too.
        let mut st = self.inner.state.lock().unwrap();
        if let Some(current) = st.clients.remove(&resource) {
            drop(st);
            if current.seq != seq {
                tracing::info!(%resource, "an older client's stream ended: disconnecting the current one");
            }
            current.cancel.cancel();
            self.inner.view.send_modify(|v| {
                if let Some(r) = v.resources.get_mut(&resource) {
                    r.connected = false;
                }
            });
            tracing::info!(%resource, "plugin disconnected");
        }
    }

    /// Takes each ListAndWatch list as the resource's devices (and writes
    /// the checkpoint) until the stream ends or `cancel` fires.
    async fn follow_devices(
        &self,
        resource: &str,
        mut stream: Streaming<ListAndWatchResponse>,
        cancel: &CancellationToken,
    ) {
        loop {
            let msg = tokio::select! {
                m = stream.message() => m,
                () = cancel.cancelled() => break,
            };
            match msg {
                Ok(Some(list)) => {
                    let now = Instant::now();
                    let devices = device_states(list);
                    self.inner.view.send_modify(|v| {
                        if let Some(r) = v.resources.get_mut(resource) {
                            r.devices = devices;
                            r.updates += 1;
                            r.last_update = Some(now);
                        }
                    });
                    if let Err(e) = self.write_checkpoint() {
                        tracing::warn!(error = %e, "writing checkpoint");
                    }
                }
                Ok(None) => break,
                Err(s) => {
                    tracing::info!(%resource, status = %s, "ListAndWatch stream ended");
                    break;
                }
            }
        }
    }
}

fn bind(path: &Path) -> Result<UnixListener, EmulatorError> {
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).map_err(|source| EmulatorError::Bind {
        path: path.to_path_buf(),
        source,
    })
}

/// kubelet removes every socket in the device-plugin dir when it starts; the
/// checkpoint and other files stay.
fn remove_sockets(dir: &Path) -> Result<(), EmulatorError> {
    use std::os::unix::fs::FileTypeExt;
    let err = |source| EmulatorError::Cleanup {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    for entry in std::fs::read_dir(dir).map_err(err)? {
        let entry = entry.map_err(err)?;
        if entry.file_type().map_err(err)?.is_socket() {
            std::fs::remove_file(entry.path()).map_err(err)?;
        }
    }
    Ok(())
}

/// What the emulator holds for a container's resource before admitting it.
enum Prior {
    /// Admitted before: the recorded Allocate response.
    Admitted(ContainerAllocateResponse),
    /// New: the plugin to ask and the devices already handed out.
    New {
        client: DevicePluginClient<Channel>,
        allocated: BTreeSet<String>,
    },
}

/// Device choice as kubelet's devicesToAllocate: the plugin's preference
/// where valid, the rest in order from what is available.
fn choose_devices(preferred: &[String], available: &[String], count: usize) -> Vec<String> {
    let mut chosen: Vec<String> = Vec::with_capacity(count);
    for id in preferred.iter().chain(available) {
        if chosen.len() == count {
            break;
        }
        if available.contains(id) && !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    chosen
}

/// The chosen devices by their first NUMA node (-1: none), as kubelet's
/// checkpoint keeps them.
fn per_numa(chosen: &[String], devices: &BTreeMap<String, DeviceState>) -> DevicesPerNuma {
    let mut per_numa = DevicesPerNuma::new();
    for id in chosen {
        let numa = devices
            .get(id)
            .and_then(|d| d.numa.first().copied())
            .unwrap_or(-1);
        per_numa.entry(numa).or_default().push(id.clone());
    }
    per_numa
}
