//! Keeps the node's ResourceSlice current: created once, replaced with the
//! pool generation bumped when the devices change (health, a restart on
//! changed hardware), left alone when they have not (a restart on the same
//! hardware), and other slices of this driver on this node (a renamed node
//! or an older layout) deleted, so the scheduler never sees a device
//! twice. Also creates the DeviceClasses when missing.

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};

use crate::kube_api::ApiError;
use crate::slices::{self, GpuDevice};

/// Where slices and classes are written (the API server; kube in
/// [`crate::kube_api`]).
#[async_trait::async_trait]
pub trait SliceApi: Send + Sync {
    /// This driver's slices on `node`.
    async fn list(&self, node: &str) -> Result<Vec<ResourceSlice>, ApiError>;
    async fn create(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError>;
    /// Replaces (with the `resourceVersion` in `s`: a conflict is an error).
    async fn replace(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError>;
    async fn delete(&self, name: &str) -> Result<(), ApiError>;
    /// Creates the class unless one of that name exists.
    async fn ensure_class(&self, c: &DeviceClass) -> Result<(), ApiError>;
}

/// What one reconcile did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    Created { generation: i64 },
    Replaced { generation: i64 },
    Unchanged { generation: i64 },
}

pub struct Publisher {
    pub node: String,
    pub driver_version: String,
    /// The highest pool generation this process published: a slice
    /// deleted behind its back comes back above it, so a scheduler still
    /// holding the old one in its cache prefers the new.
    pub last_generation: std::sync::atomic::AtomicI64,
}

impl Publisher {
    pub fn new(node: &str, driver_version: &str) -> Publisher {
        Publisher {
            node: node.to_string(),
            driver_version: driver_version.to_string(),
            last_generation: std::sync::atomic::AtomicI64::new(0),
        }
    }

    fn seen(&self, generation: i64) {
        self.last_generation
            .fetch_max(generation, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Publisher {
    /// Brings the API server to `gpus`.
    pub async fn reconcile(
        &self,
        api: &dyn SliceApi,
        gpus: &[GpuDevice],
    ) -> Result<Published, ApiError> {
        let name = slices::slice_name(&self.node);
        let existing = api.list(&self.node).await?;
        for s in &existing {
            let n = s.metadata.name.as_deref().unwrap_or_default();
            if n != name {
                tracing::info!(
                    slice = n,
                    "deleting another slice of this driver on this node"
                );
                api.delete(n).await?;
            }
        }
        let ours = existing
            .into_iter()
            .find(|s| s.metadata.name.as_deref() == Some(name.as_str()));
        match ours {
            None => {
                let generation = self
                    .last_generation
                    .load(std::sync::atomic::Ordering::Relaxed)
                    + 1;
                let s = slices::build(&self.node, gpus, &self.driver_version, generation);
                api.create(&s).await?;
                self.seen(generation);
                Ok(Published::Created { generation })
            }
            Some(cur) => {
                let generation = cur.spec.pool.generation;
                self.seen(generation);
                let want = slices::build(&self.node, gpus, &self.driver_version, generation);
                if slices::same_devices(&cur.spec, &want.spec) {
                    return Ok(Published::Unchanged { generation });
                }
                let mut next =
                    slices::build(&self.node, gpus, &self.driver_version, generation + 1);
                next.metadata.resource_version = cur.metadata.resource_version.clone();
                api.replace(&next).await?;
                self.seen(generation + 1);
                Ok(Published::Replaced {
                    generation: generation + 1,
                })
            }
        }
    }

    pub async fn ensure_classes(&self, api: &dyn SliceApi) -> Result<(), ApiError> {
        for c in slices::device_classes() {
            api.ensure_class(&c).await?;
        }
        Ok(())
    }
}
