//! The API server behind [`crate::world`]: a reflector over Nodes (their
//! inventory annotation) and creates of claim templates.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpu_allocator::inventory::{ANNOTATION, Inventory};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::validate::NodeGpus;
use crate::world::{Nodes, TemplateError, Templates};

pub struct NodeCache {
    store: Store<Node>,
    listed: Arc<AtomicBool>,
}

impl NodeCache {
    pub fn start(client: Client, cancel: CancellationToken) -> NodeCache {
        let listed = Arc::new(AtomicBool::new(false));
        let l = listed.clone();
        let store = daemon_kit::reflect::spawn(
            Api::<Node>::all(client),
            watcher::Config::default(),
            cancel,
            move |ev| {
                if matches!(ev, watcher::Event::InitDone) {
                    l.store(true, Ordering::Relaxed);
                }
            },
            |e| tracing::warn!(error = %e, "node watch failed; retrying"),
        );
        NodeCache { store, listed }
    }
}

impl Nodes for NodeCache {
    fn ready(&self) -> bool {
        self.listed.load(Ordering::Relaxed)
    }

    fn gpus(&self) -> Vec<NodeGpus> {
        self.store
            .state()
            .iter()
            .filter_map(|n| {
                let text = n.annotations().get(ANNOTATION)?;
                let inventory = Inventory::from_json(text).ok()?;
                Some(NodeGpus {
                    name: n.name_any(),
                    inventory,
                })
            })
            .collect()
    }
}

pub struct KubeTemplates {
    pub client: Client,
}

#[async_trait::async_trait]
impl Templates for KubeTemplates {
    async fn ensure(&self, t: &ResourceClaimTemplate) -> Result<(), TemplateError> {
        let ns = t.metadata.namespace.clone().unwrap_or_default();
        let api: Api<ResourceClaimTemplate> = Api::namespaced(self.client.clone(), &ns);
        match api.create(&PostParams::default(), t).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(TemplateError {
                namespace: ns,
                name: t.name_any(),
                problem: e.to_string(),
            }),
        }
    }
}
