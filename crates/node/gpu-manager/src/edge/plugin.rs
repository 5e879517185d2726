//! The two device plugins kubelet talks to; both delegate to [`Manager`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use device_plugin::DevicePluginService;
use device_plugin::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions,
    PreStartContainerRequest, PreStartContainerResponse,
};
use gpu_display::ManagerMetrics;
use tokio::sync::watch;
use tonic::{Code, Status};

use crate::decide::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use crate::manager::{Manager, Refusal, RefusalKind};

fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: false,
    }
}

/// Whether a manager answers Allocate and PreStartContainer: only while it
/// owns the node's state ([`crate::lifecycle::owner`]). A manager started beside the
/// one it replaces is registered (kubelet calls it) before it owns it; the
/// one it replaces hands the state over once the new one is registered.
#[derive(Clone, Debug, PartialEq, Eq)]
enum GateState {
    Waiting,
    Open,
    HandedOver(String),
}

/// The plugins' side of the gate.
#[derive(Clone)]
pub struct Gate {
    state: watch::Receiver<GateState>,
    /// Calls in progress hold it shared; a handover takes it alone.
    inflight: Arc<tokio::sync::RwLock<()>>,
}

/// The daemon's side: opens the gate, hands the state over.
pub struct GateControl {
    state: watch::Sender<GateState>,
    inflight: Arc<tokio::sync::RwLock<()>>,
}

/// A call waits this long for the gate before it is refused.
const GATE_WAIT: Duration = Duration::from_secs(30);

/// A gate, shut until [`GateControl::open`].
pub fn gate() -> (GateControl, Gate) {
    let (tx, rx) = watch::channel(GateState::Waiting);
    let inflight = Arc::new(tokio::sync::RwLock::new(()));
    (
        GateControl {
            state: tx,
            inflight: inflight.clone(),
        },
        Gate {
            state: rx,
            inflight,
        },
    )
}

impl GateControl {
    pub fn open(&self) {
        self.state.send_replace(GateState::Open);
    }

    /// Refuses new calls and returns once those in progress have finished.
    pub async fn hand_over(&self, to: &str) {
        self.state
            .send_replace(GateState::HandedOver(to.to_string()));
        drop(self.inflight.write().await);
    }
}

impl Gate {
    /// Waits until the gate is open; the guard keeps a handover waiting
    /// until the call has finished.
    async fn pass(&self, rpc: &str) -> Result<tokio::sync::OwnedRwLockReadGuard<()>, Status> {
        let mut rx = self.state.clone();
        if *rx.borrow() == GateState::Waiting {
            tracing::info!(
                rpc,
                "waiting for the previous manager to hand the node over"
            );
            let waited = tokio::time::timeout(GATE_WAIT, rx.wait_for(|s| *s != GateState::Waiting));
            if !matches!(waited.await, Ok(Ok(_))) {
                return Err(Status::unavailable(format!(
                    "{rpc}: this gpu-manager has waited {} s for the node's previous manager to hand over \
                     (the holder of owner.lock in the checkpoint directory): does a second gpu-manager \
                     DaemonSet serve this node?",
                    GATE_WAIT.as_secs()
                )));
            }
        }
        let guard = self.inflight.clone().read_owned().await;
        match &*rx.borrow() {
            GateState::Open => Ok(guard),
            GateState::HandedOver(to) => Err(Status::unavailable(format!(
                "{rpc}: this gpu-manager has handed the node over to instance {to}, registered after it; kubelet calls that one"
            ))),
            GateState::Waiting => unreachable!("the gate never shuts again"),
        }
    }
}

/// PreStartContainer for either resource: the manager's check, logged when refused.
async fn pre_start(
    manager: &Manager,
    gate: &Gate,
    resource: &str,
    request: PreStartContainerRequest,
) -> Result<PreStartContainerResponse, Status> {
    let _call = gate.pass("PreStartContainer").await?;
    manager
        .pre_start(resource, &request.devices_ids)
        .await
        .inspect_err(|e| tracing::warn!(error = %e.message(), "PreStartContainer refused"))
        .map_err(status)?;
    Ok(PreStartContainerResponse {})
}

