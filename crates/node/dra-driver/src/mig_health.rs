//! The health of prepared claims' MIG devices, for the kubelet's health
//! stream (KEP-4680) and the claims' pods: a MIG device is unhealthy while
//! its GPU or its GPU instance has a recent critical Xid, and for good once
//! an operator destroyed its instance under a prepared claim (the static
//! MIG rescan no longer finds its UUID). The pod cannot get the instance
//! back (a new one has another UUID on a real GPU) and its CUDA calls fail,
//! so the kubelet shows the device Unhealthy in the pod's status and the
//! pod gets an Event ([`lost`]) rather than a silent failure. A dynamic
//! device's instance (made at prepare) is watched the same way, by
//! [`DynamicSeen`]: a read of the dynamic GPUs' instances taken under the
//! checkpoint lock, so a claim prepared or unprepared around the read is
//! never taken for one whose instance went. Pure: the driver and the
//! controller feed it what they hold.

use std::collections::{BTreeMap, BTreeSet};

use node_agent::mig::MigDevice;

use crate::checkpoint::PreparedClaim;
use crate::driver::GpuHealth;

/// Critical Xids inside GPU instances, by (GPU index, GPU instance id).
pub type InstanceXids = BTreeMap<(usize, u32), u64>;

/// The dynamic GPUs' MIG devices as last read, and the claims prepared
/// when they were read (only those are judged by it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DynamicSeen {
    pub claims: BTreeSet<String>,
    /// MIG UUIDs by GPU index.
    pub instances: BTreeMap<usize, BTreeSet<String>>,
}

/// A prepared claim's MIG device whose instance is gone.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LostDevice {
    pub claim_uid: String,
    pub namespace: String,
    pub name: String,
    pub pool: String,
    /// The device's name in the slice and the allocation (`gpu-0-mig-5-0`).
    pub device: String,
    pub uuid: String,
    pub gpu: usize,
}

impl LostDevice {
    /// What the pod's Event, the health stream and the log say.
    pub fn describe(&self) -> String {
        format!(
            "MIG device {} ({} of gpu-{}) was destroyed while claim {}/{} held it: CUDA on it fails; \
             delete the pod for a new device",
            self.uuid, self.device, self.gpu, self.namespace, self.name
        )
    }
}

