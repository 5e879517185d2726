//! Shares inside MIG instances (docs/mig.md, *Shares inside an instance*):
//! the instances of `--mig-shared-profiles` are the allocator's
//! [`SharedInstance`]s, and what a container in one is handed — the
//! instance's device nodes, `NVIDIA_VISIBLE_DEVICES=MIG-…`, the interposer
//! and a quota relative to the instance — comes from the device each was
//! found as, kept here by UUID.
//!
//! The map only grows (an instance read again replaces its entry): a
//! container placed in an instance that a rescan no longer finds is still
//! answered the same on a repeated Allocate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use device_plugin::api::ContainerAllocateResponse;
use gpu_allocator::{GpuInfo, SharedInstance};
use node_agent::edits::{self, MigEditsInput};
use node_agent::mig::{AccessCaps, MigDevice, MigGpu};

use super::Manager;
use crate::allocation::{Allocation, PlacementRecord};
use crate::decide::response::{annotations, render};

/// One shared instance as the node showed it.
#[derive(Debug, Clone)]
pub struct Found {
    pub device: MigDevice,
    pub caps: AccessCaps,
}

/// The instances of `profiles` among `mig` (by GPU index), with their
/// access capability nodes read under `host_root`; the ones whose nodes
/// cannot be read are left out, logged (a container could not use them).
pub fn shared_instances(
    host_root: &Path,
    gpus: &[GpuInfo],
    mig: &[MigGpu],
    profiles: &[String],
) -> Vec<(SharedInstance, Found)> {
    let mut out = Vec::new();
    for (g, state) in gpus.iter().zip(mig).filter(|(_, m)| m.enabled) {
        for d in state
            .devices
            .iter()
            .filter(|d| profiles.contains(&d.profile))
        {
            match node_agent::mig::access_caps(host_root, g.minor, d) {
                Ok(caps) => out.push((
                    SharedInstance {
                        uuid: d.uuid.clone(),
                        gpu: g.index,
                        profile: d.profile.clone(),
                        memory_bytes: d.memory_bytes,
                    },
                    Found {
                        device: d.clone(),
                        caps,
                    },
                )),
                Err(e) => tracing::error!(
                    instance = %d.uuid, gpu = g.index, error = %e,
                    "a MIG instance of a shared profile is left out: its access capability nodes cannot be read"
                ),
            }
        }
    }
    out
}

/// `mig` without the instances of `profiles`: what the per-profile plugins
/// serve whole.
pub fn served_whole(mig: &[MigGpu], profiles: &[String]) -> Vec<MigGpu> {
    mig.iter()
        .map(|m| MigGpu {
            devices: m
                .devices
                .iter()
                .filter(|d| !profiles.contains(&d.profile))
                .cloned()
                .collect(),
            ..m.clone()
        })
        .collect()
}

/// The shared instances' devices and health evidence, in the manager.
#[derive(Debug, Default)]
pub struct MigShares {
    /// Every instance found since the start, by UUID (only grows).
    devices: BTreeMap<String, Found>,
    /// The UUIDs the last read found.
    present: BTreeSet<String>,
    /// GPUs (`None`) and GPU instances with a critical Xid in its quiet
    /// period.
    out: BTreeSet<(usize, Option<u32>)>,
    /// Lost instances whose pods were told (once each time one is lost).
    told: BTreeSet<String>,
}

impl MigShares {
    /// Whether instance `uuid` on GPU `gpu` takes new shares: found by the
    /// last read, and no Xid on it or its GPU.
    fn healthy(&self, uuid: &str, gpu: usize) -> bool {
        let gi = self.devices.get(uuid).map(|f| f.device.gpu_instance);
        self.present.contains(uuid)
            && !self.out.contains(&(gpu, None))
            && !gi.is_some_and(|g| self.out.contains(&(gpu, Some(g))))
    }
}

impl Manager {
    fn mig_shares(&self) -> std::sync::MutexGuard<'_, MigShares> {
        self.mig_shares.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The node's shared instances now (at start, and at each rescan): the
    /// allocator's list and their advertised IDs follow.
    pub fn set_shared_instances(&self, found: Vec<(SharedInstance, Found)>) {
        let list = {
            let mut m = self.mig_shares();
            m.present.clear();
            found
                .into_iter()
                .map(|(i, f)| {
                    m.present.insert(i.uuid.clone());
                    m.devices.insert(i.uuid.clone(), f);
                    i
                })
                .collect()
        };
        self.st().allocator.set_instances(list);
        self.apply_instance_health();
        self.tell_lost();
    }

    /// Instances no read finds any more that still hold shares: kept
    /// (unhealthy) until their shares go.
    fn lost_instances(&self) -> Vec<(String, usize)> {
        let present = self.mig_shares().present.clone();
        let st = self.st();
        st.allocator
            .instances()
            .filter(|(i, u)| u.shares > 0 && !present.contains(&i.uuid))
            .map(|(i, _)| (i.uuid.clone(), i.gpu))
            .collect()
    }

