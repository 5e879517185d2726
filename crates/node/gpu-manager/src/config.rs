//! The device-plugin daemon's settings: the node's configuration
//! ([`node_agent::config`]: flags, `GPU_MANAGER_*` variables, the TOML file,
//! shared defaults) and the device-plugin mode's own settings with theirs.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use node_agent::config::NodeConfig;
pub use node_agent::config::{ConfigError, Options};

/// The merged settings the daemon runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub extra_config: Option<PathBuf>,
    pub volume_config: PathBuf,
    /// The display's HTTP listeners.
    pub http: node_agent::config::Listeners,
    pub display_socket: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    pub sample_period: Duration,
    pub escape_policy: gpu_display::guard::Policy,
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
    /// One of [`crate::world::runtime::Kind::NAMES`].
    pub container_runtime: String,
    /// Empty: the runtime's default socket.
    pub container_runtime_endpoint: String,
    /// MIG devices are advertised as `<prefix><profile>` ([`crate::mig`]).
    pub mig_resource_prefix: String,
    /// How often MIG instances are read again; `None`: only at start.
    pub mig_rescan_period: Option<Duration>,
    /// `--mig-geometry` ([`node_agent::geometry`]).
    pub mig_geometry: node_agent::geometry::Geometry,
    /// `--mig-dynamic`: GPUs (index or UUID) partitioned toward demand
    /// ([`crate::mig::dynamic`]).
    pub mig_dynamic: Vec<String>,
    /// How long a dynamic instance nobody needs stays.
    pub mig_dynamic_grace: Duration,
    /// `--mig-shared-profiles`: instances of these serve shares
    /// (docs/mig.md, *Shares inside an instance*), not a resource of their
    /// own.
    pub mig_shared_profiles: Vec<String>,
}

/// `--mig-shared-profiles`: names as NVIDIA's tools print them
/// (`2g.20gb`, `1g.10gb+me`), and only with shares on.
fn shared_profiles(o: &Options) -> Result<Vec<String>, ConfigError> {
    let list: Vec<String> = o
        .mig_shared_profiles
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect();
    let invalid = |problem: String| ConfigError::Invalid {
        field: "mig-shared-profiles",
        problem,
    };
    if let Some(p) = list.iter().find(|p| !gpu_pods::is_mig_profile_name(p)) {
        return Err(invalid(format!(
            "{p:?} is not a MIG profile name (as nvidia-smi prints them: 1g.10gb, 2g.20gb, 3g.40gb+me)"
        )));
    }
    if !list.is_empty()
        && o.mig_dynamic
            .as_deref()
            .is_some_and(|d| !d.trim().is_empty())
    {
        return Err(invalid(
            "shares inside instances are served on static instances only: drop --mig-dynamic, or keep the GPUs that serve shares out of it on another node".into(),
        ));
    }
    if !list.is_empty() && !o.share_mode.unwrap_or(false) {
        return Err(invalid(format!(
            "{} serve shares, and share mode is off: add --share-mode",
            list.join(",")
        )));
    }
    Ok(list)
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

/// `<domain>/<start of a name>`: what kubelet takes once a profile
/// (`1g.10gb`) is appended.
fn check_mig_prefix(p: &str) -> Result<(), ConfigError> {
    let name_char = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    let ok = match p.split_once('/') {
        Some((domain, start)) => {
            !domain.is_empty()
                && domain
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-.".contains(c))
                && start.chars().all(name_char)
                && start.len() + "7g.141gb".len() <= 63
        }
        None => false,
    };
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            field: "mig-resource-prefix",
            problem: format!(
                "{p:?} is not <domain>/<name start> (e.g. nvidia.com/mig-): a MIG device's resource is the prefix and its profile"
            ),
        })
    }
}

impl Settings {
    /// Parses the command line and environment, then the config file they name.
    pub fn load() -> Result<Settings, ConfigError> {
        Settings::load_from(std::env::args_os())
    }

