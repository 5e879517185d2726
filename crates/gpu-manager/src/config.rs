//! Settings: command-line flags (named as the original gpu-manager's where
//! one exists), their `GPU_MANAGER_*` environment variables, and an optional
//! TOML file (`--config`). Precedence: flag > environment > file > default.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    Parse {
        path: String,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("{field}: {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
}

/// Every setting, all optional so the layers can be merged. The same struct
/// is the TOML file's schema (kebab-case keys, as the flags).
#[derive(Parser, Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
#[command(
    name = "gpu-manager",
    about = "vcuda GPU manager: shares NVIDIA GPUs between Kubernetes pods with per-container quotas",
    version
)]
pub struct Options {
    /// TOML file with any of these settings (keys as the long flags).
    #[arg(long, env = "GPU_MANAGER_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// GPU driver name; only "nvidia" exists.
    #[arg(long, env = "GPU_MANAGER_DRIVER")]
    pub driver: Option<String>,
    /// JSON file of extra devices for every container: {"default": {"devices": ["/dev/..."]}}.
    #[arg(long, env = "GPU_MANAGER_EXTRA_CONFIG")]
    pub extra_config: Option<PathBuf>,
    /// volume.conf of the driver mirror [default: /etc/gpu-manager/volume.conf].
    #[arg(long, env = "GPU_MANAGER_VOLUME_CONFIG")]
    pub volume_config: Option<PathBuf>,
    /// Address of the query (display/metrics) HTTP server [default: 127.0.0.1].
    #[arg(long, env = "GPU_MANAGER_QUERY_ADDR")]
    pub query_addr: Option<String>,
    /// Port of the query HTTP server [default: 5678].
    #[arg(long, env = "GPU_MANAGER_QUERY_PORT")]
    pub query_port: Option<u16>,
    /// Unix socket of the display gRPC service (`vcudactl`) [default: /var/run/gpu-manager.sock].
    #[arg(long, env = "GPU_MANAGER_DISPLAY_SOCKET")]
    pub display_socket: Option<PathBuf>,
    /// kubeconfig; without it, the in-cluster service account (or $KUBECONFIG).
    #[arg(long, env = "GPU_MANAGER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Seconds between GPU process and utilization samples [default: 1].
    #[arg(long, env = "GPU_MANAGER_SAMPLE_PERIOD")]
    pub sample_period: Option<u64>,
    /// Labels to put on this node, "k=v,k2=v2" (plus the GPU model label).
    #[arg(long, env = "GPU_MANAGER_NODE_LABELS")]
    pub node_labels: Option<String>,
    /// Node name instead of the host name.
    #[arg(long, env = "GPU_MANAGER_HOSTNAME_OVERRIDE")]
    pub hostname_override: Option<String>,
    /// Per-container vm directories live here [default: /etc/gpu-manager/vm].
    #[arg(long, env = "GPU_MANAGER_VIRTUAL_MANAGER_PATH")]
    pub virtual_manager_path: Option<PathBuf>,
    /// The mirrored driver volumes (origin/, nvidia/) [default: /etc/gpu-manager/vdriver].
    #[arg(long, env = "GPU_MANAGER_VDRIVER_PATH")]
    pub vdriver_path: Option<PathBuf>,
    /// kubelet's device-plugin directory [default: /var/lib/kubelet/device-plugins].
    #[arg(long, env = "GPU_MANAGER_DEVICE_PLUGIN_PATH")]
    pub device_plugin_path: Option<PathBuf>,
    /// Directory of the manager's allocation checkpoint [default: /etc/gpu-manager/checkpoint].
    #[arg(long, env = "GPU_MANAGER_CHECKPOINT_PATH")]
    pub checkpoint_path: Option<PathBuf>,
    /// Hand out shares of GPUs (vcuda-core 1..99) [default: false].
    #[arg(long, env = "GPU_MANAGER_SHARE_MODE", num_args = 0..=1, default_missing_value = "true")]
    pub share_mode: Option<bool>,
    /// Seconds between checks that pod annotations match the allocations [default: 30].
    #[arg(long, env = "GPU_MANAGER_ALLOCATION_CHECK_PERIOD")]
    pub allocation_check_period: Option<u64>,
    /// Root of the host file system (driver, NVML) [default: /].
    #[arg(long, env = "GPU_MANAGER_HOST_ROOT")]
    pub host_root: Option<PathBuf>,
    /// libnvidia-ml.so.1 to load; relative to --host-root when not absolute
    /// [default: searched in the host root's library directories].
    #[arg(long, env = "GPU_MANAGER_NVML_LIBRARY")]
    pub nvml_library: Option<PathBuf>,
    /// kubelet's pod-resources socket [default: /var/lib/kubelet/pod-resources/kubelet.sock].
    #[arg(long, env = "GPU_MANAGER_POD_RESOURCES_SOCKET")]
    pub pod_resources_socket: Option<PathBuf>,
    /// The interposer library (libvcuda.so) installed as libcuda/libnvidia-ml in the nvidia volume.
    #[arg(long, env = "GPU_MANAGER_INTERPOSER")]
    pub interposer: Option<PathBuf>,
    /// Seconds without a critical Xid after which a GPU is healthy again [default: 300].
    #[arg(long, env = "GPU_MANAGER_XID_QUIET_PERIOD")]
    pub xid_quiet_period: Option<u64>,
    /// Xid codes that are the application's fault and never make a GPU unhealthy
    /// [default: 13,31,43,45,68,109].
    #[arg(long, env = "GPU_MANAGER_IGNORED_XIDS", value_delimiter = ',')]
    pub ignored_xids: Option<Vec<u64>>,
    /// Seconds the first API-server sync of this node's pods may take before
    /// startup goes on without it (degraded) [default: 30].
    #[arg(long, env = "GPU_MANAGER_API_TIMEOUT")]
    pub api_timeout: Option<u64>,
    /// Container runtime reconciled with at start and in the periodic check:
    /// "auto" (containerd's socket if it exists, else CRI-O's, else
    /// Docker's, else none), "containerd", "cri-o", "docker", or "none"
    /// [default: auto]. Given twice, the last wins.
    #[arg(
        long,
        env = "GPU_MANAGER_CONTAINER_RUNTIME",
        overrides_with = "container_runtime"
    )]
    pub container_runtime: Option<String>,
    /// The runtime's socket [default: the runtime's own:
    /// unix:///run/containerd/containerd.sock, unix:///var/run/crio/crio.sock,
    /// unix:///var/run/docker.sock]. With "auto", an endpoint that answers
    /// CRI is a CRI runtime, any other is Docker. Given twice, the last wins.
    #[arg(
        long,
        env = "GPU_MANAGER_CONTAINER_RUNTIME_ENDPOINT",
        overrides_with = "container_runtime_endpoint"
    )]
    pub container_runtime_endpoint: Option<String>,
}

