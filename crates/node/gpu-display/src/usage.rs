//! Attribution of the sampler's per-process figures to containers, and the
//! `PrintUsages` / `/usage` answer built from it.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use vcuda_api::display::{ContainerStat, DeviceInfo, Devices, Spec, UsageResponse};

use crate::sampler::Snapshot;
use crate::source::{ContainerView, GpuRef};

const MIB: f64 = 1024.0 * 1024.0;

/// One container's use of one of its GPUs over the sampler's last window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuUse {
    pub gpu: GpuRef,
    /// Sum over the container's host PIDs, percent of the GPU.
    pub utilization_percent: f64,
    pub memory_used_bytes: u64,
    /// The container's PIDs seen on this GPU.
    pub pids: Vec<u32>,
    pub device_memory_bytes: u64,
}

/// Sums the snapshot's per-process figures over the container's host PIDs,
/// per GPU it holds.
pub fn container_use(c: &ContainerView, snap: &Snapshot) -> Vec<GpuUse> {
    c.gpus
        .iter()
        .map(|g| {
            // The index is the key; the UUID guards against a renumbering
            // (a GPU that fell off the bus) between manager and sampler.
            let s = snap
                .gpu(g.index)
                .filter(|s| g.uuid.is_empty() || s.uuid.is_empty() || s.uuid == g.uuid)
                .or_else(|| {
                    snap.gpus
                        .iter()
                        .find(|s| !g.uuid.is_empty() && s.uuid == g.uuid)
                });
            let mut u = GpuUse {
                gpu: g.clone(),
                utilization_percent: 0.0,
                memory_used_bytes: 0,
                pids: Vec::new(),
                device_memory_bytes: s.map(|s| s.memory_total_bytes).unwrap_or(0),
            };
            if let Some(s) = s {
                let mut add = |pid: u32, p: &crate::sampler::ProcSample| {
                    u.utilization_percent += p.utilization_percent;
                    u.memory_used_bytes += p.memory_used_bytes;
                    u.pids.push(pid);
                };
                if c.exclusive {
                    // Nobody else may run there: all its processes are ours.
                    for (&pid, p) in &s.processes {
                        add(pid, p);
                    }
                } else {
                    for pid in &c.host_pids {
                        if let Some(p) = s.processes.get(pid) {
                            add(*pid, p);
                        }
                    }
                }
                u.pids.sort_unstable();
            }
            u.utilization_percent = u.utilization_percent.min(100.0);
            u
        })
        .collect()
}

/// The display API's usage answer: pod UID -> containers -> devices.
pub fn usage_response(containers: &[ContainerView], snap: &Snapshot) -> UsageResponse {
    let mut usage: HashMap<String, ContainerStat> = HashMap::new();
    for c in containers {
        let stat = usage
            .entry(c.pod_uid.clone())
            .or_insert_with(|| ContainerStat {
                project: c.namespace.clone(),
                pod_name: c.pod_name.clone(),
                namespace: c.namespace.clone(),
                user: c.user.clone(),
                cluster: c.cluster.clone(),
                ..Default::default()
            });
        let dev = container_use(c, snap)
            .into_iter()
            .map(|u| DeviceInfo {
                id: u.gpu.bus_id.clone(),
                card_idx: u.gpu.index.to_string(),
                gpu: u.utilization_percent as f32,
                mem: (u.memory_used_bytes as f64 / MIB) as f32,
                pids: u.pids.iter().map(|&p| p as i32).collect(),
                device_mem: (u.device_memory_bytes as f64 / MIB) as f32,
            })
            .collect();
        stat.stat.insert(c.container.clone(), Devices { dev });
        stat.spec.insert(
            c.container.clone(),
            Spec {
                gpu: c.core_quota as f32,
                mem: (c.memory_quota_bytes as f64 / MIB) as f32,
            },
        );
    }
    UsageResponse { usage }
}

/// `/usage` as JSON: the same content as `PrintUsages`, with the proto's
/// field names (what grpc-gateway printed with `OrigName`).
#[derive(Debug, Serialize)]
pub struct UsageJson {
    pub usage: BTreeMap<String, PodJson>,
}

#[derive(Debug, Serialize)]
pub struct PodJson {
    pub pod_name: String,
    pub namespace: String,
    pub project: String,
    pub user: String,
    pub cluster: String,
    pub stat: BTreeMap<String, DevicesJson>,
    pub spec: BTreeMap<String, SpecJson>,
}

#[derive(Debug, Serialize)]
pub struct DevicesJson {
    pub dev: Vec<DeviceJson>,
}

#[derive(Debug, Serialize)]
pub struct DeviceJson {
    pub id: String,
    pub card_idx: String,
    pub uuid: String,
    pub gpu: f64,
    pub mem: f64,
    pub pids: Vec<u32>,
    pub device_mem: f64,
}

