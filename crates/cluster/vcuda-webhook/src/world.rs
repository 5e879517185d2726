//! What the webhook reads and writes in the cluster, one trait each, so
//! the decisions run against in-memory doubles in tests: the vcuda nodes'
//! GPUs (their published inventories) and the claim templates a DRA
//! rewrite needs.

use k8s_openapi::api::resource::v1::ResourceClaimTemplate;

use crate::validate::NodeGpus;

pub trait Nodes: Send + Sync {
    /// Whether the node list has been read once.
    fn ready(&self) -> bool;
    /// The vcuda nodes whose inventory reads.
    fn gpus(&self) -> Vec<NodeGpus>;
}

#[derive(Debug, thiserror::Error)]
#[error("creating ResourceClaimTemplate {namespace}/{name}: {problem}")]
pub struct TemplateError {
    pub namespace: String,
    pub name: String,
    pub problem: String,
}

#[async_trait::async_trait]
pub trait Templates: Send + Sync {
    /// Creates `t` unless a template of that name exists.
    async fn ensure(&self, t: &ResourceClaimTemplate) -> Result<(), TemplateError>;
}

/// In-memory doubles.
#[cfg(test)]
pub mod doubles {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    pub struct MemoryNodes(pub Mutex<Vec<NodeGpus>>);

    impl Nodes for MemoryNodes {
        fn ready(&self) -> bool {
            true
        }
        fn gpus(&self) -> Vec<NodeGpus> {
            self.0.lock().unwrap().clone()
        }
    }

    /// Templates created, by name; `fail` makes every create fail.
    #[derive(Default)]
    pub struct MemoryTemplates {
        pub created: Mutex<Vec<ResourceClaimTemplate>>,
        pub fail: Mutex<Option<String>>,
    }

    #[async_trait::async_trait]
    impl Templates for MemoryTemplates {
        async fn ensure(&self, t: &ResourceClaimTemplate) -> Result<(), TemplateError> {
            if let Some(problem) = self.fail.lock().unwrap().clone() {
                return Err(TemplateError {
                    namespace: t.metadata.namespace.clone().unwrap_or_default(),
                    name: t.metadata.name.clone().unwrap_or_default(),
                    problem,
                });
            }
            let mut c = self.created.lock().unwrap();
            if !c.iter().any(|x| x.metadata == t.metadata) {
                c.push(t.clone());
            }
            Ok(())
        }
    }
}