/// The one place a manager's refusal becomes a gRPC status, its message
/// unchanged.
fn status(r: Refusal) -> Status {
    let code = match r.kind() {
        RefusalKind::InvalidArgument => Code::InvalidArgument,
        RefusalKind::ResourceExhausted => Code::ResourceExhausted,
        RefusalKind::FailedPrecondition => Code::FailedPrecondition,
        RefusalKind::Unavailable => Code::Unavailable,
        RefusalKind::Internal => Code::Internal,
    };
    Status::new(code, r.message())
}

/// The `reason` label of a refused Allocate: a fixed word per kind.
pub fn failure_reason(kind: RefusalKind) -> &'static str {
    match kind {
        RefusalKind::InvalidArgument => "invalid_argument",
        RefusalKind::ResourceExhausted => "resource_exhausted",
        RefusalKind::FailedPrecondition => "failed_precondition",
        RefusalKind::Unavailable => "unavailable",
        RefusalKind::Internal => "internal",
    }
}

/// What both plugins share: the manager, its metrics (the vcuda-core
/// plugin counts Allocate outcomes) and the handover gate.
pub struct PluginParts {
    pub manager: Arc<Manager>,
    pub metrics: ManagerMetrics,
    pub gate: Gate,
}

/// One Allocate call of either plugin: each container's answer from `one`,
/// counted and timed per `resource`; a refusal (logged with `short`, the
/// resource's name in the logs) ends the call with its status.
async fn allocate_each<F, Fut>(
    parts: &PluginParts,
    short: &str,
    resource: &str,
    request: AllocateRequest,
    one: F,
) -> Result<AllocateResponse, Status>
where
    F: Fn(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<ContainerAllocateResponse, Refusal>>,
{
    let _call = parts.gate.pass("Allocate").await?;
    let mut out = Vec::with_capacity(request.container_requests.len());
    for c in request.container_requests {
        let t = Instant::now();
        let r = one(c.devices_ids).await;
        match &r {
            Ok(_) => parts.metrics.allocation_succeeded(resource),
            Err(e) => {
                tracing::warn!(kind = ?e.kind(), error = %e.message(), "{short} Allocate refused");
                parts
                    .metrics
                    .allocation_failed(resource, failure_reason(e.kind()));
            }
        }
        parts.metrics.observe_allocate(t.elapsed());
        out.push(r.map_err(status)?);
    }
    Ok(AllocateResponse {
        container_responses: out,
    })
}

/// The vcuda-core plugin.
pub struct VcorePlugin(pub PluginParts);
/// The vcuda-memory plugin.
pub struct VmemoryPlugin(pub PluginParts);

#[tonic::async_trait]
impl DevicePluginService for VcorePlugin {
    fn options(&self) -> DevicePluginOptions {
        options()
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.0.manager.vcore.subscribe()
    }

    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let m = &self.0.manager;
        allocate_each(&self.0, "vcuda-core", VCORE_RESOURCE, request, |ids| {
            m.allocate_vcore(ids)
        })
        .await
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        pre_start(&self.0.manager, &self.0.gate, VCORE_RESOURCE, request).await
    }
}

#[tonic::async_trait]
impl DevicePluginService for VmemoryPlugin {
    fn options(&self) -> DevicePluginOptions {
        options()
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.0.manager.vmemory.subscribe()
    }

    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let m = &self.0.manager;
        allocate_each(&self.0, "vcuda-memory", VMEMORY_RESOURCE, request, |ids| {
            std::future::ready(Ok(m.allocate_vmemory(ids)))
        })
        .await
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        pre_start(&self.0.manager, &self.0.gate, VMEMORY_RESOURCE, request).await
    }
}