#[derive(Debug, Serialize)]
pub struct SpecJson {
    pub gpu: f64,
    pub mem: f64,
}

pub fn usage_json(containers: &[ContainerView], snap: &Snapshot) -> UsageJson {
    let mut usage: BTreeMap<String, PodJson> = BTreeMap::new();
    for c in containers {
        let pod = usage.entry(c.pod_uid.clone()).or_insert_with(|| PodJson {
            pod_name: c.pod_name.clone(),
            namespace: c.namespace.clone(),
            project: c.namespace.clone(),
            user: c.user.clone(),
            cluster: c.cluster.clone(),
            stat: BTreeMap::new(),
            spec: BTreeMap::new(),
        });
        let dev = container_use(c, snap)
            .into_iter()
            .map(|u| DeviceJson {
                id: u.gpu.bus_id.clone(),
                card_idx: u.gpu.index.to_string(),
                uuid: u.gpu.uuid.clone(),
                gpu: u.utilization_percent,
                mem: u.memory_used_bytes as f64 / MIB,
                pids: u.pids,
                device_mem: u.device_memory_bytes as f64 / MIB,
            })
            .collect();
        pod.stat.insert(c.container.clone(), DevicesJson { dev });
        pod.spec.insert(
            c.container.clone(),
            SpecJson {
                gpu: c.core_quota as f64,
                mem: c.memory_quota_bytes as f64 / MIB,
            },
        );
    }
    UsageJson { usage }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{GpuSample, ProcSample};

    fn snap() -> Snapshot {
        let mut procs = HashMap::new();
        procs.insert(
            100,
            ProcSample {
                utilization_percent: 20.0,
                memory_used_bytes: 256 << 20,
            },
        );
        procs.insert(
            101,
            ProcSample {
                utilization_percent: 15.0,
                memory_used_bytes: 128 << 20,
            },
        );
        procs.insert(
            200,
            ProcSample {
                utilization_percent: 40.0,
                memory_used_bytes: 0,
            },
        );
        Snapshot {
            taken: None,
            gpus: vec![GpuSample {
                index: 0,
                uuid: "GPU-a".into(),
                memory_total_bytes: 40960 << 20,
                processes: procs,
                ..Default::default()
            }],
        }
    }

    fn ctr(name: &str, pids: Vec<u32>) -> ContainerView {
        ContainerView {
            pod_uid: format!("uid-{name}"),
            pod_name: name.into(),
            namespace: "ns".into(),
            container: "main".into(),
            gpus: vec![GpuRef {
                index: 0,
                uuid: "GPU-a".into(),
                bus_id: "00000000:07:00.0".into(),
            }],
            core_quota: 30,
            memory_quota_bytes: 2 << 30,
            host_pids: pids,
            ..Default::default()
        }
    }

    #[test]
    fn sums_over_the_containers_pids_only() {
        let u = container_use(&ctr("a", vec![100, 101, 999]), &snap());
        assert_eq!(u.len(), 1);
        assert!((u[0].utilization_percent - 35.0).abs() < 1e-9);
        assert_eq!(u[0].memory_used_bytes, 384 << 20);
        assert_eq!(u[0].pids, vec![100, 101]);
    }

    #[test]
    fn exclusive_container_owns_every_process_on_its_gpu() {
        let mut c = ctr("a", vec![]);
        c.exclusive = true;
        let u = container_use(&c, &snap());
        assert!((u[0].utilization_percent - 75.0).abs() < 1e-9);
        assert_eq!(u[0].pids, vec![100, 101, 200]);
    }

    #[test]
    fn uuid_mismatch_falls_back_to_uuid_lookup() {
        let mut c = ctr("a", vec![100]);
        c.gpus[0].index = 3;
        assert_eq!(container_use(&c, &snap())[0].utilization_percent, 20.0);
        c.gpus[0].uuid = "GPU-other".into();
        assert_eq!(container_use(&c, &snap())[0].utilization_percent, 0.0);
    }

    #[test]
    fn usage_response_shape() {
        let r = usage_response(&[ctr("a", vec![100]), ctr("b", vec![200])], &snap());
        let a = &r.usage["uid-a"];
        assert_eq!(a.project, "ns");
        assert_eq!((a.pod_name.as_str(), a.namespace.as_str()), ("a", "ns"));
        let d = &a.stat["main"].dev[0];
        assert_eq!(d.card_idx, "0");
        assert_eq!(d.id, "00000000:07:00.0");
        assert_eq!(d.gpu, 20.0);
        assert_eq!(d.mem, 256.0);
        assert_eq!(d.device_mem, 40960.0);
        assert_eq!(a.spec["main"].gpu, 30.0);
        assert_eq!(a.spec["main"].mem, 2048.0);
        assert_eq!(r.usage["uid-b"].stat["main"].dev[0].gpu, 40.0);
    }
}