macro_rules! layer {
    ($hi:expr, $lo:expr, $($f:ident),*) => {{
        let (hi, lo) = ($hi, $lo);
        Options { config: hi.config.or(lo.config), $($f: hi.$f.or(lo.$f)),* }
    }};
}

impl Options {
    /// `self` over `lower`, field by field.
    pub fn over(self, lower: Options) -> Options {
        layer!(
            self,
            lower,
            driver,
            extra_config,
            volume_config,
            query_addr,
            query_port,
            display_socket,
            kubeconfig,
            sample_period,
            node_labels,
            hostname_override,
            virtual_manager_path,
            vdriver_path,
            device_plugin_path,
            checkpoint_path,
            share_mode,
            allocation_check_period,
            host_root,
            nvml_library,
            pod_resources_socket,
            interposer,
            xid_quiet_period,
            ignored_xids,
            api_timeout,
            container_runtime,
            container_runtime_endpoint
        )
    }

    pub fn from_toml(path: &Path) -> Result<Options, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            source: Box::new(e),
        })
    }
}

/// The merged settings the daemon runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub extra_config: Option<PathBuf>,
    pub volume_config: PathBuf,
    pub query_addr: String,
    pub query_port: u16,
    pub display_socket: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    pub sample_period: Duration,
    pub node_labels: Vec<(String, String)>,
    pub node_name: String,
    pub virtual_manager_path: PathBuf,
    pub vdriver_path: PathBuf,
    pub device_plugin_path: PathBuf,
    pub checkpoint_path: PathBuf,
    pub share_mode: bool,
    pub allocation_check_period: Duration,
    pub host_root: PathBuf,
    pub nvml_library: Option<PathBuf>,
    pub pod_resources_socket: PathBuf,
    pub interposer: Option<PathBuf>,
    pub xid_quiet_period: Duration,
    pub ignored_xids: Vec<u64>,
    pub api_timeout: Duration,
    /// One of [`crate::runtime::Kind::NAMES`].
    pub container_runtime: String,
    /// Empty: the runtime's default socket.
    pub container_runtime_endpoint: String,
}

