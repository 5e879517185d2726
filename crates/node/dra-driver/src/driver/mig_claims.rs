//! The MIG side of [`Driver`]: which MIG device a claim holds, its CDI
//! spec, and whether another prepared claim holds it already.

use super::*;

/// Why the dynamic GPUs were not read again (the next period tries again).
#[derive(Debug, thiserror::Error)]
pub enum RescanError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The node's MIG state (node-agent's message).
    #[error("{0}")]
    Read(String),
    #[error("a blocking NVML task ended: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl Driver {
    /// The MIG device a claim holds (the planner keeps it alone).
    pub(super) fn mig_of(devices: &[PlannedDevice]) -> Option<(&PlannedDevice, &PlannedMig)> {
        devices.iter().find_map(|d| d.mig.as_ref().map(|m| (d, m)))
    }

    /// A MIG device's spec: its access capability nodes read now, from
    /// the driver's files (an instance destroyed meanwhile has none).
    pub(super) fn mig_spec(
        &self,
        uid: &str,
        d: &PlannedDevice,
        m: &PlannedMig,
        share_vm_dir: Option<&std::path::Path>,
    ) -> Result<cdi::Spec, ClaimFailure> {
        let gone = || ClaimFailure::MigGone {
            device: d.device.clone(),
            uuid: m.uuid.clone(),
        };
        let parent = self.inventory.gpus.get(d.gpu_index).ok_or_else(gone)?;
        // A placement's instance was made after the inventory was read.
        let made = m.placement.map(|_| node_agent::mig::MigDevice {
            uuid: m.uuid.clone(),
            gpu_instance: m.gpu_instance,
            compute_instance: m.compute_instance,
            profile: String::new(),
            memory_bytes: 0,
            multiprocessors: 0,
        });
        // A static one as last read (a rescan may have found it since start).
        let found = made
            .or_else(|| self.planning().mig_by_uuid(d.gpu_index, &m.uuid).cloned())
            .ok_or_else(gone)?;
        let caps = node_agent::mig::access_caps(&self.inventory.host_root, parent.minor, &found)
            .map_err(|source| ClaimFailure::MigCaps {
                device: d.device.clone(),
                source,
            })?;
        Ok(cdi::mig_spec(&cdi::MigInput {
            name: cdi::device_name(uid, &d.request, &d.device),
            parent,
            uuid: &m.uuid,
            caps,
            vdriver_dir: &self.cfg.vdriver_dir,
            extra_devices: &self.cfg.extra_devices,
            share_vm_dir,
        }))
    }

    /// A MIG device of `planned` that a prepared claim already holds whole,
    /// or holds in a share while `planned` wants it whole (the scheduler's
    /// capacity accounting never allows either; an allocation that says
    /// otherwise is stale).
    pub(super) fn taken(st: &Checkpoint, planned: &[PlannedDevice]) -> Option<ClaimFailure> {
        let (d, m) = Self::mig_of(planned)?;
        st.claims.values().find_map(|other| {
            let (o, held) = Self::mig_of(&other.devices)?;
            (held.uuid == m.uuid && (d.whole || o.whole)).then(|| ClaimFailure::MigTaken {
                device: d.device.clone(),
                claim: format!("{}/{}", other.namespace, other.name),
            })
        })
    }

    /// Reads the dynamic GPUs' instances again (`read`, blocking: NVML)
    /// under the checkpoint lock, so that no prepare or unprepare runs
    /// around the read, for the health of the placement devices' instances
    /// ([`crate::mig_health::DynamicSeen`]). Whether a prepared claim's
    /// instance is now found gone or back.
    pub async fn rescan_dynamic(
        &self,
        read: impl FnOnce() -> Result<Vec<node_agent::mig::MigGpu>, RescanError> + Send + 'static,
    ) -> Result<bool, RescanError> {
        let mut st = self.state.lock().await;
        let _lock = self.store.lock().await?;
        self.sync_from_disk(&mut st)?;
        let placed: Vec<(String, usize)> = st
            .claims
            .values()
            .flat_map(|c| {
                c.devices
                    .iter()
                    .filter(|d| d.mig.as_ref().is_some_and(|m| m.placement.is_some()))
                    .map(|d| (c.uid.clone(), d.gpu_index))
            })
            .collect();
        let states = tokio::task::spawn_blocking(read).await??;
        let mut seen = crate::mig_health::DynamicSeen::default();
        for (uid, gpu) in placed {
            seen.claims.insert(uid);
            let uuids = states
                .get(gpu)
                .filter(|m| m.enabled)
                .map(|m| m.devices.iter().map(|d| d.uuid.clone()).collect())
                .unwrap_or_default();
            seen.instances.insert(gpu, uuids);
        }
        let before = self.lost_mig_devices();
        *self.dynamic_seen.write().unwrap_or_else(|p| p.into_inner()) = seen;
        drop(st);
        self.refresh_mig_health();
        Ok(self.lost_mig_devices() != before)
    }
}
