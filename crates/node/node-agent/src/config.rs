//! The node's configuration, one file for both modes: the flags of the
//! device-plugin daemon (named as the original gpu-manager's where one
//! exists), their `GPU_MANAGER_*` environment variables, and the TOML file
//! (`--config`, the ConfigMap) whose keys are the long flags. Precedence:
//! flag > environment > file > default. [`NodeConfig`] is what either mode
//! needs from it, with the defaults; each daemon adds its own settings.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

mod listeners;
pub use listeners::Listeners;

/// Defaults of the settings both modes read.
pub mod defaults {
    pub const DRIVER: &str = "nvidia";
    pub const VOLUME_CONFIG: &str = "/etc/gpu-manager/volume.conf";
    pub const VM_DIR: &str = "/etc/gpu-manager/vm";
    pub const VDRIVER_DIR: &str = "/etc/gpu-manager/vdriver";
    pub const HOST_ROOT: &str = "/";
    pub const SAMPLE_PERIOD_SECS: u64 = 1;
    pub const XID_QUIET_PERIOD_SECS: u64 = 300;
    /// Xids that are the application's fault, not the GPU's.
    pub const IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];
    /// Where `libnvidia-ml.so.1` is looked for under the host root.
    pub const NVML_DIRS: [&str; 6] = [
        "usr/lib/x86_64-linux-gnu",
        "usr/lib/aarch64-linux-gnu",
        "usr/lib64",
        "usr/lib",
        "lib64",
        "lib/x86_64-linux-gnu",
    ];
}

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
    /// Address of the query HTTP server (/usage, /graph, /version, /metrics,
    /// the probes): /usage names every tenant's pods and host PIDs, so keep
    /// it node-local and give Prometheus --metrics-port [default: 127.0.0.1].
    #[arg(long, env = "GPU_MANAGER_QUERY_ADDR")]
    pub query_addr: Option<String>,
    /// Port of the query HTTP server [default: 5678].
    #[arg(long, env = "GPU_MANAGER_QUERY_PORT")]
    pub query_port: Option<u16>,
    /// Port of the probe listener (/healthz and /readyz alone) on
    /// --metrics-addr, so a flood of the query port cannot starve the
    /// kubelet's probes; unset: the probes are served on the query port only.
    #[arg(long, env = "GPU_MANAGER_HEALTH_PORT")]
    pub health_port: Option<u16>,
    /// Port of the metrics listener (/metrics alone, for Prometheus) on
    /// --metrics-addr; unset: the metrics are served on the query port only.
    #[arg(long, env = "GPU_MANAGER_METRICS_PORT")]
    pub metrics_port: Option<u16>,
    /// Address of the metrics and probe listeners, the ones reached from
    /// outside the pod [default: the query address].
    #[arg(long, env = "GPU_MANAGER_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Unix socket of the display gRPC service (`vcudactl`) [default: /var/run/gpu-manager.sock].
    #[arg(long, env = "GPU_MANAGER_DISPLAY_SOCKET")]
    pub display_socket: Option<PathBuf>,
    /// kubeconfig; without it, the in-cluster service account (or $KUBECONFIG).
    #[arg(long, env = "GPU_MANAGER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Seconds between GPU process and utilization samples [default: 1].
    #[arg(long, env = "GPU_MANAGER_SAMPLE_PERIOD")]
    pub sample_period: Option<u64>,
    /// What to do, after each sample, with a process in a share that uses
    /// a GPU without having registered with the interposer, or a share over
    /// its memory quota on NVML's count: "report" (log, metric, an Event on
    /// the pod) or "kill" (and end it; over quota, its largest process)
    /// [default: report].
    #[arg(long, env = "GPU_MANAGER_ESCAPE_POLICY")]
    pub escape_policy: Option<String>,
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
    /// Device-plugin mode: MIG devices are advertised as `<prefix><profile>`
    /// [default: tencent.com/mig-; NVIDIA's plugin names them nvidia.com/mig-].
    #[arg(long, env = "GPU_MANAGER_MIG_RESOURCE_PREFIX")]
    pub mig_resource_prefix: Option<String>,
    /// Device-plugin mode: seconds between reads of the MIG instances on
    /// GPUs in MIG mode, so that instances made or destroyed meanwhile are
    /// advertised or withdrawn [default: 10; 0: only at start].
    #[arg(long, env = "GPU_MANAGER_MIG_RESCAN_PERIOD")]
    pub mig_rescan_period: Option<u64>,
    /// MIG geometry to apply at start, "<GPU index or UUID>=<profile>,…;…"
    /// (e.g. "0=3g.40gb,1g.10gb,1g.10gb"); GPUs not named are left as they
    /// are [default: none] (docs/mig.md).
    #[arg(long, env = "GPU_MANAGER_MIG_GEOMETRY")]
    pub mig_geometry: Option<String>,
    /// Device-plugin mode: GPUs (index or UUID, comma-separated) partitioned
    /// toward the MIG devices pending pods ask for, instances made and
    /// destroyed as they are needed [default: none] (docs/mig.md).
    #[arg(long, env = "GPU_MANAGER_MIG_DYNAMIC")]
    pub mig_dynamic: Option<String>,
    /// Device-plugin mode: seconds an instance dynamic MIG made stays after
    /// nobody needs it (the scheduler's time to place the pod it was made
    /// for) [default: 60].
    #[arg(long, env = "GPU_MANAGER_MIG_DYNAMIC_GRACE")]
    pub mig_dynamic_grace: Option<u64>,
    /// Device-plugin mode, with --share-mode: MIG profiles (comma-separated,
    /// e.g. "2g.20gb") whose instances serve vcuda shares instead of being
    /// advertised whole; a pod asks for one with the annotation
    /// tencent.com/vcuda-mig-profile [default: none] (docs/mig.md).
    #[arg(long, env = "GPU_MANAGER_MIG_SHARED_PROFILES")]
    pub mig_shared_profiles: Option<String>,
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
            health_port,
            metrics_port,
            metrics_addr,
            display_socket,
            kubeconfig,
            sample_period,
            escape_policy,
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
            container_runtime_endpoint,
            mig_resource_prefix,
            mig_rescan_period,
            mig_geometry,
            mig_dynamic,
            mig_dynamic_grace,
            mig_shared_profiles
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