fn parse_labels(s: &str) -> Result<Vec<(String, String)>, ConfigError> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| ConfigError::Invalid {
                    field: "node-labels",
                    problem: format!("{t:?} is not key=value"),
                })
        })
        .collect()
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our local buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

impl Settings {
    /// Parses the command line and environment, then the config file they name.
    pub fn load() -> Result<Settings, ConfigError> {
        let cli = Options::parse();
        let file = match &cli.config {
            Some(p) => Options::from_toml(p)?,
            None => Options::default(),
        };
        Settings::resolve(cli.over(file))
    }

    pub fn resolve(o: Options) -> Result<Settings, ConfigError> {
        let driver = o.driver.unwrap_or_else(|| "nvidia".into());
        let container_runtime = o.container_runtime.unwrap_or_else(|| "auto".into());
        if crate::runtime::Kind::parse(&container_runtime).is_none() {
            return Err(ConfigError::Invalid {
                field: "container-runtime",
                problem: format!(
                    "{container_runtime:?} is not supported: one of {:?} (\"none\" reconciles with kubelet and the API server only)",
                    crate::runtime::Kind::NAMES
                ),
            });
        }
        if driver != "nvidia" {
            return Err(ConfigError::Invalid {
                field: "driver",
                problem: format!("{driver:?} is not supported; the only driver is \"nvidia\""),
            });
        }
        let node_name = o
            .hostname_override
            .filter(|s| !s.is_empty())
            .unwrap_or_else(hostname)
            .to_lowercase();
        if node_name.is_empty() {
            return Err(ConfigError::Invalid {
                field: "hostname-override",
                problem: "the host name is empty; set --hostname-override to the node's name"
                    .into(),
            });
        }
        Ok(Settings {
            extra_config: o.extra_config,
            volume_config: o
                .volume_config
                .unwrap_or_else(|| "/etc/gpu-manager/volume.conf".into()),
            query_addr: o.query_addr.unwrap_or_else(|| "127.0.0.1".into()),
            query_port: o.query_port.unwrap_or(gpu_display::DEFAULT_QUERY_PORT),
            display_socket: o
                .display_socket
                .unwrap_or_else(|| gpu_display::DEFAULT_SOCKET.into()),
            kubeconfig: o.kubeconfig,
            sample_period: Duration::from_secs(o.sample_period.unwrap_or(1).max(1)),
            node_labels: parse_labels(o.node_labels.as_deref().unwrap_or(""))?,
            node_name,
            virtual_manager_path: o
                .virtual_manager_path
                .unwrap_or_else(|| "/etc/gpu-manager/vm".into()),
            vdriver_path: o
                .vdriver_path
                .unwrap_or_else(|| "/etc/gpu-manager/vdriver".into()),
            device_plugin_path: o
                .device_plugin_path
                .unwrap_or_else(|| vcuda_api::deviceplugin::v1beta1::DEVICE_PLUGIN_PATH.into()),
            checkpoint_path: o
                .checkpoint_path
                .unwrap_or_else(|| "/etc/gpu-manager/checkpoint".into()),
            share_mode: o.share_mode.unwrap_or(false),
            allocation_check_period: Duration::from_secs(
                o.allocation_check_period.unwrap_or(30).max(1),
            ),
            host_root: o.host_root.unwrap_or_else(|| "/".into()),
            nvml_library: o.nvml_library,
            pod_resources_socket: o
                .pod_resources_socket
                .unwrap_or_else(|| vcuda_api::podresources::v1::DEFAULT_SOCKET.into()),
            interposer: o.interposer,
            xid_quiet_period: Duration::from_secs(o.xid_quiet_period.unwrap_or(300)),
            ignored_xids: o
                .ignored_xids
                .unwrap_or_else(|| vec![13, 31, 43, 45, 68, 109]),
            api_timeout: Duration::from_secs(o.api_timeout.unwrap_or(30).max(1)),
            container_runtime,
            container_runtime_endpoint: o.container_runtime_endpoint.unwrap_or_default(),
        })
    }

