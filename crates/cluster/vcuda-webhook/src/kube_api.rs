//! The API server behind [`crate::world`] and [`crate::rotate`]: a
//! reflector over Nodes (their inventory annotation), creates of claim
//! templates, the certificates' Secret and the configurations' caBundle.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpu_allocator::inventory::{ANNOTATION, Inventory};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::rotate::{
    ANNOTATION as CERT_ANNOTATION, BundleTargets, CertStore, RotateError, SecretImage, StoreError,
};
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

/// The Secret of the self-managed certificates.
pub struct KubeCertStore {
    pub api: Api<Secret>,
    pub namespace: String,
    pub name: String,
}

fn store_err(e: kube::Error) -> StoreError {
    match e {
        kube::Error::Api(s) if s.code == 409 => StoreError::Conflict,
        e => StoreError::Api(e.to_string()),
    }
}

#[async_trait::async_trait]
impl CertStore for KubeCertStore {
    fn name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    async fn get(&self) -> Result<Option<(SecretImage, String)>, StoreError> {
        let Some(s) = self.api.get_opt(&self.name).await.map_err(store_err)? else {
            return Ok(None);
        };
        let image = SecretImage {
            data: s
                .data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.0))
                .collect(),
            annotation: s
                .metadata
                .annotations
                .and_then(|mut a| a.remove(CERT_ANNOTATION)),
        };
        Ok(Some((
            image,
            s.metadata.resource_version.unwrap_or_default(),
        )))
    }

    async fn put(&self, image: &SecretImage, version: Option<&str>) -> Result<(), StoreError> {
        let mut s = match version {
            // Keep what others put there (the chart's labels).
            Some(_) => self.api.get(&self.name).await.map_err(store_err)?,
            None => Secret {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    ..Default::default()
                },
                type_: Some("kubernetes.io/tls".into()),
                ..Default::default()
            },
        };
        s.metadata.resource_version = version.map(str::to_string);
        s.metadata.annotations.get_or_insert_default().insert(
            CERT_ANNOTATION.into(),
            image.annotation.clone().unwrap_or_default(),
        );
        s.data = Some(
            image
                .data
                .iter()
                .map(|(k, v)| (k.clone(), ByteString(v.clone())))
                .collect(),
        );
        let r = match version {
            Some(_) => {
                self.api
                    .replace(&self.name, &PostParams::default(), &s)
                    .await
            }
            None => self.api.create(&PostParams::default(), &s).await,
        };
        r.map(|_| ()).map_err(store_err)
    }
}

/// A webhook configuration named on the command line: `validating/NAME`
/// or `mutating/NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigRef {
    Validating(String),
    Mutating(String),
}

impl std::str::FromStr for ConfigRef {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some(("validating", n)) if !n.is_empty() => Ok(ConfigRef::Validating(n.into())),
            Some(("mutating", n)) if !n.is_empty() => Ok(ConfigRef::Mutating(n.into())),
            _ => Err(format!(
                "'{s}' is not validating/NAME or mutating/NAME (a webhook configuration)"
            )),
        }
    }
}

pub struct KubeBundleTargets {
    pub client: Client,
    pub configs: Vec<ConfigRef>,
}

/// Replaces `name` of `api` after `edit` (true: it changed something),
/// again from a fresh read when someone else wrote it between.
async fn edit_bundle<K, F>(
    api: Api<K>,
    kind: &'static str,
    name: &str,
    mut edit: F,
) -> Result<(), RotateError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
    F: FnMut(&mut K) -> bool,
{
    let fail = |problem: String| RotateError::Target {
        kind,
        name: name.to_string(),
        problem,
    };
    for _ in 0..5 {
        let mut obj = api.get(name).await.map_err(|e| fail(e.to_string()))?;
        if !edit(&mut obj) {
            return Ok(());
        }
        match api.replace(name, &PostParams::default(), &obj).await {
            Ok(_) => {
                tracing::info!(kind, name, "caBundle updated");
                return Ok(());
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(fail(e.to_string())),
        }
    }
    Err(fail("changed under each of 5 attempts".into()))
}

/// Sets `bundle` on every webhook's client configuration: whether any
/// changed.
fn set_bundle<'a>(
    configs: impl Iterator<Item = &'a mut WebhookClientConfig>,
    bundle: &[u8],
) -> bool {
    let mut changed = false;
    for c in configs {
        if c.ca_bundle.as_ref().map(|b| b.0.as_slice()) != Some(bundle) {
            c.ca_bundle = Some(ByteString(bundle.to_vec()));
            changed = true;
        }
    }
    changed
}

#[async_trait::async_trait]
impl BundleTargets for KubeBundleTargets {
    async fn set(&self, bundle: &[u8]) -> Result<(), RotateError> {
        for c in &self.configs {
            match c {
                ConfigRef::Validating(name) => {
                    let api = Api::<ValidatingWebhookConfiguration>::all(self.client.clone());
                    edit_bundle(api, "ValidatingWebhookConfiguration", name, |cfg| {
                        let hooks = cfg.webhooks.iter_mut().flatten();
                        set_bundle(hooks.map(|w| &mut w.client_config), bundle)
                    })
                    .await?
                }
                ConfigRef::Mutating(name) => {
                    let api = Api::<MutatingWebhookConfiguration>::all(self.client.clone());
                    edit_bundle(api, "MutatingWebhookConfiguration", name, |cfg| {
                        let hooks = cfg.webhooks.iter_mut().flatten();
                        set_bundle(hooks.map(|w| &mut w.client_config), bundle)
                    })
                    .await?
                }
            }
        }
        Ok(())
    }
}