/// What a node agent needs in either mode, resolved with its defaults.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Lower-case: `--hostname-override`, else the host name.
    pub node_name: String,
    pub host_root: PathBuf,
    pub nvml_library: Option<PathBuf>,
    pub volume_config: PathBuf,
    pub interposer: Option<PathBuf>,
    pub vdriver_path: PathBuf,
    pub virtual_manager_path: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    pub extra_config: Option<PathBuf>,
    pub xid_quiet_period: Duration,
    pub ignored_xids: Vec<u64>,
    pub display_socket: PathBuf,
    /// The display's HTTP listeners.
    pub http: Listeners,
    pub sample_period: Duration,
    pub escape_policy: gpu_display::guard::Policy,
    /// `--mig-geometry` (empty: no GPU named).
    pub mig_geometry: crate::geometry::Geometry,
}

impl NodeConfig {
    pub fn resolve(o: &Options) -> Result<NodeConfig, ConfigError> {
        let driver = o.driver.as_deref().unwrap_or(defaults::DRIVER);
        if driver != defaults::DRIVER {
            return Err(ConfigError::Invalid {
                field: "driver",
                problem: format!("{driver:?} is not supported; the only driver is \"nvidia\""),
            });
        }
        let node_name = o
            .hostname_override
            .clone()
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
        let http = Listeners::resolve(o)?;
        let or = |p: &Option<PathBuf>, d: &str| p.clone().unwrap_or_else(|| d.into());
        let mig_geometry = o.mig_geometry.as_deref().unwrap_or("").parse().map_err(
            |e: crate::geometry::GeometryParseError| ConfigError::Invalid {
                field: "mig-geometry",
                problem: e.to_string(),
            },
        )?;
        Ok(NodeConfig {
            mig_geometry,
            node_name,
            host_root: or(&o.host_root, defaults::HOST_ROOT),
            nvml_library: o.nvml_library.clone(),
            volume_config: or(&o.volume_config, defaults::VOLUME_CONFIG),
            interposer: o.interposer.clone(),
            vdriver_path: or(&o.vdriver_path, defaults::VDRIVER_DIR),
            virtual_manager_path: or(&o.virtual_manager_path, defaults::VM_DIR),
            kubeconfig: o.kubeconfig.clone(),
            extra_config: o.extra_config.clone(),
            xid_quiet_period: Duration::from_secs(
                o.xid_quiet_period
                    .unwrap_or(defaults::XID_QUIET_PERIOD_SECS),
            ),
            ignored_xids: o
                .ignored_xids
                .clone()
                .unwrap_or_else(|| defaults::IGNORED_XIDS.to_vec()),
            display_socket: or(&o.display_socket, gpu_display::DEFAULT_SOCKET),
            http,
            sample_period: Duration::from_secs(
                o.sample_period
                    .unwrap_or(defaults::SAMPLE_PERIOD_SECS)
                    .max(1),
            ),
            escape_policy: match &o.escape_policy {
                None => gpu_display::guard::Policy::default(),
                Some(p) => p.parse().map_err(|problem| ConfigError::Invalid {
                    field: "escape-policy",
                    problem,
                })?,
            },
        })
    }