    /// Where NVML is loaded from: the flag (relative paths inside the host
    /// root), else the first `libnvidia-ml.so.1` in the host root's library
    /// directories.
    pub fn nvml_path(&self) -> Result<PathBuf, ConfigError> {
        if let Some(p) = &self.nvml_library {
            return Ok(if p.is_absolute() {
                p.clone()
            } else {
                self.host_root.join(p)
            });
        }
        const DIRS: [&str; 6] = [
            "usr/lib/x86_64-linux-gnu",
            "usr/lib/aarch64-linux-gnu",
            "usr/lib64",
            "usr/lib",
            "lib64",
            "lib/x86_64-linux-gnu",
        ];
        DIRS.iter()
            .map(|d| self.host_root.join(d).join("libnvidia-ml.so.1"))
            .find(|p| p.exists())
            .ok_or_else(|| ConfigError::Invalid {
                field: "nvml-library",
                problem: format!(
                    "no libnvidia-ml.so.1 in {} under host root {}: is the NVIDIA driver installed, \
                     and --host-root the host's root? Or pass --nvml-library",
                    DIRS.join(", "),
                    self.host_root.display()
                ),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_over_file_over_default() {
        let cli = Options::parse_from([
            "gpu-manager",
            "--share-mode",
            "--query-port",
            "7000",
            "--hostname-override",
            "Node-1",
        ]);
        let file: Options =
            toml::from_str("query-port = 6000\nsample-period = 5\nshare-mode = false\n").unwrap();
        let s = Settings::resolve(cli.over(file)).unwrap();
        assert!(s.share_mode);
        assert_eq!(s.query_port, 7000);
        assert_eq!(s.sample_period, Duration::from_secs(5));
        assert_eq!(s.node_name, "node-1");
        assert_eq!(
            s.checkpoint_path,
            PathBuf::from("/etc/gpu-manager/checkpoint")
        );
        assert_eq!(s.ignored_xids, vec![13, 31, 43, 45, 68, 109]);
        assert_eq!(s.display_socket, PathBuf::from("/var/run/gpu-manager.sock"));
        let file: Options = toml::from_str("display-socket = \"/run/d.sock\"\n").unwrap();
        let cli = Options::parse_from(["gpu-manager", "--hostname-override", "n"]);
        let s = Settings::resolve(cli.over(file)).unwrap();
        assert_eq!(s.display_socket, PathBuf::from("/run/d.sock"));
    }

    #[test]
    fn unknown_file_key_and_bad_labels_are_errors() {
        assert!(toml::from_str::<Options>("shar-mode = true\n").is_err());
        let o = Options {
            node_labels: Some("a=b,broken".into()),
            hostname_override: Some("n".into()),
            ..Default::default()
        };
        let e = Settings::resolve(o).unwrap_err().to_string();
        assert!(e.contains("broken"), "{e}");
    }

    #[test]
    fn container_runtime_defaults_to_auto_and_names_the_choices() {
        let cli = Options::parse_from(["gpu-manager", "--hostname-override", "n"]);
        let s = Settings::resolve(cli).unwrap();
        assert_eq!(s.container_runtime, "auto");
        assert_eq!(s.container_runtime_endpoint, "");
        let o = Options {
            container_runtime: Some("rkt".into()),
            hostname_override: Some("n".into()),
            ..Default::default()
        };
        let e = Settings::resolve(o).unwrap_err().to_string();
        assert!(e.contains("\"rkt\"") && e.contains("containerd"), "{e}");
        // A restart that appends a flag to the same command line changes it.
        let o = Options::parse_from([
            "gpu-manager",
            "--container-runtime-endpoint",
            "unix:///a.sock",
            "--container-runtime",
            "docker",
            "--container-runtime-endpoint",
            "unix:///b.sock",
            "--container-runtime",
            "containerd",
        ]);
        assert_eq!(
            o.container_runtime_endpoint.as_deref(),
            Some("unix:///b.sock")
        );
        assert_eq!(o.container_runtime.as_deref(), Some("containerd"));
    }

    #[test]
    fn share_mode_takes_an_optional_value() {
        let o = Options::parse_from(["gpu-manager", "--share-mode=false"]);
        assert_eq!(o.share_mode, Some(false));
    }
}
