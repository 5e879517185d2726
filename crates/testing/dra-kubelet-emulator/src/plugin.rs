//! Registration and the DRAPlugin calls, as the kubelet makes them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dra_api::dra::{v1, v1beta1};
use dra_api::pluginregistration as reg;
use tonic::transport::Channel;

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("no registration socket appeared in {dir} within {secs} s")]
    NoSocket { dir: String, secs: u64 },
    #[error("connecting {path}: {message}")]
    Connect { path: String, message: String },
    #[error("{call} on {path}: {status}")]
    Rpc {
        call: &'static str,
        path: String,
        status: Box<tonic::Status>,
    },
    #[error("plugin {name:?} refused: {problem}")]
    Refused { name: String, problem: String },
}

/// Which DRAPlugin service the driver was registered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V1beta1,
}

/// A registered DRA plugin.
#[derive(Debug, Clone)]
pub struct DraPlugin {
    pub name: String,
    pub endpoint: PathBuf,
    pub version: Version,
    /// The health service a 1.37 kubelet would open (the newest listed in
    /// the registration that it knows), if any.
    pub health_service: Option<&'static str>,
    channel: Channel,
}

/// A channel over the unix socket `path`; `:authority` is `localhost`, as
/// grpc-go (the kubelet) sends on unix sockets.
async fn connect(path: &Path) -> Result<Channel, PluginError> {
    let p = path.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let p = p.clone();
        async move {
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                tokio::net::UnixStream::connect(p).await?,
            ))
        }
    });
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(connector)
        .await
        .map_err(|e| PluginError::Connect {
            path: path.display().to_string(),
            message: e.to_string(),
        })
}

/// The `.sock` files in `dir`, sorted.
pub fn sockets(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "sock"))
        .collect();
    v.sort();
    v
}

