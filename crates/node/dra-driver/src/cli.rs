//! `vcuda-dra-driver`'s settings: flags (and their `VCUDA_DRA_*`
//! variables) over the manager's TOML file (`--manager-config`, the same
//! ConfigMap the device-plugin mode reads: host root, driver mirror, vm
//! directory, interposer, Xids, display, node name, MIG geometry), over
//! defaults. A node switches modes by running this binary instead of
//! `gpu-manager`, with the same file; the file's device-plugin keys are
//! not used here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use node_agent::config::{NodeConfig, Options};

use crate::daemon::Settings;

#[derive(Parser, Debug, Default)]
#[command(
    name = "vcuda-dra-driver",
    version,
    about = "vcuda DRA driver (vcuda.tencent.com): ResourceSlices, NodePrepareResources, CDI"
)]
pub struct Args {
    /// The manager's TOML configuration, read for what is not given here.
    #[arg(long, env = "GPU_MANAGER_CONFIG")]
    pub manager_config: Option<PathBuf>,
    /// This node's name, lower-cased [default: the file's hostname-override, else the host name].
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// The host's root as mounted here [default: /].
    #[arg(long, env = "VCUDA_DRA_HOST_ROOT")]
    pub host_root: Option<PathBuf>,
    #[arg(long, env = "VCUDA_DRA_NVML_LIBRARY")]
    pub nvml_library: Option<PathBuf>,
    /// [default: /etc/gpu-manager/volume.conf]
    #[arg(long, env = "VCUDA_DRA_VOLUME_CONFIG")]
    pub volume_config: Option<PathBuf>,
    /// libvcuda.so, mirrored as the shares' libcuda.so.1 / libnvidia-ml.so.1.
    #[arg(long, env = "VCUDA_DRA_INTERPOSER")]
    pub interposer: Option<PathBuf>,
    /// [default: /etc/gpu-manager/vdriver]
    #[arg(long, env = "VCUDA_DRA_VDRIVER_DIR")]
    pub vdriver_dir: Option<PathBuf>,
    /// [default: /etc/gpu-manager/vm]
    #[arg(long, env = "VCUDA_DRA_VM_DIR")]
    pub vm_dir: Option<PathBuf>,
    /// [default: /var/run/cdi]
    #[arg(long, env = "VCUDA_DRA_CDI_DIR")]
    pub cdi_dir: Option<PathBuf>,
    /// The checkpoint's directory [default: /var/lib/kubelet/plugins/vcuda.tencent.com].
    #[arg(long, env = "VCUDA_DRA_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// [default: /var/lib/kubelet/plugins]
    #[arg(long, env = "VCUDA_DRA_PLUGINS_DIR")]
    pub plugins_dir: Option<PathBuf>,
    /// [default: /var/lib/kubelet/plugins_registry]
    #[arg(long, env = "VCUDA_DRA_REGISTRY_DIR")]
    pub registry_dir: Option<PathBuf>,
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Seconds without a critical Xid before a GPU is published again [default: 300].
    #[arg(long)]
    pub xid_quiet_period: Option<u64>,
    /// How a GPU with a recent critical Xid is published: NoSchedule (in
    /// the slice with a device taint new claims avoid), NoExecute (and the
    /// pods using it are evicted) or LeaveOut (out of the slice; used
    /// anyway where the API server has no device taints) [default: NoSchedule].
    #[arg(long, env = "VCUDA_DRA_XID_TAINT_EFFECT")]
    pub xid_taint_effect: Option<crate::slices::Unhealthy>,
    /// Xids that are the application's fault [default: 13,31,43,45,68,109].
    #[arg(long, value_delimiter = ',')]
    pub ignored_xids: Option<Vec<u64>>,
    /// Seconds between republishing checks [default: 60].
    #[arg(long)]
    pub resync_period: Option<u64>,
    /// JSON of extra devices for every container (the manager's extra-config).
    #[arg(long)]
    pub extra_config: Option<PathBuf>,
    /// The display's gRPC socket; "none" serves no display [default: /var/run/gpu-manager.sock].
    #[arg(long)]
    pub display_socket: Option<PathBuf>,
    /// The display's HTTP address [default: 127.0.0.1:5678].
    #[arg(long)]
    pub query_addr: Option<SocketAddr>,
    /// The display's probe port (/healthz and /readyz alone) on
    /// --metrics-addr [default: the manager file's health-port; unset: none].
    #[arg(long)]
    pub health_port: Option<u16>,
    /// The display's metrics port (/metrics alone, for Prometheus) on
    /// --metrics-addr [default: the manager file's metrics-port; unset: none].
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Address of the probe and metrics ports [default: the manager file's
    /// metrics-addr, else the query address].
    #[arg(long)]
    pub metrics_addr: Option<String>,
    /// Seconds between display samples [default: 1].
    #[arg(long)]
    pub sample_period: Option<u64>,
    /// A process in a claim's container using a GPU without the
    /// interposer, or a claim over its memory on NVML's count: "report"
    /// (log, metric, an Event on the claim's pods) or "kill" (and end it;
    /// over quota, its largest process) [default: report].
    #[arg(long)]
    pub escape_policy: Option<String>,
    /// Run the driver alone, without the supervisor that keeps the
    /// kubelet's sockets open across a crash and starts it again.
    #[arg(long, env = "VCUDA_DRA_NO_SUPERVISOR")]
    pub no_supervisor: bool,
    /// The socket of this pod's socket holder (`vcuda-dra-driver
    /// hold-sockets PATH` in a second container): the kubelet's sockets
    /// then stay open across a restart of the driver's container too.
    #[arg(long, env = "VCUDA_DRA_SOCKET_HOLDER")]
    pub socket_holder: Option<PathBuf>,
    /// MIG geometry to apply at start, "<GPU index or UUID>=<profile>,…;…"
    /// (e.g. "0=3g.40gb,1g.10gb,1g.10gb"); GPUs not named are left as
    /// they are; instances of prepared claims are never destroyed
    /// [default: none] (docs/mig.md).
    #[arg(long, env = "VCUDA_DRA_MIG_GEOMETRY")]
    pub mig_geometry: Option<String>,
    /// GPUs (index or UUID) partitioned per claim, "0,GPU-…": in MIG
    /// mode, every placement of every profile published (partitionable
    /// devices), the instance made at prepare and destroyed at unprepare
    /// [default: none] (docs/dra.md, Dynamic MIG).
    #[arg(long, env = "VCUDA_DRA_MIG_DYNAMIC", value_delimiter = ',')]
    pub mig_dynamic: Option<Vec<String>>,
    /// Seconds between reads of the MIG instances on GPUs in MIG mode (not
    /// `--mig-dynamic`'s), so that instances an operator made or destroyed
    /// meanwhile are published or withdrawn [default: 10; 0: only at start].
    #[arg(long, env = "VCUDA_DRA_MIG_RESCAN_PERIOD")]
    pub mig_rescan_period: Option<u64>,
}

/// Flags over the manager's file over the node's defaults
/// ([`node_agent::config`]); the DRA driver's own settings after them.
pub fn resolve(a: Args) -> anyhow::Result<Settings> {
    let f = match &a.manager_config {
        Some(p) => Options::from_toml(p)?,
        None => Options::default(),
    };
    let flags = Options {
        // NODE_NAME (the downward API) is the node's name when set.
        hostname_override: a.node_name,
        host_root: a.host_root,
        nvml_library: a.nvml_library,
        volume_config: a.volume_config,
        interposer: a.interposer,
        vdriver_path: a.vdriver_dir,
        virtual_manager_path: a.vm_dir,
        kubeconfig: a.kubeconfig,
        xid_quiet_period: a.xid_quiet_period,
        ignored_xids: a.ignored_xids,
        extra_config: a.extra_config,
        display_socket: a.display_socket,
        query_addr: a.query_addr.map(|q| q.ip().to_string()),
        query_port: a.query_addr.map(|q| q.port()),
        health_port: a.health_port,
        metrics_port: a.metrics_port,
        metrics_addr: a.metrics_addr,
        sample_period: a.sample_period,
        escape_policy: a.escape_policy,
        mig_geometry: a.mig_geometry,
        ..Options::default()
    };
    let n = NodeConfig::resolve(&flags.over(f))?;
    let extra_devices = match &n.extra_config {
        Some(p) => node_agent::extra::ExtraConfig::load(p)?.devices,
        None => vec![],
    };
    let mig_dynamic = a.mig_dynamic.unwrap_or_default();
    // A GPU is partitioned by one of the two (a GPU named by index in one
    // and by UUID in the other is safe all the same: the geometry's
    // instances are foreign to dynamic MIG, which keeps clear of them).
    if let Some(g) = mig_dynamic
        .iter()
        .find(|g| n.mig_geometry.gpus.contains_key(*g))
    {
        anyhow::bail!("GPU {g:?} is in both --mig-geometry and --mig-dynamic: name it in one");
    }
    let display_socket = n.display_socket;
    Ok(Settings {
        node: n.node_name,
        host_root: n.host_root,
        nvml_library: n.nvml_library,
        volume_config: n.volume_config,
        interposer: n.interposer,
        vdriver_dir: n.vdriver_path,
        vm_dir: n.virtual_manager_path,
        cdi_dir: a.cdi_dir.unwrap_or_else(|| "/var/run/cdi".into()),
        state_dir: a.state_dir.unwrap_or_else(|| {
            PathBuf::from(dra_api::pluginregistration::PLUGINS_DIR).join(crate::DRIVER_NAME)
        }),
        plugins_dir: a
            .plugins_dir
            .unwrap_or_else(|| dra_api::pluginregistration::PLUGINS_DIR.into()),
        registry_dir: a
            .registry_dir
            .unwrap_or_else(|| dra_api::pluginregistration::REGISTRY_DIR.into()),
        kubeconfig: n.kubeconfig,
        xid_quiet_period: n.xid_quiet_period,
        ignored_xids: n.ignored_xids,
        unhealthy: a
            .xid_taint_effect
            .unwrap_or(crate::slices::Unhealthy::Taint("NoSchedule")),
        resync_period: Duration::from_secs(a.resync_period.unwrap_or(60).max(1)),
        extra_devices,
        display: (display_socket.as_os_str() != "none").then_some(crate::daemon::DisplayAt {
            socket: display_socket,
            http: n.http,
        }),
        sample_period: n.sample_period,
        escape_policy: n.escape_policy,
        mig_geometry: n.mig_geometry,
        mig_dynamic,
        mig_rescan_period: match a.mig_rescan_period.unwrap_or(10) {
            0 => None,
            s => Some(Duration::from_secs(s)),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_over_the_managers_file_over_defaults() {
        let tmp = tempfile::tempdir().unwrap();
        let toml = tmp.path().join("gpu-manager.toml");
        // The repository's sample, with a node name and an interposer.
        let sample = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../config/gpu-manager.toml"
        ))
        .unwrap();
        std::fs::write(
            &toml,
            format!("{sample}\nhostname-override = \"node-1\"\ninterposer = \"/usr/lib/vcuda/libvcuda.so\"\n"),
        )
        .unwrap();
        let s = resolve(Args {
            manager_config: Some(toml.clone()),
            vm_dir: Some("/flag/vm".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.node, "node-1");
        assert_eq!(s.host_root, PathBuf::from("/usr/local/host"));
        assert_eq!(s.vm_dir, PathBuf::from("/flag/vm"));
        assert_eq!(s.vdriver_dir, PathBuf::from("/etc/gpu-manager/vdriver"));
        assert_eq!(
            s.interposer.as_deref(),
            Some(std::path::Path::new("/usr/lib/vcuda/libvcuda.so"))
        );
        let at = s.display.as_ref().unwrap();
        assert_eq!(at.http.query, "127.0.0.1:5678".parse().unwrap());
        assert_eq!(at.http.health, Some("0.0.0.0:5679".parse().unwrap()));
        assert_eq!(at.http.metrics, Some("0.0.0.0:5680".parse().unwrap()));
        // The query flag moves the query port alone; the file's probe and
        // metrics ports stay on its metrics-addr.
        let s = resolve(Args {
            manager_config: Some(toml.clone()),
            query_addr: Some("127.0.0.1:7000".parse().unwrap()),
            metrics_port: Some(7001),
            ..Default::default()
        })
        .unwrap();
        let http = s.display.unwrap().http;
        assert_eq!(http.query, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(http.health, Some("0.0.0.0:5679".parse().unwrap()));
        assert_eq!(http.metrics, Some("0.0.0.0:7001".parse().unwrap()));
        assert_eq!(s.ignored_xids, [13, 31, 43, 45, 68, 109]);
        assert_eq!(s.cdi_dir, PathBuf::from("/var/run/cdi"));
        assert_eq!(
            s.state_dir,
            PathBuf::from("/var/lib/kubelet/plugins/vcuda.tencent.com")
        );

        let s = resolve(Args {
            node_name: Some("n".into()),
            display_socket: Some("none".into()),
            ..Default::default()
        })
        .unwrap();
        assert!(s.display.is_none());
        assert_eq!(s.host_root, PathBuf::from("/"));
        std::fs::write(&toml, "bogus-key = 1\n").unwrap();
        let e = resolve(Args {
            manager_config: Some(toml),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("gpu-manager.toml"), "{e}");
    }

    #[test]
    fn the_mig_geometry_flag_over_the_managers_file() {
        let tmp = tempfile::tempdir().unwrap();
        let toml = tmp.path().join("gpu-manager.toml");
        std::fs::write(&toml, "mig-geometry = \"1=7g.80gb\"\n").unwrap();
        let resolve_with = |flags: &[&str]| {
            let mut argv = vec!["vcuda-dra-driver", "--node-name", "n", "--manager-config"];
            argv.push(toml.to_str().unwrap());
            argv.extend(flags);
            resolve(Args::try_parse_from(argv).unwrap())
        };
        let from_file = resolve_with(&[]).unwrap().mig_geometry;
        assert_eq!(from_file.gpus.len(), 1);
        assert_eq!(from_file.gpus["1"], ["7g.80gb"]);
        let g = resolve_with(&["--mig-geometry", "0=3g.40gb,1g.10gb;GPU-x=2g.20gb"])
            .unwrap()
            .mig_geometry;
        assert_eq!(g.gpus.len(), 2, "the flag replaces the file's: {g:?}");
        assert_eq!(g.gpus["0"], ["3g.40gb", "1g.10gb"]);
        assert_eq!(g.gpus["GPU-x"], ["2g.20gb"]);
        let none = resolve(Args {
            node_name: Some("n".into()),
            ..Default::default()
        })
        .unwrap();
        assert!(none.mig_geometry.gpus.is_empty());
        let e = resolve_with(&["--mig-geometry", "0:3g.40gb"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("mig-geometry") && e.contains("0:3g.40gb"), "{e}");
        let d = resolve_with(&["--mig-dynamic", "0,GPU-y"]).unwrap();
        assert_eq!(d.mig_dynamic, ["0", "GPU-y"]);
        let e = resolve_with(&["--mig-dynamic", "1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("both --mig-geometry and --mig-dynamic"), "{e}");
    }

    #[test]
    fn the_xid_taint_effect_flag() {
        use crate::slices::Unhealthy;
        let parse = |v: &str| Args::try_parse_from(["vcuda-dra-driver", "--xid-taint-effect", v]);
        let with = |a: Args| {
            resolve(Args {
                node_name: Some("n".into()),
                ..a
            })
            .unwrap()
            .unhealthy
        };
        assert_eq!(with(Args::default()), Unhealthy::Taint("NoSchedule"));
        assert_eq!(
            with(parse("NoExecute").unwrap()),
            Unhealthy::Taint("NoExecute")
        );
        assert_eq!(with(parse("LeaveOut").unwrap()), Unhealthy::LeftOut);
        let e = parse("Evict").unwrap_err().to_string();
        assert!(e.contains("\"Evict\": expected NoSchedule"), "{e}");
    }
}
