//! The kubelet's resource-health stream (`DRAResourceHealth` v1 and
//! v1alpha1, KEP-4680) on the plugin socket: each of the node's GPUs HEALTHY, or
//! UNHEALTHY with the critical Xid that took it out of the slice, and each
//! prepared claim's MIG device likewise, or UNHEALTHY once its instance was
//! destroyed under it ([`crate::mig_health`]). Kubelets
//! with `ResourceHealthStatus` show it in the pod status of containers
//! holding the device (`allocatedResourcesStatus`), so an operator sees
//! which pods sit on a failed GPU. The stream sends the whole list at
//! once, on every change, and every [`REFRESH`] so the kubelet's
//! [`TIMEOUT_SECS`] never turns a quiet device UNKNOWN. A 1.37 kubelet
//! opens the stream only when the registration lists the service
//! (`grpc.rs`, `supported_versions`); 1.31-1.36 open v1alpha1 unasked.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use dra_api::dra_health::{self, v1 as h, v1alpha1};
use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::driver::{Driver, GpuHealth, NodeHealth};
use crate::slices;

pub const REFRESH: Duration = Duration::from_secs(20);
pub const TIMEOUT_SECS: i64 = 60;

pub struct HealthService {
    pub driver: Arc<Driver>,
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The message for `node` in pool `pool` (the node's name): its GPUs, then
/// the prepared MIG devices.
pub fn response(pool: &str, node: &NodeHealth) -> h::NodeWatchResourcesResponse {
    let now = unix_now();
    let one = |pool: &str, name: String, g: &GpuHealth| h::DeviceHealth {
        device: Some(h::DeviceIdentifier {
            pool_name: pool.to_string(),
            device_name: name,
        }),
        health: if g.healthy {
            h::HealthStatus::Healthy
        } else {
            h::HealthStatus::Unhealthy
        } as i32,
        last_updated_time: now,
        health_check_timeout_seconds: TIMEOUT_SECS,
        message: g.message.chars().take(1024).collect(),
    };
    let gpus = node.gpus.iter().enumerate();
    let mig = node.mig.iter();
    h::NodeWatchResourcesResponse {
        devices: gpus
            .map(|(i, g)| one(pool, slices::device_name(i), g))
            .chain(mig.map(|((p, d), g)| one(p, d.clone(), g)))
            .collect(),
    }
}

/// The v1 stream the kubelet reads (here and in the supervisor's relay).
pub type HealthStream =
    Pin<Box<dyn Stream<Item = Result<h::NodeWatchResourcesResponse, Status>> + Send>>;
pub type HealthStreamV1alpha1 =
    Pin<Box<dyn Stream<Item = Result<v1alpha1::NodeWatchResourcesResponse, Status>> + Send>>;

/// The same stream for a kubelet that opens v1alpha1 (1.31-1.36).
pub fn as_v1alpha1(s: HealthStream) -> HealthStreamV1alpha1 {
    s.map(|m| m.map(|m| dra_health::to_v1alpha1(&m))).boxed()
}

impl HealthService {
    /// The whole list now, then on every change and every [`REFRESH`].
    fn watch(&self) -> HealthStream {
        let pool = self.driver.config().node.clone();
        let rx = self.driver.health_watch();
        let s = futures::stream::unfold((rx, true), move |(mut rx, first)| {
            let pool = pool.clone();
            async move {
                if !first {
                    tokio::select! {
                        r = rx.changed() => r.ok()?,
                        _ = tokio::time::sleep(REFRESH) => {}
                    }
                }
                let msg = response(&pool, &rx.borrow_and_update());
                Some((Ok(msg), (rx, false)))
            }
        });
        Box::pin(s)
    }
}

#[tonic::async_trait]
impl h::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<h::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        Ok(Response::new(self.watch()))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStreamV1alpha1;

    async fn node_watch_resources(
        &self,
        _: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStreamV1alpha1>, Status> {
        Ok(Response::new(as_v1alpha1(self.watch())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_and_identifiers() {
        let node = NodeHealth {
            gpus: vec![
                GpuHealth::default(),
                GpuHealth {
                    healthy: false,
                    message: "x".repeat(2000),
                },
            ],
            mig: [(
                ("node-a".to_string(), "gpu-2-mig-5-0".to_string()),
                GpuHealth {
                    healthy: false,
                    message: "destroyed".into(),
                },
            )]
            .into(),
        };
        let r = response("node-a", &node);
        let d = &r.devices;
        assert_eq!(d.len(), 3);
        assert_eq!(d[2].device.as_ref().unwrap().device_name, "gpu-2-mig-5-0");
        assert_eq!(d[2].health, h::HealthStatus::Unhealthy as i32);
        assert_eq!(d[2].message, "destroyed");
        assert_eq!(d[0].device.as_ref().unwrap().device_name, "gpu-0");
        assert_eq!(d[1].device.as_ref().unwrap().pool_name, "node-a");
        assert_eq!(d[0].health, h::HealthStatus::Healthy as i32);
        assert_eq!(d[1].health, h::HealthStatus::Unhealthy as i32);
        assert_eq!(d[1].message.len(), 1024);
        assert_eq!(d[0].health_check_timeout_seconds, TIMEOUT_SECS);
        assert!(d[0].last_updated_time > 1_700_000_000);
    }
}
