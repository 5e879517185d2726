//! `--mig-geometry` at the driver's start (issue 36, static MIG), as the
//! device-plugin manager applies it: node-agent's [`node_agent::geometry`]
//! over NVML, before the slice is published. The instances of prepared
//! claims (the checkpoint; every instance when it cannot be read) and
//! those a process uses are never destroyed, nor any vcuda did not make
//! (`mig-created.json` in the state directory, beside the checkpoint). A
//! GPU not in MIG mode that prepared claims hold whole or a share of is
//! left whole (node-agent's `left_whole`; `--mig-dynamic` too), as the manager leaves
//! one holding pods' shares.

use std::collections::BTreeSet;
use std::sync::Arc;

use anyhow::Context;
use node_agent::geometry::GpuRef;
use node_agent::mig::MigGpu;
use node_agent::nvml::Discovered;

use crate::checkpoint::{Checkpoint, CheckpointError, Store};
use crate::daemon::Settings;

/// Applies `s.mig_geometry` to the GPUs `found`; the GPUs as read again
/// when an instance was made or destroyed, else `found`.
pub async fn apply(
    s: &Settings,
    nvml: &Arc<nvml_wrapper::Nvml>,
    found: Discovered,
) -> anyhow::Result<Discovered> {
    let store = Store::new(&s.state_dir);
    // Held until the instances are changed: during a rolling update the
    // other instance prepares claims under it, so no claim is prepared
    // on an instance between its being counted free and destroyed.
    let (_lock, checkpoint) = match store.lock().await {
        Ok(l) => (Some(l), store.load(&s.node)),
        Err(e) => (None, Err(e)),
    };
    let shared = shared_gpus(&checkpoint);
    let whole = node_agent::geometry::left_whole(
        "mig-geometry",
        CLAIMS_HOLD,
        s.mig_geometry.gpus.keys(),
        &found,
        shared.as_ref(),
    );
    let mut geometry = s.mig_geometry.clone();
    geometry.gpus.retain(|name, _| !whole.contains(name));
    let held = held(checkpoint, &found.mig);
    let devices = (0..found.topology.len() as u32)
        .map(|i| nvml.device_by_index(i))
        .collect::<Result<Vec<_>, _>>()
        .context("NVML device handles for --mig-geometry")?;
    let gpus: Vec<GpuRef> = found
        .topology
        .gpus()
        .iter()
        .map(|g| GpuRef {
            index: g.index,
            uuid: &g.uuid,
        })
        .collect();
    let driver = node_agent::mig_nvml::NvmlMig {
        nvml,
        devices: &devices,
    };
    let changed =
        node_agent::geometry::apply_at_start(&driver, &gpus, &geometry, &held, &s.state_dir);
    if !changed {
        return Ok(found);
    }
    Ok(node_agent::nvml::discover(nvml)?)
}

/// The MIG UUIDs claims are prepared on; every MIG device `found` when the
/// checkpoint cannot be read (which of them a claim uses is then unknown).
pub fn held(checkpoint: Result<Checkpoint, CheckpointError>, found: &[MigGpu]) -> BTreeSet<String> {
    match checkpoint {
        Ok(c) => c
            .claims
            .values()
            .flat_map(|c| &c.devices)
            .filter_map(|d| d.mig.as_ref())
            .map(|m| m.uuid.clone())
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "checkpoint unread: every MIG device counts as a prepared claim's");
            found
                .iter()
                .flat_map(|m| &m.devices)
                .map(|d| d.uuid.clone())
                .collect()
        }
    }
}

/// Why [`shared_gpus`] keeps a GPU whole, as its log says.
pub const CLAIMS_HOLD: &str = "prepared claims hold the GPU whole or a share of it";

/// The GPUs (UUIDs) prepared claims hold whole or a share of, MIG devices
/// aside; `None` when the checkpoint cannot be read (any GPU may be).
pub fn shared_gpus(checkpoint: &Result<Checkpoint, CheckpointError>) -> Option<BTreeSet<String>> {
    let c = checkpoint.as_ref().ok()?;
    let devices = c.claims.values().flat_map(|c| &c.devices);
    Some(
        devices
            .filter(|d| d.mig.is_none())
            .map(|d| d.gpu_uuid.clone())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::PreparedClaim;
    use crate::plan::{PlannedDevice, PlannedMig};
    use node_agent::mig::MigDevice;

    fn planned(mig: Option<&str>) -> PlannedDevice {
        PlannedDevice {
            request: "mig".into(),
            pool: "n".into(),
            device: "d".into(),
            gpu_index: 0,
            gpu_uuid: "GPU-0".into(),
            cores: 100,
            memory_bytes: 0,
            soft_limit: None,
            tier: Default::default(),
            memory_limit: None,
            whole: mig.is_some(),
            share_id: None,
            mig: mig.map(|u| PlannedMig {
                uuid: u.into(),
                gpu_instance: 1,
                compute_instance: 0,
                placement: None,
            }),
        }
    }

    fn found(uuids: &[&str]) -> Vec<MigGpu> {
        vec![MigGpu {
            enabled: true,
            pending_change: false,
            devices: uuids
                .iter()
                .map(|u| MigDevice {
                    uuid: u.to_string(),
                    profile: "1g.10gb".into(),
                    gpu_instance: 1,
                    compute_instance: 0,
                    memory_bytes: 0,
                    multiprocessors: 0,
                })
                .collect(),
        }]
    }

    #[test]
    fn prepared_mig_devices_are_held_and_all_when_the_checkpoint_is_unread() {
        let mut c = Checkpoint::default();
        c.claims.insert(
            "u1".into(),
            PreparedClaim {
                namespace: "ns".into(),
                name: "c".into(),
                uid: "u1".into(),
                devices: vec![planned(Some("MIG-a")), planned(None)],
                prepared_at: 1,
            },
        );
        let on_node = found(&["MIG-a", "MIG-b"]);
        assert_eq!(held(Ok(c), &on_node), BTreeSet::from(["MIG-a".to_string()]));
        let unread = CheckpointError::Version {
            path: "checkpoint.json".into(),
            found: 9,
        };
        assert_eq!(
            held(Err(unread), &on_node),
            BTreeSet::from(["MIG-a".to_string(), "MIG-b".to_string()])
        );
    }
}
