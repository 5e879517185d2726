//! The kubelet plugin: `DRAPlugin` v1 and v1beta1 and the health stream
//! ([`crate::health`]) on the plugin socket, and
//! `pluginregistration.Registration` on a socket in the kubelet's
//! `plugins_registry` directory (the kubelet finds it there, asks GetInfo,
//! connects to the plugin socket). Both sockets accept any `:authority`
//! (kubelets send socket paths) through [`uds_authority::incoming`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;

use dra_api::dra::{v1, v1beta1};
use dra_api::dra_health::{v1 as health_v1, v1alpha1 as health_v1alpha1};
use dra_api::pluginregistration as reg;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::DRIVER_NAME;
use crate::driver::{ClaimRef, Driver};

/// What the registration says the plugin socket serves, newest first.
pub const SUPPORTED_SERVICES: [&str; 4] = [
    v1::SERVICE,
    v1beta1::SERVICE,
    health_v1::SERVICE,
    health_v1alpha1::SERVICE,
];

/// What the kubelet last said about registration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistrationState {
    pub registered: bool,
    pub error: String,
    pub notifications: u64,
}

#[derive(Clone)]
pub struct Plugin {
    driver: Arc<Driver>,
}

impl Plugin {
    pub fn new(driver: Arc<Driver>) -> Plugin {
        Plugin { driver }
    }