    /// [`load`](Self::load) from the given arguments (program name first).
    pub fn load_from<I, T>(args: I) -> Result<Settings, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let cli = Options::parse_from(args);
        let file = match &cli.config {
            Some(p) => Options::from_toml(p)?,
            None => Options::default(),
        };
        Settings::resolve(cli.over(file))
    }

    pub fn resolve(o: Options) -> Result<Settings, ConfigError> {
        let container_runtime = o.container_runtime.clone().unwrap_or_else(|| "auto".into());
        if crate::world::runtime::Kind::parse(&container_runtime).is_none() {
            return Err(ConfigError::Invalid {
                field: "container-runtime",
                problem: format!(
                    "{container_runtime:?} is not supported: one of {:?} (\"none\" reconciles with kubelet and the API server only)",
                    crate::world::runtime::Kind::NAMES
                ),
            });
        }
        let mig_resource_prefix = o
            .mig_resource_prefix
            .clone()
            .unwrap_or_else(|| gpu_pods::MIG_RESOURCE_PREFIX.into());
        check_mig_prefix(&mig_resource_prefix)?;
        let n = NodeConfig::resolve(&o)?;
        let mig_dynamic: Vec<String> = o
            .mig_dynamic
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|g| !g.is_empty())
            .map(str::to_string)
            .collect();
        // One of the two partitions a GPU (named by index in one and by
        // UUID in the other is caught at start, once UUIDs are known).
        if let Some(g) = mig_dynamic
            .iter()
            .find(|g| n.mig_geometry.gpus.contains_key(*g))
        {
            return Err(ConfigError::Invalid {
                field: "mig-dynamic",
                problem: format!("GPU {g:?} is in --mig-geometry too: name it in one"),
            });
        }
        let mig_shared_profiles = shared_profiles(&o)?;
        Ok(Settings {
            extra_config: n.extra_config,
            volume_config: n.volume_config,
            http: n.http,
            display_socket: n.display_socket,
            kubeconfig: n.kubeconfig,
            sample_period: n.sample_period,
            escape_policy: n.escape_policy,
            node_labels: parse_labels(o.node_labels.as_deref().unwrap_or(""))?,
            node_name: n.node_name,
            virtual_manager_path: n.virtual_manager_path,
            vdriver_path: n.vdriver_path,
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
            host_root: n.host_root,
            nvml_library: n.nvml_library,
            pod_resources_socket: o
                .pod_resources_socket
                .unwrap_or_else(|| vcuda_api::podresources::v1::DEFAULT_SOCKET.into()),
            interposer: n.interposer,
            xid_quiet_period: n.xid_quiet_period,
            ignored_xids: n.ignored_xids,
            api_timeout: Duration::from_secs(o.api_timeout.unwrap_or(30).max(1)),
            container_runtime,
            container_runtime_endpoint: o.container_runtime_endpoint.unwrap_or_default(),
            mig_resource_prefix,
            mig_rescan_period: match o.mig_rescan_period.unwrap_or(10) {
                0 => None,
                s => Some(Duration::from_secs(s)),
            },
            mig_geometry: n.mig_geometry,
            mig_dynamic,
            mig_dynamic_grace: Duration::from_secs(o.mig_dynamic_grace.unwrap_or(60)),
            mig_shared_profiles,
        })
    }

    /// See [`node_agent::config::nvml_path`].
    pub fn nvml_path(&self) -> Result<PathBuf, ConfigError> {
        node_agent::config::nvml_path(&self.host_root, self.nvml_library.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_resource_prefix() {
        let s = |args: &[&str]| {
            let mut a = vec!["gpu-manager", "--hostname-override", "n"];
            a.extend(args);
            Settings::resolve(Options::parse_from(a))
        };
        assert_eq!(s(&[]).unwrap().mig_resource_prefix, "tencent.com/mig-");
        let nv = s(&["--mig-resource-prefix", "nvidia.com/mig-"]).unwrap();
        assert_eq!(nv.mig_resource_prefix, "nvidia.com/mig-");
        for bad in ["mig-", "nvidia.com/mig+", "Nvidia.com/mig-", "/mig-"] {
            let e = s(&["--mig-resource-prefix", bad]).unwrap_err().to_string();
            assert!(
                e.contains("mig-resource-prefix") && e.contains(bad),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn mig_dynamic_gpus_and_their_grace() {
        let s = |args: &[&str]| {
            let mut a = vec!["gpu-manager", "--hostname-override", "n"];
            a.extend(args);
            Settings::resolve(Options::parse_from(a))
        };
        let d = s(&["--mig-dynamic", "0, GPU-y", "--mig-dynamic-grace", "5"]).unwrap();
        assert_eq!(d.mig_dynamic, ["0", "GPU-y"]);
        assert_eq!(d.mig_dynamic_grace, Duration::from_secs(5));
        assert_eq!(s(&[]).unwrap().mig_dynamic_grace, Duration::from_secs(60));
        let e = s(&["--mig-dynamic", "1", "--mig-geometry", "1=7g.80gb"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("mig-dynamic") && e.contains("\"1\""), "{e}");
    }

    #[test]
    fn mig_shared_profiles_need_shares_and_static_instances() {
        let s = |args: &[&str]| {
            let mut a = vec!["gpu-manager", "--hostname-override", "n"];
            a.extend(args);
            Settings::resolve(Options::parse_from(a))
        };
        let ok = s(&[
            "--share-mode",
            "--mig-shared-profiles",
            "2g.20gb, 1g.10gb+me",
        ])
        .unwrap();
        assert_eq!(ok.mig_shared_profiles, ["2g.20gb", "1g.10gb+me"]);
        assert!(s(&[]).unwrap().mig_shared_profiles.is_empty());
        for (args, want) in [
            (
                &["--share-mode", "--mig-shared-profiles", "2g"][..],
                "\"2g\" is not a MIG profile name",
            ),
            (
                &["--mig-shared-profiles", "2g.20gb"][..],
                "share mode is off: add --share-mode",
            ),
            (
                &[
                    "--share-mode",
                    "--mig-shared-profiles",
                    "2g.20gb",
                    "--mig-dynamic",
                    "0",
                ][..],
                "static instances only",
            ),
        ] {
            let e = s(args).unwrap_err().to_string();
            assert!(
                e.contains("mig-shared-profiles") && e.contains(want),
                "{args:?}: {e}"
            );
        }
    }

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
        assert_eq!(s.http.query.port(), 7000);
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