/// The prepared claims' MIG devices not among their GPU's MIG devices
/// now: a static device's by `mig[g]` (GPU `g`'s, `None` when it left MIG
/// mode), a dynamic one's by `dynamic` when its claim was prepared at
/// that read.
pub fn lost(
    prepared: &[PreparedClaim],
    mig: &[Option<Vec<MigDevice>>],
    dynamic: &DynamicSeen,
) -> Vec<LostDevice> {
    let mut out = Vec::new();
    for c in prepared {
        for d in &c.devices {
            let Some(m) = d.mig.as_ref() else {
                continue;
            };
            let present = if m.placement.is_some() {
                let seen = dynamic.claims.contains(&c.uid);
                let now = dynamic.instances.get(&d.gpu_index);
                !seen || now.is_none_or(|u| u.contains(&m.uuid))
            } else {
                match mig.get(d.gpu_index) {
                    Some(Some(now)) => now.iter().any(|x| x.uuid == m.uuid),
                    // Not in MIG mode any more: every instance went with it.
                    Some(None) => false,
                    // A GPU this driver does not know: nothing to say.
                    None => true,
                }
            };
            if !present {
                out.push(LostDevice {
                    claim_uid: c.uid.clone(),
                    namespace: c.namespace.clone(),
                    name: c.name.clone(),
                    pool: d.pool.clone(),
                    device: d.device.clone(),
                    uuid: m.uuid.clone(),
                    gpu: d.gpu_index,
                });
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Each prepared claim's MIG device, by (pool, device name), with its
/// health: lost, else its GPU's health, else its GPU instance's Xid.
pub fn devices(
    prepared: &[PreparedClaim],
    mig: &[Option<Vec<MigDevice>>],
    dynamic: &DynamicSeen,
    gpus: &[GpuHealth],
    instance_xids: &InstanceXids,
) -> BTreeMap<(String, String), GpuHealth> {
    let mut out: BTreeMap<(String, String), GpuHealth> = BTreeMap::new();
    for c in prepared {
        for d in &c.devices {
            let Some(m) = &d.mig else { continue };
            let health = match gpus.get(d.gpu_index) {
                Some(g) if !g.healthy => g.clone(),
                _ => match instance_xids.get(&(d.gpu_index, m.gpu_instance)) {
                    Some(xid) => GpuHealth {
                        healthy: false,
                        message: format!(
                            "critical Xid {xid} in GPU instance {} of gpu-{}",
                            m.gpu_instance, d.gpu_index
                        ),
                    },
                    None => GpuHealth::default(),
                },
            };
            out.insert((d.pool.clone(), d.device.clone()), health);
        }
    }
    for l in lost(prepared, mig, dynamic) {
        out.insert(
            (l.pool.clone(), l.device.clone()),
            GpuHealth {
                healthy: false,
                message: l.describe(),
            },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{PlannedDevice, PlannedMig};

    fn mig(gi: u32) -> MigDevice {
        MigDevice {
            uuid: format!("MIG-{gi}"),
            profile: "1g.10gb".into(),
            gpu_instance: gi,
            compute_instance: 0,
            memory_bytes: 10 << 30,
            multiprocessors: 16,
        }
    }

    fn claim(uid: &str, gpu: usize, gi: u32, dynamic: bool) -> PreparedClaim {
        PreparedClaim {
            namespace: "ns".into(),
            name: format!("claim-{uid}"),
            uid: uid.into(),
            devices: vec![PlannedDevice {
                request: "mig".into(),
                pool: "node-a".into(),
                device: format!("gpu-{gpu}-mig-{gi}-0"),
                gpu_index: gpu,
                gpu_uuid: format!("GPU-{gpu}"),
                cores: 100,
                memory_bytes: 10 << 30,
                soft_limit: None,
                tier: Default::default(),
                memory_limit: None,
                whole: true,
                share_id: None,
                mig: Some(PlannedMig {
                    uuid: format!("MIG-{gi}"),
                    gpu_instance: gi,
                    compute_instance: 0,
                    placement: dynamic.then_some(crate::dynamic::Placement {
                        profile: 19,
                        start: 0,
                        size: 1,
                    }),
                }),
            }],
            prepared_at: 0,
        }
    }

    #[test]
    fn a_destroyed_instance_under_a_claim_is_lost_and_unhealthy() {
        let prepared = [claim("a", 0, 5, false), claim("b", 0, 6, false)];
        let now = [Some(vec![mig(6)])];
        let l = lost(&prepared, &now, &DynamicSeen::default());
        assert_eq!(l.len(), 1, "{l:?}");
        assert_eq!(
            (l[0].claim_uid.as_str(), l[0].device.as_str()),
            ("a", "gpu-0-mig-5-0")
        );
        assert!(l[0].describe().contains("MIG-5"), "{}", l[0].describe());
        assert!(l[0].describe().contains("ns/claim-a"));

        let h = devices(
            &prepared,
            &now,
            &DynamicSeen::default(),
            &[GpuHealth::default()],
            &Default::default(),
        );
        let a = &h[&("node-a".to_string(), "gpu-0-mig-5-0".to_string())];
        assert!(!a.healthy && a.message.contains("destroyed"), "{a:?}");
        assert!(h[&("node-a".to_string(), "gpu-0-mig-6-0".to_string())].healthy);
        // The instance is back (the sim, or an operator's undo): healthy.
        let back = [Some(vec![mig(5), mig(6)])];
        assert!(lost(&prepared, &back, &DynamicSeen::default()).is_empty());
    }

    #[test]
    fn leaving_mig_mode_loses_every_static_instance() {
        let prepared = [claim("a", 0, 5, false), claim("d", 1, 3, true)];
        let l = lost(&prepared, &[None, None], &DynamicSeen::default());
        assert_eq!(
            l.iter().map(|l| l.claim_uid.as_str()).collect::<Vec<_>>(),
            ["a"]
        );
        // A GPU the driver does not know says nothing.
        let z = [claim("z", 7, 1, false)];
        assert!(lost(&z, &[None], &DynamicSeen::default()).is_empty());
    }

    #[test]
    fn a_dynamic_instance_is_judged_only_by_a_read_its_claim_was_prepared_at() {
        let prepared = [claim("d", 1, 3, true), claim("e", 1, 4, true)];
        let seen = |claims: &[&str], uuids: &[&str]| DynamicSeen {
            claims: claims.iter().map(|c| c.to_string()).collect(),
            instances: BTreeMap::from([(1, uuids.iter().map(|u| u.to_string()).collect())]),
        };
        // d's instance gone at a read d was prepared at: lost. e was
        // prepared after that read (its instance not in it): not judged.
        let l = lost(&prepared, &[], &seen(&["d"], &[]));
        assert_eq!(
            l.iter().map(|l| l.claim_uid.as_str()).collect::<Vec<_>>(),
            ["d"]
        );
        assert!(lost(&prepared, &[], &seen(&["d", "e"], &["MIG-3", "MIG-4"])).is_empty());
        // A GPU the read did not cover says nothing.
        let other = DynamicSeen {
            claims: ["d".to_string()].into(),
            instances: BTreeMap::new(),
        };
        assert!(lost(&prepared, &[], &other).is_empty());
        let h = devices(&prepared, &[], &seen(&["d"], &[]), &[], &Default::default());
        assert!(!h[&("node-a".to_string(), "gpu-1-mig-3-0".to_string())].healthy);
        assert!(h[&("node-a".to_string(), "gpu-1-mig-4-0".to_string())].healthy);
    }

    #[test]
    fn gpu_and_instance_xids_make_the_devices_unhealthy() {
        let prepared = [claim("a", 0, 5, false), claim("b", 0, 6, false)];
        let now = [Some(vec![mig(5), mig(6)])];
        let xids = InstanceXids::from([((0, 6), 43)]);
        let none = DynamicSeen::default();
        let h = devices(&prepared, &now, &none, &[GpuHealth::default()], &xids);
        let b = &h[&("node-a".to_string(), "gpu-0-mig-6-0".to_string())];
        assert!(!b.healthy && b.message.contains("Xid 43"), "{b:?}");
        assert!(h[&("node-a".to_string(), "gpu-0-mig-5-0".to_string())].healthy);
        let sick = GpuHealth {
            healthy: false,
            message: "critical Xid 79".into(),
        };
        let h = devices(
            &prepared,
            &now,
            &none,
            std::slice::from_ref(&sick),
            &Default::default(),
        );
        assert!(h.values().all(|d| *d == sick), "{h:?}");
    }
}
