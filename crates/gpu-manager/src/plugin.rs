//! The two device plugins kubelet talks to; both delegate to [`Manager`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use device_plugin::DevicePluginService;
use device_plugin::api::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, PreStartContainerRequest,
    PreStartContainerResponse,
};
use gpu_display::ManagerMetrics;
use tokio::sync::watch;
use tonic::{Code, Status};

use crate::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use crate::manager::Manager;

fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: false,
    }
}

/// Whether a manager answers Allocate and PreStartContainer: only while it
/// owns the node's state ([`crate::owner`]). A manager started beside the
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
        .inspect_err(|e| tracing::warn!(error = %e.message(), "PreStartContainer refused"))?;
    Ok(PreStartContainerResponse {})
}

/// The `reason` label of a refused Allocate: a fixed word per gRPC code.
pub fn failure_reason(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument => "invalid_argument",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Unavailable => "unavailable",
        Code::Internal => "internal",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::Cancelled => "cancelled",
        _ => "other",
    }
}

/// The vcuda-core plugin; the metrics count its Allocate outcomes.
pub struct VcorePlugin(pub Arc<Manager>, pub ManagerMetrics, pub Gate);
/// The vcuda-memory plugin.
pub struct VmemoryPlugin(pub Arc<Manager>, pub ManagerMetrics, pub Gate);

#[tonic::async_trait]
impl DevicePluginService for VcorePlugin {
    fn options(&self) -> DevicePluginOptions {
        options()
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.0.vcore.subscribe()
    }

    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let _call = self.2.pass("Allocate").await?;
        let mut out = Vec::with_capacity(request.container_requests.len());
        for c in request.container_requests {
            let t = Instant::now();
            let r = self.0.allocate_vcore(c.devices_ids).await;
            match &r {
                Ok(_) => self.1.allocation_succeeded(VCORE_RESOURCE),
                Err(e) => {
                    tracing::warn!(code = ?e.code(), error = %e.message(), "vcuda-core Allocate refused");
                    self.1
                        .allocation_failed(VCORE_RESOURCE, failure_reason(e.code()));
                }
            }
            self.1.observe_allocate(t.elapsed());
            out.push(r?);
        }
        Ok(AllocateResponse {
            container_responses: out,
        })
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        pre_start(&self.0, &self.2, VCORE_RESOURCE, request).await
    }
}

#[tonic::async_trait]
impl DevicePluginService for VmemoryPlugin {
    fn options(&self) -> DevicePluginOptions {
        options()
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.0.vmemory.subscribe()
    }

    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let _call = self.2.pass("Allocate").await?;
        let mut out = Vec::with_capacity(request.container_requests.len());
        for c in request.container_requests {
            let t = Instant::now();
            out.push(self.0.allocate_vmemory(c.devices_ids));
            self.1.allocation_succeeded(VMEMORY_RESOURCE);
            self.1.observe_allocate(t.elapsed());
        }
        Ok(AllocateResponse {
            container_responses: out,
        })
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        pre_start(&self.0, &self.2, VMEMORY_RESOURCE, request).await
    }
}
