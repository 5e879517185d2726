//! The device-plugin RPCs the emulated kubelet makes (with kubelet's
//! timeout) and what their answers become; failures go back to the
//! caller, or when dialing a plugin back, to the log.

use super::*;

/// Dials the plugin back, asks its options and opens ListAndWatch; a
/// failure is logged and leaves the plugin unconnected, as kubelet does.
pub(super) async fn dial_plugin(
    path: &Path,
    resource: &str,
) -> Option<(
    DevicePluginClient<Channel>,
    DevicePluginOptions,
    Streaming<ListAndWatchResponse>,
)> {
    let ch = match connect_unix(path, RPC_TIMEOUT).await {
        Ok(ch) => ch,
        Err(e) => {
            tracing::warn!(%resource, error = %e, "cannot dial plugin back");
            return None;
        }
    };
    let mut client = DevicePluginClient::new(ch);
    let options = match client.get_device_plugin_options(Empty {}).await {
        Ok(o) => o.into_inner(),
        Err(s) => {
            tracing::warn!(%resource, status = %s, "GetDevicePluginOptions failed");
            return None;
        }
    };
    let stream = match client.list_and_watch(Empty {}).await {
        Ok(s) => s.into_inner(),
        Err(s) => {
            tracing::warn!(%resource, status = %s, "ListAndWatch failed");
            return None;
        }
    };
    Some((client, options, stream))
}

/// A ListAndWatch list as health and NUMA nodes by device ID.
pub(super) fn device_states(list: ListAndWatchResponse) -> BTreeMap<String, DeviceState> {
    list.devices
        .into_iter()
        .map(|d| {
            let numa = d
                .topology
                .map(|t| t.nodes.iter().map(|n| n.id).collect())
                .unwrap_or_default();
            (
                d.id,
                DeviceState {
                    healthy: d.health == HEALTHY,
                    numa,
                },
            )
        })
        .collect()
}

/// The plugin's GetPreferredAllocation answer for `count` of `available`.
pub(super) async fn preferred_devices(
    client: &mut DevicePluginClient<Channel>,
    available: &[String],
    count: usize,
) -> Result<Vec<String>, Status> {
    let req = Request::new(PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available.to_vec(),
            must_include_device_i_ds: vec![],
            allocation_size: count as i32,
        }],
    });
    let resp = client.get_preferred_allocation(req).await?.into_inner();
    Ok(resp
        .container_responses
        .into_iter()
        .next()
        .map(|c| c.device_i_ds)
        .unwrap_or_default())
}

/// Allocate for one container; its one container response.
pub(super) async fn allocate_devices(
    client: &mut DevicePluginClient<Channel>,
    chosen: &[String],
) -> Result<ContainerAllocateResponse, Status> {
    let req = Request::new(AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: chosen.to_vec(),
        }],
    });
    let resp = client.allocate(req).await?.into_inner();
    resp.container_responses
        .into_iter()
        .next()
        .ok_or_else(|| Status::internal("no container response"))
}
