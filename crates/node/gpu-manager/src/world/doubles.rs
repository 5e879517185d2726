//! In-memory stand-ins for the world's parties ([`crate::world`]): a test
//! sets what the API server, kubelet and the runtime say, and reads what
//! the manager patched and wrote. Each can be made unreachable.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;

use crate::allocation::Allocation;
use crate::world::checkpoint::{self, CheckpointError, Saved};
use crate::world::{ApiHealth, PatchJob};
use crate::world::{
    CheckpointStore, ContainerRuntime, Held, Holder, KubeletError, KubeletSource, PodKey,
    PodPatcher, PodSource,
};
use crate::world::{ContainerGpus, LiveContainer, RuntimeError};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The API server's pods of this node.
pub struct MemoryPods {
    pods: Mutex<Vec<Arc<Pod>>>,
    health: Mutex<ApiHealth>,
    version: watch::Sender<u64>,
}

impl Default for MemoryPods {
    fn default() -> Self {
        MemoryPods {
            pods: Mutex::new(Vec::new()),
            health: Mutex::new(ApiHealth::Ok),
            version: watch::channel(0).0,
        }
    }
}

impl MemoryPods {
    /// Adds or replaces (same UID) a pod; wakes waiters.
    pub fn put(&self, pod: Pod) {
        let uid = pod.metadata.uid.clone();
        let mut pods = lock(&self.pods);
        pods.retain(|p| p.metadata.uid != uid);
        pods.push(Arc::new(pod));
        drop(pods);
        self.version.send_modify(|v| *v += 1);
    }

    pub fn remove(&self, uid: &str) {
        lock(&self.pods).retain(|p| p.metadata.uid.as_deref() != Some(uid));
        self.version.send_modify(|v| *v += 1);
    }

    pub fn set_health(&self, h: ApiHealth) {
        *lock(&self.health) = h;
    }
}

#[async_trait::async_trait]
impl PodSource for MemoryPods {
    fn health(&self) -> ApiHealth {
        lock(&self.health).clone()
    }

    fn pods(&self) -> Vec<Arc<Pod>> {
        lock(&self.pods).clone()
    }

    fn generation(&self) -> u64 {
        *self.version.borrow()
    }

    async fn changed_since(&self, seen: u64, timeout: Duration) -> bool {
        let mut rx = self.version.subscribe();
        let moved = rx.wait_for(|&g| g != seen);
        matches!(tokio::time::timeout(timeout, moved).await, Ok(Ok(_)))
    }
}

/// Keeps the patches submitted.
#[derive(Default)]
pub struct MemoryPatches(Mutex<Vec<PatchJob>>);

impl MemoryPatches {
    pub fn submitted(&self) -> Vec<PatchJob> {
        lock(&self.0).clone()
    }
}

impl PodPatcher for MemoryPatches {
    fn submit(&self, job: PatchJob) {
        lock(&self.0).push(job);
    }
}

/// Something that happens while kubelet answers a `List`.
type OnList = Box<dyn Fn() + Send + Sync>;

/// kubelet's device records; `Err` while unreachable. Its active
/// pods: unknown (an error) until [`MemoryKubelet::set_active`].
pub struct MemoryKubelet(
    Mutex<Result<Vec<Held>, KubeletError>>,
    Mutex<Option<Vec<(String, String)>>>,
    Mutex<Option<OnList>>,
    /// How many times its active pods were listed.
    std::sync::atomic::AtomicUsize,
);

impl Default for MemoryKubelet {
    fn default() -> Self {
        MemoryKubelet(
            Mutex::new(Ok(Vec::new())),
            Mutex::new(None),
            Mutex::new(None),
            std::sync::atomic::AtomicUsize::new(0),
        )
    }
}

impl MemoryKubelet {
    /// The pods kubelet lists as admitted or running (namespace, name).
    pub fn set_active(&self, pods: &[(&str, &str)]) {
        *lock(&self.1) = Some(
            pods.iter()
                .map(|(n, p)| (n.to_string(), p.to_string()))
                .collect(),
        );
    }

    /// Records `ids` of `resource` for a container (pod-resources names
    /// pods by namespace/name).
    pub fn record(&self, pod: PodKey, container: &str, resource: &str, ids: &[String]) {
        let mut g = lock(&self.0);
        let list = match &mut *g {
            Ok(l) => l,
            Err(_) => {
                *g = Ok(Vec::new());
                g.as_mut().expect("just set")
            }
        };
        match list
            .iter_mut()
            .find(|h| h.pod == pod && h.container == container)
        {
            Some(h) => h
                .ids
                .entry(resource.into())
                .or_default()
                .extend_from_slice(ids),
            None => list.push(Held {
                pod,
                container: container.into(),
                ids: [(resource.to_string(), ids.to_vec())].into(),
            }),
        }
    }

    pub fn set_unreachable(&self, reason: &str) {
        *lock(&self.0) = Err(KubeletError::PodResources(reason.into()));
    }

    /// Runs `f` during the next `List` of active pods (the world moving
    /// while the manager waits for kubelet's answer).
    pub fn during_next_list(&self, f: impl Fn() + Send + Sync + 'static) {
        *lock(&self.2) = Some(Box::new(f));
    }

