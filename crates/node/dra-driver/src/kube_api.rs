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
use crate::slices::ClassAction;

/// A request to the API server that failed, and what it was for.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("claim {namespace}/{name}: reading it from the API server: {source}")]
    ReadClaim {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("listing ResourceSlices of node {node}: {source}")]
    ListSlices { node: String, source: kube::Error },
    #[error("creating ResourceSlice {name:?}: {source}")]
    CreateSlice {
        name: Option<String>,
        source: kube::Error,
    },
    #[error("updating ResourceSlice {name}: {source}")]
    ReplaceSlice { name: String, source: kube::Error },
    #[error("deleting ResourceSlice {name}: {source}")]
    DeleteSlice { name: String, source: kube::Error },
    #[error("creating DeviceClass {name}: {source}")]
    CreateClass { name: String, source: kube::Error },
    #[error("updating DeviceClass {name} to this release's: {source}")]
    UpdateClass { name: String, source: kube::Error },
}

/// The API server's answer to a request for an object it does not hold
/// (for the in-memory doubles).
pub fn not_found(resource: &str, name: &str) -> kube::Error {
    let status = kube::core::Status::failure(&format!("{resource} {name:?} not found"), "NotFound");
    kube::Error::Api(status.with_code(404).boxed())
}

#[derive(Clone)]
pub struct KubeApi {
    pub client: Client,
}

#[async_trait::async_trait]
impl ClaimSource for KubeApi {
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|source| ApiError::ReadClaim {
                namespace: namespace.to_string(),
                name: name.to_string(),
                source,
            })
    }
}

#[async_trait::async_trait]
impl SliceApi for KubeApi {
    async fn list(&self, node: &str) -> Result<Vec<ResourceSlice>, ApiError> {
        let lp = ListParams::default()
            .fields(&format!("spec.nodeName={node},spec.driver={DRIVER_NAME}"));
        Api::<ResourceSlice>::all(self.client.clone())
            .list(&lp)
            .await
            .map(|l| l.items)
            .map_err(|source| ApiError::ListSlices {
                node: node.to_string(),
                source,
            })
    }

    async fn create(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        Api::<ResourceSlice>::all(self.client.clone())
            .create(&PostParams::default(), s)
            .await
            .map_err(|source| ApiError::CreateSlice {
                name: s.metadata.name.clone(),
                source,
            })
    }

    async fn replace(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let name = s.metadata.name.clone().unwrap_or_default();
        Api::<ResourceSlice>::all(self.client.clone())
            .replace(&name, &PostParams::default(), s)
            .await
            .map_err(|source| ApiError::ReplaceSlice { name, source })
    }

    async fn delete(&self, name: &str) -> Result<(), ApiError> {
        match Api::<ResourceSlice>::all(self.client.clone())
            .delete(name, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(source) => Err(ApiError::DeleteSlice {
                name: name.to_string(),
                source,
            }),
        }
    }

    async fn ensure_class(&self, c: &DeviceClass) -> Result<(), ApiError> {
        let api = Api::<DeviceClass>::all(self.client.clone());
        let name = c.metadata.name.clone().unwrap_or_default();
        match api.create(&PostParams::default(), c).await {
            Ok(stored) => {
                dropped_fields(c, &stored);
                return Ok(());
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(source) => return Err(ApiError::CreateClass { name, source }),
        }
        let update = |source| ApiError::UpdateClass {
            name: name.clone(),
            source,
        };
        let have = api.get(&name).await.map_err(update)?;
        match crate::slices::class_action(&have, c) {
            ClassAction::Keep => {}
            ClassAction::Update(new) => {
                let stored = api
                    .replace(&name, &PostParams::default(), &new)
                    .await
                    .map_err(update)?;
                tracing::info!(class = %name, "DeviceClass updated to this release's selectors");
                dropped_fields(c, &stored);
            }
            ClassAction::Foreign(why) => tracing::warn!(class = %name, "{why}"),
        }
        Ok(())
    }
}

/// Says so when the API server dropped the class's `extendedResourceName`
/// (`DRAExtendedResource` off: before 1.36 by default): pods then cannot
/// ask for whole GPUs by that name, claims still work. Such a server gets
/// the class updated again at each start (the stored one differs from
/// this release's); that costs one write.
fn dropped_fields(want: &DeviceClass, stored: &DeviceClass) {
    if let Some(r) = &want.spec.extended_resource_name
        && stored.spec.extended_resource_name.is_none()
    {
        tracing::warn!(
            class = want.metadata.name.as_deref().unwrap_or_default(),
            resource = %r,
            "the API server dropped the DeviceClass's extendedResourceName (feature gate DRAExtendedResource off?): \
             pods cannot ask for whole GPUs as `{r}` in their limits; ResourceClaims work as before"
        );
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
