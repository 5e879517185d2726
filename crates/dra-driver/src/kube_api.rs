//! The API server through `kube`: claims to prepare, slices and classes to
//! publish.

use futures::StreamExt;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::DRIVER_NAME;
use crate::driver::ClaimSource;
use crate::publish::SliceApi;

#[derive(Clone)]
pub struct KubeApi {
    pub client: Client,
}

#[async_trait::async_trait]
impl ClaimSource for KubeApi {
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| e.to_string())
    }
}

#[async_trait::async_trait]
impl SliceApi for KubeApi {
    async fn list(&self, node: &str) -> Result<Vec<ResourceSlice>, String> {
        let lp = ListParams::default()
            .fields(&format!("spec.nodeName={node},spec.driver={DRIVER_NAME}"));
        Api::<ResourceSlice>::all(self.client.clone())
            .list(&lp)
            .await
            .map(|l| l.items)
            .map_err(|e| format!("listing ResourceSlices of node {node}: {e}"))
    }

    async fn create(&self, s: &ResourceSlice) -> Result<ResourceSlice, String> {
        Api::<ResourceSlice>::all(self.client.clone())
            .create(&PostParams::default(), s)
            .await
            .map_err(|e| format!("creating ResourceSlice {:?}: {e}", s.metadata.name))
    }

    async fn replace(&self, s: &ResourceSlice) -> Result<ResourceSlice, String> {
        let name = s.metadata.name.clone().unwrap_or_default();
        Api::<ResourceSlice>::all(self.client.clone())
            .replace(&name, &PostParams::default(), s)
            .await
            .map_err(|e| format!("updating ResourceSlice {name}: {e}"))
    }

    async fn delete(&self, name: &str) -> Result<(), String> {
        match Api::<ResourceSlice>::all(self.client.clone())
            .delete(name, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(format!("deleting ResourceSlice {name}: {e}")),
        }
    }

    async fn ensure_class(&self, c: &DeviceClass) -> Result<(), String> {
        let api = Api::<DeviceClass>::all(self.client.clone());
        let name = c.metadata.name.clone().unwrap_or_default();
        match api.create(&PostParams::default(), c).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(format!("creating DeviceClass {name}: {e}")),
        }
    }
}

/// Watches this driver's slices on `node` and sends a unit on every change
/// and every (re)list: someone else may delete or edit the slice (the
/// kubelet deletes all of its node's slices when it starts, and a driver's
/// after its plugin has been gone a while), and the driver must put it
/// back at once, not at the next resync. Our own writes come back too; the
/// reconcile they cause finds nothing to do.
pub fn watch_slices(
    client: Client,
    node: &str,
    tx: tokio::sync::mpsc::UnboundedSender<()>,
    cancel: CancellationToken,
) {
    let cfg = watcher::Config::default()
        .fields(&format!("spec.nodeName={node},spec.driver={DRIVER_NAME}"));
    let mut events = watcher(Api::<ResourceSlice>::all(client), cfg)
        .default_backoff()
        .boxed();
    tokio::spawn(async move {
        loop {
            let ev = tokio::select! {
                _ = cancel.cancelled() => break,
                ev = events.next() => ev,
            };
            match ev {
                Some(Ok(
                    watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone,
                )) => {
                    if tx.send(()).is_err() {
                        break;
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "watching this node's ResourceSlice (retrying)")
                }
                None => break,
            }
        }
    });
}