/// Registers the plugin behind `socket` the way the kubelet's plugin
/// manager does: GetInfo; the type must be DRAPlugin and a supported
/// version v1.DRAPlugin or v1beta1.DRAPlugin (v1 preferred, or only
/// v1beta1 when `prefer_v1beta1`, like a pre-1.34 kubelet); the endpoint
/// must answer; then NotifyRegistrationStatus.
pub async fn register(socket: &Path, prefer_v1beta1: bool) -> Result<DraPlugin, PluginError> {
    let path = socket.display().to_string();
    let ch = connect(socket).await?;
    let mut c = reg::registration_client::RegistrationClient::new(ch);
    let info = c
        .get_info(reg::InfoRequest {})
        .await
        .map_err(|status| PluginError::Rpc {
            call: "GetInfo",
            path: path.clone(),
            status: Box::new(status),
        })?
        .into_inner();
    let has = |s: &str| info.supported_versions.iter().any(|v| v == s);
    // kubelet 1.37's pickHealthService: the first of its own list (newest
    // first) that the plugin lists (pkg/kubelet/cm/dra/plugin).
    let health_service = [
        dra_api::dra_health::v1::SERVICE,
        dra_api::dra_health::v1alpha1::SERVICE,
    ]
    .into_iter()
    .find(|s| has(s));
    let version = if has(v1::SERVICE) && !prefer_v1beta1 {
        Some(Version::V1)
    } else if has(v1beta1::SERVICE) {
        Some(Version::V1beta1)
    } else {
        None
    };
    let problem = if info.r#type != reg::DRA_PLUGIN {
        Some(format!("type {:?} is not {}", info.r#type, reg::DRA_PLUGIN))
    } else if version.is_none() {
        Some(format!(
            "no supported DRAPlugin service in {:?}",
            info.supported_versions
        ))
    } else if info.name.is_empty() || !Path::new(&info.endpoint).is_absolute() {
        Some(format!(
            "name {:?} / endpoint {:?} unusable",
            info.name, info.endpoint
        ))
    } else {
        None
    };
    let endpoint = PathBuf::from(&info.endpoint);
    let channel = match &problem {
        None => match connect(&endpoint).await {
            Ok(ch) => Some(ch),
            Err(e) => {
                notify(&mut c, &path, false, e.to_string()).await?;
                return Err(e);
            }
        },
        Some(_) => None,
    };
    match (problem, channel, version) {
        (None, Some(channel), Some(version)) => {
            notify(&mut c, &path, true, String::new()).await?;
            Ok(DraPlugin {
                name: info.name,
                endpoint,
                version,
                health_service,
                channel,
            })
        }
        (p, _, _) => {
            let problem = p.unwrap_or_default();
            notify(&mut c, &path, false, problem.clone()).await?;
            Err(PluginError::Refused {
                name: info.name,
                problem,
            })
        }
    }
}

async fn notify(
    c: &mut reg::registration_client::RegistrationClient<Channel>,
    path: &str,
    ok: bool,
    error: String,
) -> Result<(), PluginError> {
    c.notify_registration_status(reg::RegistrationStatus {
        plugin_registered: ok,
        error,
    })
    .await
    .map(|_| ())
    .map_err(|status| PluginError::Rpc {
        call: "NotifyRegistrationStatus",
        path: path.to_string(),
        status: Box::new(status),
    })
}

/// Polls `dir` until a registration socket answers, then registers it.
pub async fn wait_and_register(
    dir: &Path,
    timeout: Duration,
    prefer_v1beta1: bool,
) -> Result<DraPlugin, PluginError> {
    let t0 = Instant::now();
    loop {
        for s in sockets(dir) {
            if let Ok(p) = register(&s, prefer_v1beta1).await {
                return Ok(p);
            }
        }
        if t0.elapsed() > timeout {
            return Err(PluginError::NoSocket {
                dir: dir.display().to_string(),
                secs: timeout.as_secs(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A claim as the kubelet names it to the driver.
impl DraPlugin {
    /// The plugin's health stream (`v1alpha1.DRAResourceHealth`), opened
    /// as kubelets 1.31-1.36 with `ResourceHealthStatus` open it on the
    /// plugin socket (unasked).
    pub async fn watch_health(
        &self,
    ) -> Result<
        tonic::Streaming<dra_api::dra_health::v1alpha1::NodeWatchResourcesResponse>,
        tonic::Status,
    > {
        use dra_api::dra_health::v1alpha1 as h;
        h::dra_resource_health_client::DraResourceHealthClient::new(self.channel.clone())
            .node_watch_resources(h::NodeWatchResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
    }

    /// The v1 health stream, as a 1.37 kubelet opens it once the
    /// registration listed `v1.DRAResourceHealth`.
    pub async fn watch_health_v1(
        &self,
    ) -> Result<tonic::Streaming<dra_api::dra_health::v1::NodeWatchResourcesResponse>, tonic::Status>
    {
        use dra_api::dra_health::v1 as h;
        h::dra_resource_health_client::DraResourceHealthClient::new(self.channel.clone())
            .node_watch_resources(h::NodeWatchResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
    }
}

/// The next (health, message) of device `device` of pool `pool` on a
/// `v1alpha1` health stream, skipping messages that do not name it;
/// panics after 30 s without one.
pub async fn next_device_health(
    stream: &mut tonic::Streaming<dra_api::dra_health::v1alpha1::NodeWatchResourcesResponse>,
    pool: &str,
    device: &str,
) -> (i32, String) {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("a health message within 30 s")
            .unwrap()
            .unwrap();
        let d = m.devices.iter().find(|d| {
            d.device
                .as_ref()
                .is_some_and(|i| i.device_name == device && i.pool_name == pool)
        });
        if let Some(d) = d {
            return (d.health, d.message.clone());
        }
    }
}

pub fn claim(namespace: &str, name: &str, uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: namespace.into(),
        uid: uid.into(),
        name: name.into(),
    }
}

fn beta(c: &v1::Claim) -> v1beta1::Claim {
    v1beta1::Claim {
        namespace: c.namespace.clone(),
        uid: c.uid.clone(),
        name: c.name.clone(),
    }
}

impl DraPlugin {
    fn rpc(&self, call: &'static str) -> impl FnOnce(tonic::Status) -> PluginError + '_ {
        move |status| PluginError::Rpc {
            call,
            path: self.endpoint.display().to_string(),
            status: Box::new(status),
        }
    }

    /// NodePrepareResources in the registered version, answered as v1.
    pub async fn prepare(
        &self,
        claims: &[v1::Claim],
    ) -> Result<v1::NodePrepareResourcesResponse, PluginError> {
        match self.version {
            Version::V1 => {
                let mut c = v1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let req = v1::NodePrepareResourcesRequest {
                    claims: claims.to_vec(),
                };
                Ok(c.node_prepare_resources(req)
                    .await
                    .map_err(self.rpc("NodePrepareResources"))?
                    .into_inner())
            }
            Version::V1beta1 => {
                let mut c = v1beta1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let req = v1beta1::NodePrepareResourcesRequest {
                    claims: claims.iter().map(beta).collect(),
                };
                let r = c
                    .node_prepare_resources(req)
                    .await
                    .map_err(self.rpc("NodePrepareResources"))?
                    .into_inner();
                Ok(v1::NodePrepareResourcesResponse {
                    claims: r
                        .claims
                        .into_iter()
                        .map(|(k, v)| {
                            let devices = v
                                .devices
                                .into_iter()
                                .map(|d| v1::Device {
                                    request_names: d.request_names,
                                    pool_name: d.pool_name,
                                    device_name: d.device_name,
                                    cdi_device_ids: d.cdi_device_ids,
                                    share_id: None,
                                })
                                .collect();
                            (
                                k,
                                v1::NodePrepareResourceResponse {
                                    devices,
                                    error: v.error,
                                },
                            )
                        })
                        .collect(),
                })
            }
        }
    }

    /// NodeUnprepareResources in the registered version, answered as v1.
    pub async fn unprepare(
        &self,
        claims: &[v1::Claim],
    ) -> Result<v1::NodeUnprepareResourcesResponse, PluginError> {
        match self.version {
            Version::V1 => {
                let mut c = v1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let req = v1::NodeUnprepareResourcesRequest {
                    claims: claims.to_vec(),
                };
                Ok(c.node_unprepare_resources(req)
                    .await
                    .map_err(self.rpc("NodeUnprepareResources"))?
                    .into_inner())
            }
            Version::V1beta1 => {
                let mut c = v1beta1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let req = v1beta1::NodeUnprepareResourcesRequest {
                    claims: claims.iter().map(beta).collect(),
                };
                let r = c
                    .node_unprepare_resources(req)
                    .await
                    .map_err(self.rpc("NodeUnprepareResources"))?
                    .into_inner();
                Ok(v1::NodeUnprepareResourcesResponse {
                    claims: r
                        .claims
                        .into_iter()
                        .map(|(k, v)| (k, v1::NodeUnprepareResourceResponse { error: v.error }))
                        .collect(),
                })
            }
        }
    }
}
