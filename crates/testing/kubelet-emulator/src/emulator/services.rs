//! The two gRPC servers kubelet runs: `Registration` (device plugins
//! register here) and pod-resources `v1` (what the manager reads back).

use super::*;

impl KubeletEmulator {
    pub(super) fn pod_resources(&self) -> Vec<pr::PodResources> {
        let st = self.inner.state.lock().unwrap();
        // Like kubelet's List (active pods): every pod being admitted or
        // admitted, devices or not; a refused one is no longer listed.
        let mut pods: BTreeMap<&str, BTreeMap<&str, Vec<pr::ContainerDevices>>> = st
            .pods
            .keys()
            .map(|uid| (uid.as_str(), BTreeMap::new()))
            .collect();
        for e in &st.entries {
            let numa: Vec<pr::NumaNode> = e
                .device_ids
                .keys()
                .filter(|n| **n >= 0)
                .map(|&id| pr::NumaNode { id })
                .collect();
            pods.entry(&e.pod_uid)
                .or_default()
                .entry(&e.container_name)
                .or_default()
                .push(pr::ContainerDevices {
                    resource_name: e.resource_name.clone(),
                    device_ids: e.device_ids.values().flatten().cloned().collect(),
                    topology: (!numa.is_empty()).then_some(pr::TopologyInfo { nodes: numa }),
                });
        }
        pods.into_iter()
            .map(|(uid, containers)| {
                let meta = st.pods.get(uid);
                pr::PodResources {
                    name: meta.map_or_else(|| uid.to_string(), |p| p.name.clone()),
                    namespace: meta.map_or_else(String::new, |p| p.namespace.clone()),
                    containers: containers
                        .into_iter()
                        .map(|(name, devices)| pr::ContainerResources {
                            name: name.to_string(),
                            devices,
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }
            })
            .collect()
    }
}

pub(super) struct RegistrationSvc {
    pub(super) emu: KubeletEmulator,
    pub(super) cancel: CancellationToken,
}

#[tonic::async_trait]
impl Registration for RegistrationSvc {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = req.into_inner();
        if req.version != VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported device plugin API version {:?}; this kubelet supports {VERSION}",
                req.version
            )));
        }
        let parts: Vec<&str> = req.resource_name.split('/').collect();
        if parts.len() != 2
            || parts.iter().any(|p| p.is_empty())
            || parts[0].ends_with("kubernetes.io")
        {
            return Err(Status::invalid_argument(format!(
                "invalid extended resource name {:?}",
                req.resource_name
            )));
        }
        if req.endpoint.is_empty() || req.endpoint.contains('/') {
            return Err(Status::invalid_argument(format!(
                "invalid endpoint {:?}",
                req.endpoint
            )));
        }
        tracing::info!(resource = %req.resource_name, endpoint = %req.endpoint, "Register");
        // kubelet dials back asynchronously, after answering.
        tokio::spawn(self.emu.clone().connect_plugin(req, self.cancel.clone()));
        Ok(Response::new(Empty {}))
    }
}

pub(super) struct PodResourcesSvc {
    pub(super) emu: KubeletEmulator,
}

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for PodResourcesSvc {
    async fn list(
        &self,
        _req: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: self.emu.pod_resources(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _req: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        let view = self.emu.inner.view.borrow().clone();
        let devices = view
            .resources
            .iter()
            .flat_map(|(res, r)| {
                r.devices
                    .iter()
                    .filter(|(_, d)| d.healthy)
                    .map(move |(id, d)| pr::ContainerDevices {
                        resource_name: res.clone(),
                        device_ids: vec![id.clone()],
                        topology: (!d.numa.is_empty()).then(|| pr::TopologyInfo {
                            nodes: d.numa.iter().map(|&id| pr::NumaNode { id }).collect(),
                        }),
                    })
            })
            .collect();
        Ok(Response::new(pr::AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        req: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        let req = req.into_inner();
        let uid = {
            let st = self.emu.inner.state.lock().unwrap();
            st.pods
                .values()
                .find(|p| p.name == req.pod_name && p.namespace == req.pod_namespace)
                .map(|p| p.uid.clone())
        };
        let Some(uid) = uid else {
            return Err(Status::not_found(format!(
                "pod {}/{} not found",
                req.pod_namespace, req.pod_name
            )));
        };
        let name = self
            .emu
            .inner
            .state
            .lock()
            .unwrap()
            .pods
            .get(&uid)
            .map(|p| p.name.clone());
        let pod = self
            .emu
            .pod_resources()
            .into_iter()
            .find(|p| Some(&p.name) == name.as_ref())
            .unwrap_or(pr::PodResources {
                name: req.pod_name,
                namespace: req.pod_namespace,
                ..Default::default()
            });
        Ok(Response::new(pr::GetPodResourcesResponse {
            pod_resources: Some(pod),
        }))
    }
}