    /// See [`nvml_path`].
    pub fn nvml_path(&self) -> Result<PathBuf, ConfigError> {
        nvml_path(&self.host_root, self.nvml_library.as_deref())
    }
}

/// Where NVML is loaded from: `library` (relative paths inside the host
/// root), else the first `libnvidia-ml.so.1` in the host root's library
/// directories.
pub fn nvml_path(host_root: &Path, library: Option<&Path>) -> Result<PathBuf, ConfigError> {
    if let Some(p) = library {
        return Ok(if p.is_absolute() {
            p.to_path_buf()
        } else {
            host_root.join(p)
        });
    }
    defaults::NVML_DIRS
        .iter()
        .map(|d| host_root.join(d).join("libnvidia-ml.so.1"))
        .find(|p| p.exists())
        .ok_or_else(|| ConfigError::Invalid {
            field: "nvml-library",
            problem: format!(
                "no libnvidia-ml.so.1 in {} under host root {}: is the NVIDIA driver installed, \
                 and --host-root the host's root? Or pass --nvml-library",
                defaults::NVML_DIRS.join(", "),
                host_root.display()
            ),
        })
}

/// The host name as the kernel has it; empty when unknown.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our local buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_layers() {
        let cli = Options::parse_from(["gpu-manager", "--hostname-override", "Node-1"]);
        let file: Options = toml::from_str("sample-period = 0\nhost-root = \"/h\"\n").unwrap();
        let n = NodeConfig::resolve(&cli.over(file)).unwrap();
        assert_eq!(n.node_name, "node-1");
        assert_eq!(n.host_root, PathBuf::from("/h"));
        assert_eq!(n.sample_period, Duration::from_secs(1));
        assert_eq!(
            n.volume_config,
            PathBuf::from("/etc/gpu-manager/volume.conf")
        );
        assert_eq!(n.vdriver_path, PathBuf::from("/etc/gpu-manager/vdriver"));
        assert_eq!(n.virtual_manager_path, PathBuf::from("/etc/gpu-manager/vm"));
        assert_eq!(n.xid_quiet_period, Duration::from_secs(300));
        assert_eq!(n.ignored_xids, [13, 31, 43, 45, 68, 109]);
        assert_eq!(n.display_socket, PathBuf::from("/var/run/gpu-manager.sock"));
        assert_eq!(n.http.query, "127.0.0.1:5678".parse().unwrap());
        assert_eq!((n.http.health, n.http.metrics), (None, None));
        let o = Options {
            health_port: Some(5678),
            ..Default::default()
        };
        let e = NodeConfig::resolve(&o).unwrap_err().to_string();
        assert!(e.starts_with("health-port:") && e.contains("5678"), "{e}");
        let o = Options {
            driver: Some("amd".into()),
            ..Default::default()
        };
        let e = NodeConfig::resolve(&o).unwrap_err().to_string();
        assert!(e.starts_with("driver:") && e.contains("\"amd\""), "{e}");
    }

    #[test]
    fn nvml_is_found_under_the_host_root_or_named() {
        let tmp = tempfile::tempdir().unwrap();
        let e = nvml_path(tmp.path(), None).unwrap_err().to_string();
        assert!(e.contains("no libnvidia-ml.so.1"), "{e}");
        let lib = tmp.path().join("usr/lib64");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnvidia-ml.so.1"), b"").unwrap();
        assert_eq!(
            nvml_path(tmp.path(), None).unwrap(),
            lib.join("libnvidia-ml.so.1")
        );
        assert_eq!(
            nvml_path(Path::new("/h"), Some(Path::new("x/l.so"))).unwrap(),
            PathBuf::from("/h/x/l.so")
        );
    }
}