    async fn prepare(
        &self,
        claims: Vec<v1::Claim>,
    ) -> HashMap<String, v1::NodePrepareResourceResponse> {
        let mut out = HashMap::new();
        for (uid, r) in refs(claims) {
            let resp = match self.driver.prepare(&r).await {
                Ok(devs) => v1::NodePrepareResourceResponse {
                    devices: devs
                        .into_iter()
                        .map(|d| v1::Device {
                            request_names: vec![d.planned.request],
                            pool_name: d.planned.pool,
                            device_name: d.planned.device,
                            cdi_device_ids: vec![d.cdi_id],
                            share_id: d.planned.share_id,
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "NodePrepareResources");
                    v1::NodePrepareResourceResponse {
                        devices: vec![],
                        error: e.to_string(),
                    }
                }
            };
            out.insert(uid, resp);
        }
        out
    }

    async fn unprepare(
        &self,
        claims: Vec<v1::Claim>,
    ) -> HashMap<String, v1::NodeUnprepareResourceResponse> {
        let mut out = HashMap::new();
        for (uid, r) in refs(claims) {
            let error = match self.driver.unprepare(&r).await {
                Ok(()) => String::new(),
                Err(e) => e.to_string(),
            };
            out.insert(uid, v1::NodeUnprepareResourceResponse { error });
        }
        out
    }
}

/// Each claim's UID and reference.
fn refs(claims: Vec<v1::Claim>) -> impl Iterator<Item = (String, ClaimRef)> {
    claims.into_iter().map(|c| {
        let r = ClaimRef {
            namespace: c.namespace,
            uid: c.uid.clone(),
            name: c.name,
        };
        (c.uid, r)
    })
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        req: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims = self.prepare(req.into_inner().claims).await;
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let claims = self.unprepare(req.into_inner().claims).await;
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

fn claim_v1(c: v1beta1::Claim) -> v1::Claim {
    v1::Claim {
        namespace: c.namespace,
        uid: c.uid,
        name: c.name,
    }
}

/// The same service for kubelets that ask for v1beta1 (no share IDs there).
#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        req: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = req.into_inner().claims.into_iter().map(claim_v1).collect();
        let claims = self
            .prepare(claims)
            .await
            .into_iter()
            .map(|(k, r)| {
                let devices = r
                    .devices
                    .into_iter()
                    .map(|d| v1beta1::Device {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect();
                (
                    k,
                    v1beta1::NodePrepareResourceResponse {
                        devices,
                        error: r.error,
                    },
                )
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let claims = req.into_inner().claims.into_iter().map(claim_v1).collect();
        let claims = self
            .unprepare(claims)
            .await
            .into_iter()
            .map(|(k, r)| (k, v1beta1::NodeUnprepareResourceResponse { error: r.error }))
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

pub struct RegistrationService {
    endpoint: PathBuf,
    state: Arc<Mutex<RegistrationState>>,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: reg::DRA_PLUGIN.to_string(),
            name: DRIVER_NAME.to_string(),
            endpoint: self.endpoint.display().to_string(),
            // The kubelet takes the first DRAPlugin it knows, and (1.37)
            // the newest health service listed: without one it opens no
            // health stream and the pods' devices stay Unknown.
            supported_versions: SUPPORTED_SERVICES.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let r = req.into_inner();
        if r.plugin_registered {
            tracing::info!("registered with the kubelet");
        } else {
            tracing::error!(error = %r.error, "the kubelet refused the registration");
        }
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.registered = r.plugin_registered;
        st.error = r.error;
        st.notifications += 1;
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// The two sockets of one driver instance. Each process start names its
/// own (see [`Sockets::new`]): the kubelet keys plugins by endpoint, and a
/// restarted driver that binds the old paths again has its registration
/// undone by the kubelet's late removal of the old one ("DRA driver ... is
/// not registered" while the driver logs it registered). A new instance
/// registers beside the old one and then removes the old one's files
/// ([`Sockets::remove_older`]); the kubelet prefers the newest connected.
#[derive(Debug, Clone)]
pub struct Sockets {
    /// `<plugins>/vcuda.tencent.com/dra-<instance>.sock`.
    pub plugin: PathBuf,
    /// `<plugins_registry>/vcuda.tencent.com-<instance>-reg.sock`.
    pub registration: PathBuf,
}

const PLUGIN_PREFIX: &str = "dra";
const PLUGIN_SUFFIX: &str = ".sock";

impl Sockets {
    /// A new instance's sockets.
    pub fn new(plugins_dir: &Path, registry_dir: &Path) -> Sockets {
        Sockets::for_instance(plugins_dir, registry_dir, &node_agent::mode::instance_id())
    }

    pub fn for_instance(plugins_dir: &Path, registry_dir: &Path, instance: &str) -> Sockets {
        Sockets {
            plugin: plugins_dir
                .join(DRIVER_NAME)
                .join(format!("{PLUGIN_PREFIX}-{instance}{PLUGIN_SUFFIX}")),
            registration: registry_dir.join(node_agent::mode::dra_registration_socket(instance)),
        }
    }

    /// The instance these sockets are named for.
    pub fn instance(&self) -> Option<String> {
        let n = self.plugin.file_name()?.to_str()?;
        let i = n.strip_prefix(PLUGIN_PREFIX)?.strip_prefix('-')?;
        Some(i.strip_suffix(PLUGIN_SUFFIX)?.to_string())
    }

    /// Other instances' socket files no newer than this one's: a killed
    /// driver's (the kubelet keeps its endpoint until the registration file
    /// goes) or the one a rolling update replaces. Called once the kubelet
    /// has registered this instance, so the driver is never unregistered.
    /// Returns what was removed.
    pub fn remove_older(&self) -> Vec<PathBuf> {
        let mine = |p: &Path| std::fs::symlink_metadata(p).and_then(|m| m.modified()).ok();
        let mut removed = Vec::new();
        let reg_dir = self.registration.parent().unwrap_or(Path::new("/"));
        let plugin_dir = self.plugin.parent().unwrap_or(Path::new("/"));
        let candidates = node_agent::mode::dra_registration_sockets(reg_dir)
            .into_iter()
            .map(|p| (p, self.registration.as_path()))
            .chain(plugin_sockets(plugin_dir).map(|p| (p, self.plugin.as_path())));
        for (p, own) in candidates {
            if p == own {
                continue;
            }
            let (Some(theirs), Some(ours)) = (mine(&p), mine(own)) else {
                continue;
            };
            if theirs <= ours && std::fs::remove_file(&p).is_ok() {
                removed.push(p);
            }
        }
        removed
    }

    /// This instance's files (a clean stop: the kubelet unregisters it at
    /// once instead of calling a closed socket).
    pub fn remove_own(&self) {
        for p in [&self.registration, &self.plugin] {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// `dra*.sock` in the driver's plugin directory (`dra.sock` is the name
/// before instances named theirs).
fn plugin_sockets(dir: &Path) -> impl Iterator<Item = PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with(PLUGIN_PREFIX) && n.ends_with(PLUGIN_SUFFIX)
        })
        .map(|e| e.path())
}

/// Binds `path` (its directory created). The name is this instance's: a
/// file there is a leftover of nothing that can still answer.
pub fn bind_std(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::net::UnixListener::bind(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("binding {}: {e}", path.display())))
}

fn bind(path: &Path) -> std::io::Result<UnixListener> {
    let l = bind_std(path)?;
    l.set_nonblocking(true)?;
    UnixListener::from_std(l)
}

/// Serves the plugin socket first, then the registration socket (so the
/// kubelet never finds an endpoint that is not listening), until `cancel`.
/// Returns the registration state the kubelet's notifications update.
pub async fn serve(
    driver: Arc<Driver>,
    sockets: &Sockets,
    cancel: CancellationToken,
) -> std::io::Result<Arc<Mutex<RegistrationState>>> {
    serve_on(driver, sockets, None, cancel).await
}

type Incoming = std::pin::Pin<
    Box<
        dyn futures::Stream<Item = std::io::Result<uds_authority::Fixed<tokio::net::UnixStream>>>
            + Send,
    >,
>;

/// [`serve`] as a supervisor's child: `(inbox, registration)`, the inbox
/// its supervisor passes the plugin socket's connections over
/// ([`crate::relay`]) and the registration socket's listener, bound to
/// `sockets`. `None`: bind both.
pub async fn serve_on(
    driver: Arc<Driver>,
    sockets: &Sockets,
    inherited: Option<(
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixListener,
    )>,
    cancel: CancellationToken,
) -> std::io::Result<Arc<Mutex<RegistrationState>>> {
    use futures::StreamExt;
    let plugin = Plugin::new(driver);
    let (incoming, reg_l): (Incoming, _) = match inherited {
        Some((inbox, r)) => (
            crate::relay::incoming(inbox).boxed(),
            Some(UnixListener::from_std(r)?),
        ),
        None => (
            uds_authority::incoming(bind(&sockets.plugin)?).boxed(),
            None,
        ),
    };
    let c = cancel.clone();
    let p = plugin.clone();
    tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(p.clone()))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(p.clone()))
            .add_service(
                health_v1::dra_resource_health_server::DraResourceHealthServer::new(
                    crate::health::HealthService {
                        driver: p.driver.clone(),
                    },
                ),
            )
            .add_service(
                health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                    crate::health::HealthService { driver: p.driver },
                ),
            )
            .serve_with_incoming_shutdown(incoming, c.cancelled_owned())
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "DRA plugin socket");
        }
    });
    let state = Arc::new(Mutex::new(RegistrationState::default()));
    let svc = RegistrationService {
        endpoint: sockets.plugin.clone(),
        state: state.clone(),
    };
    let l = match reg_l {
        Some(l) => l,
        None => bind(&sockets.registration)?,
    };
    let own = sockets.clone();
    tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            .add_service(reg::registration_server::RegistrationServer::new(svc))
            .serve_with_incoming_shutdown(uds_authority::incoming(l), cancel.cancelled_owned())
            .await;
        // The names are this instance's alone: nothing else can race for
        // them, and a newer instance is already registered if there is one.
        own.remove_own();
        if let Err(e) = r {
            tracing::error!(error = %e, "registration socket");
        }
    });
    Ok(state)
}
