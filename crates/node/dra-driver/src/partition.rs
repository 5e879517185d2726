//! Dynamic MIG at prepare and unprepare (issue 36): a claim allocated a
//! placement device ([`crate::dynamic`]) gets its GPU instance (with one
//! compute instance the size of it) created at prepare and destroyed at
//! unprepare. Each one made is recorded in `mig-created.json` (node-agent's
//! [`Created`]), so a `--mig-geometry` never takes it for an operator's
//! and the record says what vcuda may destroy.

use std::path::Path;
use std::sync::Arc;

use gpu_allocator::mig::Slices;
use node_agent::geometry::{Created, MigDriver};
use nvml_wrapper::error::NvmlError;

use crate::dynamic::Placement;
use crate::plan::{PlannedDevice, PlannedMig};

/// Where GPU instances are made and destroyed (NVML; a double in tests).
pub trait Partitioner: Send + Sync {
    /// Creates the GPU instance at `at` on GPU `gpu` with its full
    /// compute instance: its ids and MIG UUID.
    fn create(&self, gpu: usize, at: Placement) -> Result<PlannedMig, PartitionError>;
    /// Destroys GPU instance `gi` of GPU `gpu` and its compute instances.
    fn destroy(&self, gpu: usize, gi: u32) -> Result<(), PartitionError>;
}