    /// How many times the active pods were listed.
    pub fn lists(&self) -> usize {
        self.3.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl KubeletSource for MemoryKubelet {
    async fn holder(&self, resource: &str, ids: &[String]) -> Result<Option<Holder>, KubeletError> {
        let g = lock(&self.0);
        let list = g.as_ref().map_err(Clone::clone)?;
        Ok(list
            .iter()
            .find(|h| {
                h.ids
                    .get(resource)
                    .is_some_and(|v| v.iter().any(|i| ids.contains(i)))
            })
            .map(|h| Holder {
                pod: h.pod.clone(),
                container: h.container.clone(),
            }))
    }

    async fn active_pods(&self) -> Result<Vec<(String, String)>, KubeletError> {
        self.3.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let during = lock(&self.2).take();
        if let Some(f) = during {
            f();
        }
        lock(&self.1)
            .clone()
            .ok_or_else(|| KubeletError::PodResources("no active pods recorded".into()))
    }

    async fn held(&self, resources: &[&str]) -> Result<Vec<Held>, KubeletError> {
        let g = lock(&self.0);
        let list = g.as_ref().map_err(Clone::clone)?;
        Ok(list
            .iter()
            .filter(|h| h.ids.keys().any(|r| resources.contains(&r.as_str())))
            .cloned()
            .collect())
    }
}

/// The runtime's containers; `None` means unreachable.
pub struct MemoryRuntime {
    containers: Mutex<Option<Vec<LiveContainer>>>,
    gpus: Mutex<Vec<(String, ContainerGpus)>>,
}

impl Default for MemoryRuntime {
    fn default() -> Self {
        MemoryRuntime {
            containers: Mutex::new(Some(Vec::new())),
            gpus: Mutex::new(Vec::new()),
        }
    }
}

impl MemoryRuntime {
    pub fn add(&self, c: LiveContainer, gpus: ContainerGpus) {
        lock(&self.gpus).push((c.id.clone(), gpus));
        lock(&self.containers).get_or_insert_with(Vec::new).push(c);
    }

    pub fn set_unreachable(&self) {
        *lock(&self.containers) = None;
    }
}

#[async_trait::async_trait]
impl ContainerRuntime for MemoryRuntime {
    fn describe(&self) -> String {
        "memory".into()
    }

    async fn containers(&self) -> Result<Option<Vec<LiveContainer>>, RuntimeError> {
        match &*lock(&self.containers) {
            Some(v) => Ok(Some(v.clone())),
            None => Err(RuntimeError::Unreachable {
                endpoint: self.describe(),
                reason: "set unreachable by the test".into(),
            }),
        }
    }

    async fn gpus(&self, id: &str) -> Result<ContainerGpus, RuntimeError> {
        lock(&self.gpus)
            .iter()
            .find(|(i, _)| i == id)
            .map(|(_, g)| g.clone())
            .ok_or_else(|| RuntimeError::Unreachable {
                endpoint: self.describe(),
                reason: format!("no container {id}"),
            })
    }
}

/// The checkpoint as the payload last stored (in the real format, so that
/// a test can start from garbage); writes can be made to fail.
#[derive(Default)]
pub struct MemoryCheckpoint {
    payload: Mutex<Option<Vec<u8>>>,
    fail: Mutex<Option<String>>,
    writes: Mutex<u64>,
}

impl MemoryCheckpoint {
    /// Starts from a record made by [`checkpoint::encode`] (or garbage).
    pub fn with_payload(payload: Vec<u8>) -> MemoryCheckpoint {
        let m = MemoryCheckpoint::default();
        *lock(&m.payload) = Some(payload);
        m
    }

    /// What the last successful write holds, parsed.
    pub fn saved(&self) -> Option<Saved> {
        lock(&self.payload)
            .as_deref()
            .and_then(|p| checkpoint::parse(p).ok())
    }

    pub fn writes(&self) -> u64 {
        *lock(&self.writes)
    }

    /// Every later write fails with `reason` (`None`: works again).
    pub fn fail_writes(&self, reason: Option<&str>) {
        *lock(&self.fail) = reason.map(str::to_string);
    }
}

impl CheckpointStore for MemoryCheckpoint {
    fn location(&self) -> String {
        "memory".into()
    }

    fn load(&self) -> Result<Option<Saved>, CheckpointError> {
        match &*lock(&self.payload) {
            None => Ok(None),
            Some(p) => checkpoint::parse(p)
                .map(Some)
                .map_err(|problem| CheckpointError::Invalid {
                    path: self.location(),
                    problem: problem.to_string(),
                }),
        }
    }

    fn store(&self, gpus: &[String], allocations: &[Allocation]) -> Result<(), CheckpointError> {
        if let Some(reason) = &*lock(&self.fail) {
            return Err(CheckpointError::Io {
                path: self.location(),
                source: std::io::Error::other(reason.clone()),
            });
        }
        *lock(&self.payload) = Some(checkpoint::encode(gpus, allocations));
        *lock(&self.writes) += 1;
        Ok(())
    }

    fn set_aside(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        Ok(lock(&self.payload)
            .take()
            .map(|_| PathBuf::from("memory.corrupt"))
            .into_iter()
            .collect())
    }
}
