//! Keeps the node's ResourceSlice current: created once, replaced with the
//! pool generation bumped when the devices change (health, a restart on
//! changed hardware), left alone when they have not (a restart on the same
//! hardware), and other slices of this driver on this node (a renamed node
//! or an older layout) deleted, so the scheduler never sees a device
//! twice. Also creates the DeviceClasses when missing.
//!
//! Unhealthy GPUs carry a device taint; an API server without device taints
//! (before 1.33, or the gate off) silently drops the field, so what it
//! stored is compared with what was sent, and on a loss the publisher falls
//! back to leaving unhealthy GPUs out, for the life of the process.

use std::sync::{Mutex, PoisonError};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};

use crate::kube_api::ApiError;
use crate::slices::{self, GpuDevice, Unhealthy};

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
    /// How unhealthy GPUs are shown: as configured, until the API server
    /// is seen dropping taints.
    unhealthy: Mutex<Unhealthy>,
}

impl Publisher {
    pub fn new(node: &str, driver_version: &str, unhealthy: Unhealthy) -> Publisher {
        Publisher {
            node: node.to_string(),
            driver_version: driver_version.to_string(),
            last_generation: std::sync::atomic::AtomicI64::new(0),
            unhealthy: Mutex::new(unhealthy),
        }
    }

    /// How unhealthy GPUs are shown now.
    pub fn unhealthy(&self) -> Unhealthy {
        *self
            .unhealthy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// After a write: whether the API server kept the taints; if not, the
    /// fall-back is taken (and the caller publishes again).
    fn kept(&self, sent: &ResourceSlice, stored: &ResourceSlice) -> bool {
        if slices::taints_kept(&sent.spec, &stored.spec) {
            return true;
        }
        tracing::warn!(
            "the API server dropped the ResourceSlice's device taints (Kubernetes before 1.33, or \
             the DRADeviceTaints feature off): unhealthy GPUs are left out of the slice instead"
        );
        *self
            .unhealthy
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Unhealthy::LeftOut;
        false
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
        // A second round only after the API server dropped the taints.
        let first = self.reconcile_once(api, gpus).await?;
        match first {
            (p, true) => Ok(p),
            (_, false) => Ok(self.reconcile_once(api, gpus).await?.0),
        }
    }

    /// One round; `false` when the write lost its taints.
    async fn reconcile_once(
        &self,
        api: &dyn SliceApi,
        gpus: &[GpuDevice],
    ) -> Result<(Published, bool), ApiError> {
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
        let unhealthy = self.unhealthy();
        let build = |generation| {
            slices::build(
                &self.node,
                gpus,
                &self.driver_version,
                generation,
                unhealthy,
            )
        };
        match ours {
            None => {
                let generation = self
                    .last_generation
                    .load(std::sync::atomic::Ordering::Relaxed)
                    + 1;
                let s = build(generation);
                let stored = api.create(&s).await?;
                self.seen(generation);
                Ok((Published::Created { generation }, self.kept(&s, &stored)))
            }
            Some(cur) => {
                let generation = cur.spec.pool.generation;
                self.seen(generation);
                if slices::same_devices(&cur.spec, &build(generation).spec) {
                    return Ok((Published::Unchanged { generation }, true));
                }
                let mut next = build(generation + 1);
                next.metadata.resource_version = cur.metadata.resource_version.clone();
                let stored = api.replace(&next).await?;
                self.seen(generation + 1);
                let generation = generation + 1;
                Ok((
                    Published::Replaced { generation },
                    self.kept(&next, &stored),
                ))
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