    /// The lost shared instances for the display's `vcuda_mig_device_lost`
    /// (the holder: `tencent.com/vcuda-core`, the resource the shares came
    /// through).
    pub fn lost_shared_views(&self) -> Vec<gpu_display::LostMigView> {
        let lost = self.lost_instances().into_iter();
        lost.map(|(uuid, gpu)| gpu_display::LostMigView {
            gpu: gpu as u32,
            uuid,
            holder: gpu_pods::VCORE_RESOURCE.to_string(),
        })
        .collect()
    }

    /// A `VcudaMigDeviceLost` Event, once, on each pod with a share in an
    /// instance that was destroyed under it (its CUDA fails there now).
    fn tell_lost(&self) {
        let lost = self.lost_instances();
        let new: Vec<(String, usize)> = {
            let mut m = self.mig_shares();
            m.told.retain(|u| lost.iter().any(|(l, _)| l == u));
            lost.into_iter()
                .filter(|(u, _)| m.told.insert(u.clone()))
                .collect()
        };
        for (uuid, gpu) in new {
            let holders: Vec<Allocation> = self
                .st()
                .allocs
                .values()
                .filter(|a| matches!(&a.placement, PlacementRecord::InMig { instance, .. } if *instance == uuid))
                .cloned()
                .collect();
            for a in holders {
                let note = format!(
                    "MIG device {uuid} (a shared instance on GPU {gpu}) was destroyed while container {} held a share in it: \
                     CUDA on it fails; delete the pod for a new placement",
                    a.container
                );
                tracing::warn!(pod = %format!("{}/{}", a.namespace, a.pod_name), "{note}");
                self.events.post(node_agent::events::PodEvent {
                    namespace: a.namespace.clone(),
                    name: a.pod_name.clone(),
                    uid: a.pod_uid.clone(),
                    reason: node_agent::events::MIG_DEVICE_LOST,
                    note,
                });
            }
        }
    }

    /// An Xid on GPU `gpu` (`gi: None`) or inside its GPU instance `gi`, or
    /// its quiet period: the shared instances there take no new shares,
    /// their IDs Unhealthy (or back).
    pub fn set_mig_health(&self, gpu: usize, gi: Option<u32>, healthy: bool) {
        {
            let mut m = self.mig_shares();
            if healthy {
                m.out.remove(&(gpu, gi));
            } else {
                m.out.insert((gpu, gi));
            }
        }
        self.apply_instance_health();
    }

    /// Each shared instance's health into the allocator and the IDs.
    fn apply_instance_health(&self) {
        let m = self.mig_shares();
        if m.devices.is_empty() {
            return; // no shared profiles here: the IDs stay as they are
        }
        let mut st = self.st();
        let listed: Vec<(String, usize)> = st
            .allocator
            .instances()
            .map(|(i, _)| (i.uuid.clone(), i.gpu))
            .collect();
        for (uuid, gpu) in &listed {
            st.allocator
                .set_instance_healthy(uuid, m.healthy(uuid, *gpu));
        }
        let instances: Vec<_> = st
            .allocator
            .instances()
            .map(|(i, u)| (i.clone(), u.healthy))
            .collect();
        drop((st, m));
        self.vcore.replace(crate::decide::ids::with_instances(
            self.vcore.snapshot(),
            &instances,
            &self.gpus,
            false,
        ));
        self.vmemory.replace(crate::decide::ids::with_instances(
            self.vmemory.snapshot(),
            &instances,
            &self.gpus,
            true,
        ));
    }

    /// Instance `uuid`'s memory (0 when unknown: nothing is lent there).
    pub(super) fn instance_bytes(&self, uuid: &str) -> u64 {
        self.mig_shares()
            .devices
            .get(uuid)
            .map_or(0, |f| f.device.memory_bytes)
    }

    /// Whether a container can be handed instance `uuid` (its nodes known).
    pub(super) fn knows_instance(&self, uuid: &str) -> bool {
        self.mig_shares().devices.contains_key(uuid)
    }

    /// The answer for a share inside instance `uuid` of GPU `gpu`.
    pub(super) fn answer_in_mig(
        &self,
        a: &Allocation,
        dir: &Path,
        gpu: usize,
        uuid: &str,
    ) -> Option<ContainerAllocateResponse> {
        let caps = self.mig_shares().devices.get(uuid)?.caps;
        let parent = &self.gpus[gpu];
        let e = edits::for_mig(&MigEditsInput {
            parent,
            uuid,
            caps,
            vdriver_dir: &self.config.vdriver_dir,
            extra_devices: &self.extra.devices,
            share_vm_dir: Some(dir),
        });
        let device = format!("/dev/nvidia{}", parent.minor);
        let ann = annotations(a.cores, a.memory_units, &device);
        Some(render(&e, ann))
    }
}