#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    #[error("no dynamic MIG on this driver (a placement device, but no --mig-dynamic GPU)")]
    Unavailable,
    #[error("creating GPU instance (profile {profile}, memory slices {start}..{end}) on GPU {gpu}: {source}", end = start + size)]
    Create {
        gpu: usize,
        profile: u32,
        start: u32,
        size: u32,
        #[source]
        source: NvmlError,
    },
    #[error("GPU instance {gi} made on GPU {gpu} shows no MIG device")]
    NoUuid { gpu: usize, gi: u32 },
    #[error(transparent)]
    Read(#[from] node_agent::mig::MigReadError),
    #[error(
        "destroying GPU instance {gi} on GPU {gpu}: {source} (NVML refuses while a process uses it: \
         the claim's containers must end first; the kubelet retries)"
    )]
    Destroy {
        gpu: usize,
        gi: u32,
        #[source]
        source: NvmlError,
    },
    #[error("NVML device handles: {0}")]
    Handles(#[source] NvmlError),
    #[error("recording the instances vcuda made: {0}")]
    Record(#[from] quota_config::IoError),
}

/// Creates the instances of `devices`' placements not yet made, filling
/// in their ids and UUIDs, each recorded in `state_dir`'s
/// `mig-created.json` as soon as it exists. On an error those made so far
/// are destroyed again.
pub fn create_all(
    p: Option<&Arc<dyn Partitioner>>,
    state_dir: &Path,
    devices: &mut [PlannedDevice],
) -> Result<(), PartitionError> {
    for n in 0..devices.len() {
        let d = &devices[n];
        let Some(at) = d.mig.as_ref().and_then(|m| m.placement) else {
            continue;
        };
        let p = p.ok_or(PartitionError::Unavailable)?;
        let made = p.create(d.gpu_index, at).and_then(|m| {
            record(state_dir, &d.gpu_uuid, |set| {
                set.insert((m.gpu_instance, at.profile, at.start));
            })?;
            Ok(m)
        });
        match made {
            Ok(m) => {
                devices[n].mig = Some(PlannedMig {
                    placement: Some(at),
                    ..m
                })
            }
            Err(e) => {
                destroy_all(Some(p), state_dir, &devices[..n]).ok();
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Destroys the instances `devices` created and drops them from the
/// record; the first refusal is returned (the others are still tried).
pub fn destroy_all(
    p: Option<&Arc<dyn Partitioner>>,
    state_dir: &Path,
    devices: &[PlannedDevice],
) -> Result<(), PartitionError> {
    let mut first = Ok(());
    for d in devices {
        let Some((m, at)) = d.mig.as_ref().and_then(|m| Some((m, m.placement?))) else {
            continue;
        };
        if m.uuid.is_empty() {
            continue;
        }
        let r = p.ok_or(PartitionError::Unavailable).and_then(|p| {
            p.destroy(d.gpu_index, m.gpu_instance)?;
            record(state_dir, &d.gpu_uuid, |set| {
                set.remove(&(m.gpu_instance, at.profile, at.start));
            })
        });
        if let Err(e) = r {
            tracing::warn!(device = %d.device, error = %e, "destroying a claim's MIG instance");
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

fn record(
    state_dir: &Path,
    gpu_uuid: &str,
    change: impl FnOnce(&mut std::collections::BTreeSet<(u32, u32, u32)>),
) -> Result<(), PartitionError> {
    let mut c = Created::load(state_dir);
    change(c.gpus.entry(gpu_uuid.to_string()).or_default());
    c.gpus.retain(|_, s| !s.is_empty());
    Ok(c.store(state_dir)?)
}

/// The partitioner over NVML (node-agent's [`node_agent::mig_nvml`]).
pub struct NvmlPartitioner {
    pub nvml: Arc<nvml_wrapper::Nvml>,
    pub gpus: u32,
}

impl NvmlPartitioner {
    fn handles(&self) -> Result<Vec<nvml_wrapper::Device<'_>>, PartitionError> {
        (0..self.gpus)
            .map(|i| self.nvml.device_by_index(i))
            .collect::<Result<_, _>>()
            .map_err(PartitionError::Handles)
    }
}

impl Partitioner for NvmlPartitioner {
    fn create(&self, gpu: usize, at: Placement) -> Result<PlannedMig, PartitionError> {
        let devices = self.handles()?;
        let drv = node_agent::mig_nvml::NvmlMig {
            nvml: &self.nvml,
            devices: &devices,
        };
        let slices = Slices {
            start: at.start,
            size: at.size,
        };
        let gi = drv
            .create(gpu, at.profile, slices)
            .map_err(|source| PartitionError::Create {
                gpu,
                profile: at.profile,
                start: at.start,
                size: at.size,
                source,
            })?;
        let found = node_agent::mig::read(&self.nvml, &devices)?;
        let m = found
            .get(gpu)
            .and_then(|g| g.devices.iter().find(|m| m.gpu_instance == gi))
            .ok_or(PartitionError::NoUuid { gpu, gi })?;
        Ok(PlannedMig {
            uuid: m.uuid.clone(),
            gpu_instance: gi,
            compute_instance: m.compute_instance,
            placement: Some(at),
        })
    }

    fn destroy(&self, gpu: usize, gi: u32) -> Result<(), PartitionError> {
        let devices = self.handles()?;
        let drv = node_agent::mig_nvml::NvmlMig {
            nvml: &self.nvml,
            devices: &devices,
        };
        match drv.destroy(gpu, gi) {
            // Gone already (an operator, a reset): nothing to hold the
            // claim for, or it could never be unprepared.
            Ok(()) | Err(NvmlError::NotFound) => Ok(()),
            Err(source) => Err(PartitionError::Destroy { gpu, gi, source }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Instances in memory: (gpu, gi) → placement; `busy` refuses destroy
    /// as NVML does an instance in use.
    #[derive(Default)]
    pub(crate) struct Fake {
        pub made: Mutex<Vec<(usize, u32, Placement)>>,
        pub busy: Mutex<bool>,
    }

    impl Partitioner for Fake {
        fn create(&self, gpu: usize, at: Placement) -> Result<PlannedMig, PartitionError> {
            let mut made = self.made.lock().unwrap();
            let gi = 1 + made.iter().map(|m| m.1).max().unwrap_or(0);
            made.push((gpu, gi, at));
            Ok(PlannedMig {
                uuid: format!("MIG-made-{gi}"),
                gpu_instance: gi,
                compute_instance: 0,
                placement: Some(at),
            })
        }
        fn destroy(&self, gpu: usize, gi: u32) -> Result<(), PartitionError> {
            if *self.busy.lock().unwrap() {
                return Err(PartitionError::Destroy {
                    gpu,
                    gi,
                    source: NvmlError::InUse,
                });
            }
            self.made
                .lock()
                .unwrap()
                .retain(|m| (m.0, m.1) != (gpu, gi));
            Ok(())
        }
    }

    /// Claims by name (`ns/<name>`, uid = name).
    struct Claims(Vec<&'static str>);

    #[async_trait::async_trait]
    impl crate::driver::ClaimSource for Claims {
        async fn claim(
            &self,
            _ns: &str,
            name: &str,
        ) -> Result<k8s_openapi::api::resource::v1::ResourceClaim, crate::kube_api::ApiError>
        {
            let device = self.0[name.trim_start_matches('u').parse::<usize>().unwrap()];
            Ok(crate::dynamic::tests::claim_for(name, device))
        }
    }

    fn r(uid: &str) -> crate::driver::ClaimRef {
        crate::driver::ClaimRef {
            namespace: "ns".into(),
            uid: uid.into(),
            name: uid.into(),
        }
    }

    #[tokio::test]
    async fn a_placement_is_made_at_prepare_and_destroyed_at_unprepare_when_idle() {
        let tmp = tempfile::tempdir().unwrap();
        let gi = tmp
            .path()
            .join("host/proc/driver/nvidia/capabilities/gpu1/mig/gi1");
        std::fs::create_dir_all(gi.join("ci0")).unwrap();
        std::fs::write(gi.join("access"), "DeviceFileMinor: 21\n").unwrap();
        std::fs::write(gi.join("ci0/access"), "DeviceFileMinor: 22\n").unwrap();
        let state = tmp.path().join("state");
        let cfg = crate::driver::Config {
            node: "n1".into(),
            vm_root: tmp.path().join("vm"),
            vdriver_dir: tmp.path().join("vdriver"),
            cdi_dir: tmp.path().join("cdi"),
            state_dir: state.clone(),
            driver_version: (580, 95),
            extra_devices: vec![],
        };
        let inventory = crate::plan::Inventory {
            host_root: tmp.path().join("host"),
            ..crate::dynamic::tests::inventory()
        };
        let fake = Arc::new(Fake::default());
        let claims = Arc::new(Claims(vec![
            "gpu-0-mig-3g-40gb-4",
            "no-such-device",
            "gpu-0-mig-3g-40gb-0",
        ]));
        let d = crate::driver::Driver::start(cfg, inventory, claims)
            .unwrap()
            .with_partitioner(fake.clone());
        let p = d.prepare(&r("u0")).await.unwrap();
        assert_eq!(
            p[0].cdi_id,
            "vcuda.tencent.com/gpu=u0-mig-gpu-0-mig-3g-40gb-4"
        );
        let at = Placement {
            profile: 9,
            start: 4,
            size: 4,
        };
        assert_eq!(*fake.made.lock().unwrap(), [(0, 1, at)]);
        let spec =
            std::fs::read_to_string(crate::cdi::spec_path(&tmp.path().join("cdi"), "u0")).unwrap();
        assert!(spec.contains("NVIDIA_VISIBLE_DEVICES=MIG-made-1"), "{spec}");
        let created = Created::load(&state);
        assert_eq!(created.gpus["GPU-0"], [(1, 9, 4)].into());
        let held = &d.prepared()[0].devices[0];
        assert_eq!(
            held.mig.as_ref().unwrap().uuid,
            "MIG-made-1",
            "kept in the checkpoint"
        );
        // A device of no dynamic GPU: refused before anything is made.
        let e = d.prepare(&r("u1")).await.unwrap_err().to_string();
        assert!(e.contains("no device \"no-such-device\""), "{e}");
        assert_eq!(fake.made.lock().unwrap().len(), 1);
        // Made, but its capability files cannot be read (gi 2 has none):
        // the prepare fails and the instance is destroyed again.
        let e = d.prepare(&r("u2")).await.unwrap_err().to_string();
        assert!(e.contains("gi2"), "{e}");
        assert_eq!(*fake.made.lock().unwrap(), [(0, 1, at)]);
        assert_eq!(Created::load(&state).gpus["GPU-0"], [(1, 9, 4)].into());
        // In use: NVML refuses, the claim stays prepared.
        *fake.busy.lock().unwrap() = true;
        let e = d.unprepare(&r("u0")).await.unwrap_err().to_string();
        assert!(e.contains("must end first"), "{e}");
        assert_eq!(
            (d.prepared().len(), fake.made.lock().unwrap().len()),
            (1, 1)
        );
        *fake.busy.lock().unwrap() = false;
        d.unprepare(&r("u0")).await.unwrap();
        assert!(d.prepared().is_empty() && fake.made.lock().unwrap().is_empty());
        assert!(Created::load(&state).gpus.is_empty());
        assert!(!crate::cdi::spec_path(&tmp.path().join("cdi"), "u0").exists());
    }
}
