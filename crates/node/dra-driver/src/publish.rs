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

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, PoisonError};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};

use crate::dynamic::DynamicGpu;
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
    /// The dynamic MIG GPUs by index ([`crate::dynamic`]); none: the
    /// pool is one slice.
    dynamic: Mutex<BTreeMap<usize, DynamicGpu>>,
}

impl Publisher {
    pub fn new(node: &str, driver_version: &str, unhealthy: Unhealthy) -> Publisher {
        Publisher {
            node: node.to_string(),
            driver_version: driver_version.to_string(),
            last_generation: std::sync::atomic::AtomicI64::new(0),
            unhealthy: Mutex::new(unhealthy),
            dynamic: Mutex::new(BTreeMap::new()),
        }
    }

    /// What the dynamic GPUs offer from now on (published at the next
    /// reconcile).
    pub fn set_dynamic(&self, d: BTreeMap<usize, DynamicGpu>) {
        *self.dynamic.lock().unwrap_or_else(PoisonError::into_inner) = d;
    }

    /// Whether GPU `index` is partitioned per claim (`--mig-dynamic`).
    pub fn is_dynamic(&self, index: usize) -> bool {
        self.dynamic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&index)
    }

    fn dynamic(&self) -> BTreeMap<usize, DynamicGpu> {
        self.dynamic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
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
            .fetch_max(generation, Ordering::Relaxed);
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

    /// One round; `false` when the write lost its taints. The pool is one
    /// slice, or several with dynamic GPUs ([`slices::build_pool`]): all
    /// are written at one generation, the scheduler ignoring a pool's
    /// slices below its highest.
    async fn reconcile_once(
        &self,
        api: &dyn SliceApi,
        gpus: &[GpuDevice],
    ) -> Result<(Published, bool), ApiError> {
        let unhealthy = self.unhealthy();
        let dynamic = self.dynamic();
        let build = |generation| {
            slices::build_pool(
                &self.node,
                gpus,
                &dynamic,
                &self.driver_version,
                generation,
                unhealthy,
            )
        };
        let name = |s: &ResourceSlice| s.metadata.name.clone().unwrap_or_default();
        let wanted: Vec<String> = build(0).iter().map(name).collect();
        let mut ours = BTreeMap::new();
        for s in api.list(&self.node).await? {
            let n = name(&s);
            if wanted.contains(&n) {
                ours.insert(n, s);
                continue;
            }
            tracing::info!(
                slice = n,
                "deleting another slice of this driver on this node"
            );
            api.delete(&n).await?;
        }
        let current = ours.values().map(|s| s.spec.pool.generation).max();
        if let Some(g) = current {
            self.seen(g);
            if unchanged(&ours, &build(g), g) {
                return Ok((Published::Unchanged { generation: g }, true));
            }
        }
        let generation = match current {
            Some(g) => g + 1,
            None => self.last_generation.load(Ordering::Relaxed) + 1,
        };
        let mut kept = true;
        for mut s in build(generation) {
            let stored = match ours.get(&name(&s)) {
                Some(cur) => {
                    s.metadata.resource_version = cur.metadata.resource_version.clone();
                    api.replace(&s).await?
                }
                None => api.create(&s).await?,
            };
            kept &= self.kept(&s, &stored);
        }
        self.seen(generation);
        let p = match current {
            None => Published::Created { generation },
            Some(_) => Published::Replaced { generation },
        };
        Ok((p, kept))
    }

    pub async fn ensure_classes(&self, api: &dyn SliceApi) -> Result<(), ApiError> {
        for c in slices::device_classes() {
            api.ensure_class(&c).await?;
        }
        Ok(())
    }
}

/// Whether the slices `ours` are `want` at `generation` already.
fn unchanged(
    ours: &BTreeMap<String, ResourceSlice>,
    want: &[ResourceSlice],
    generation: i64,
) -> bool {
    want.len() == ours.len()
        && want.iter().all(|w| {
            let n = w.metadata.name.as_deref().unwrap_or_default();
            ours.get(n).is_some_and(|c| {
                c.spec.pool.generation == generation && slices::same_devices(&c.spec, &w.spec)
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API server's slices, by name.
    #[derive(Default)]
    struct Fake(Mutex<BTreeMap<String, ResourceSlice>>);

    impl Fake {
        fn slices(&self) -> BTreeMap<String, ResourceSlice> {
            self.0.lock().unwrap().clone()
        }
    }

    #[async_trait::async_trait]
    impl SliceApi for Fake {
        async fn list(&self, _node: &str) -> Result<Vec<ResourceSlice>, ApiError> {
            Ok(self.slices().into_values().collect())
        }
        async fn create(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            let name = s.metadata.name.clone().unwrap();
            self.0.lock().unwrap().insert(name, s.clone());
            Ok(s.clone())
        }
        async fn replace(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            self.create(s).await
        }
        async fn delete(&self, name: &str) -> Result<(), ApiError> {
            self.0.lock().unwrap().remove(name);
            Ok(())
        }
        async fn ensure_class(&self, _c: &DeviceClass) -> Result<(), ApiError> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_dynamic_gpu_makes_the_pool_several_slices_at_one_generation() {
        let api = Fake::default();
        let p = Publisher::new("n", "580.95.05", Unhealthy::LeftOut);
        let gpus = [crate::mig::tests::h100_mig()];
        p.set_dynamic(BTreeMap::from([(1, crate::dynamic::tests::h100())]));
        assert_eq!(
            p.reconcile(&api, &gpus).await.unwrap(),
            Published::Created { generation: 1 }
        );
        let s = api.slices();
        let names: Vec<&String> = s.keys().collect();
        assert_eq!(
            names,
            ["n-vcuda.tencent.com", "n-vcuda.tencent.com-counters"]
        );
        for x in s.values() {
            assert_eq!(
                (x.spec.pool.generation, x.spec.pool.resource_slice_count),
                (1, 2)
            );
        }
        let counters = &s["n-vcuda.tencent.com-counters"].spec.shared_counters;
        assert_eq!(counters.as_ref().unwrap()[0].name, "gpu-1-mig");
        let devices = s["n-vcuda.tencent.com"].spec.devices.as_ref().unwrap();
        assert_eq!(devices.len(), 18, "every placement, no static device");
        assert_eq!(
            p.reconcile(&api, &gpus).await.unwrap(),
            Published::Unchanged { generation: 1 }
        );
        // Back to static: the counters slice goes, the one slice stays.
        p.set_dynamic(BTreeMap::new());
        assert_eq!(
            p.reconcile(&api, &gpus).await.unwrap(),
            Published::Replaced { generation: 2 }
        );
        let s = api.slices();
        assert_eq!(s.keys().collect::<Vec<_>>(), ["n-vcuda.tencent.com"]);
        let one = &s["n-vcuda.tencent.com"].spec;
        assert_eq!((one.pool.generation, one.pool.resource_slice_count), (2, 1));
        assert_eq!(
            one.devices.as_ref().unwrap().len(),
            2,
            "the static MIG devices"
        );
    }
}
