//! `gpu-sim`: the simulated GPU node's command-line tool.

mod install;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use gpu_sim_core::{InstallOutcome, SharedState, SimRoot};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "gpu-sim",
    version,
    about = "Simulated NVIDIA GPU node for machines without a GPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Lay out a fake driver installation (libraries, ld.so.cache, nvidia-smi,
    /// device nodes, shared state) under ROOT. Idempotent.
    Install {
        /// Node description (TOML), e.g. config/nodes/sim-1gpu.toml.
        #[arg(long)]
        node: PathBuf,
        /// Directory to install into; created if missing.
        #[arg(long)]
        root: PathBuf,
        /// Directory holding the built libcuda.so, libnvidia_ml.so and
        /// nvidia-smi. Defaults to the directory of this executable.
        #[arg(long)]
        artifacts: Option<PathBuf>,
        /// Also create the device nodes (nvidiaN, nvidiactl, nvidia-uvm, the
        /// sim's 1:3) in this host directory [default: /dev], where kubelet
        /// and the container runtime look for the paths a device plugin's
        /// Allocate response names. Existing files (a real driver's 195:N
        /// nodes) are never replaced, only reported.
        #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = "/dev")]
        host_dev: Option<PathBuf>,
    },
    /// Inject an Xid error on one GPU; nvmlEventSetWait returns it.
    Xid {
        #[arg(long)]
        root: PathBuf,
        /// GPU index in the node description.
        #[arg(long)]
        gpu: usize,
        /// Xid code, e.g. 79 (GPU has fallen off the bus) or 48 (double-bit ECC).
        #[arg(long)]
        code: u32,
    },
    /// The whole system on one simulated node: installs it, starts
    /// gpu-manager with the kubelet and API server emulators, admits the
    /// sample pods, runs their workloads under the interposer (Docker, or
    /// mount namespaces), measures them, prints the graph, usage and
    /// metrics, and cleans up. Exits 1 if a check fails.
    Demo {
        /// Node description [default: config/nodes/sim-4gpu-pcie.toml].
        #[arg(long)]
        node: Option<PathBuf>,
        /// Pod manifests, workloads in its workloads/ [default: config/samples].
        #[arg(long)]
        samples: Option<PathBuf>,
        /// Built binaries and libraries [default: this executable's directory].
        #[arg(long)]
        artifacts: Option<PathBuf>,
        /// Where workloads run: auto (Docker if an engine answers, else
        /// processes in mount namespaces), docker, namespaces.
        #[arg(long, default_value = "auto")]
        runtime: String,
        /// Seconds to measure the workloads.
        #[arg(long, default_value_t = 6)]
        seconds: u64,
        /// Keep the work dir (logs, vm dirs) afterwards.
        #[arg(long)]
        keep: bool,
    },
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("gpu-sim: error: {e:#}");
        std::process::exit(1);
    }
}

fn own_dir() -> Result<PathBuf> {
    Ok(std::env::current_exe()
        .context("locating gpu-sim's own directory")?
        .parent()
        .context("gpu-sim has no parent directory")?
        .to_path_buf())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Demo {
            node,
            samples,
            artifacts,
            runtime,
            seconds,
            keep,
        } => {
            let mut opts = vcuda_demo::Options::with_defaults(match artifacts {
                Some(a) => a,
                None => own_dir()?,
            });
            if let Some(n) = node {
                opts.node = n;
            }
            if let Some(s) = samples {
                opts.samples = s;
            }
            opts.runtime = match runtime.as_str() {
                "auto" => vcuda_demo::RuntimeChoice::Auto,
                "docker" => vcuda_demo::RuntimeChoice::Docker,
                "namespaces" => vcuda_demo::RuntimeChoice::Namespaces,
                other => bail!("--runtime {other:?}: expected auto, docker or namespaces"),
            };
            opts.measure = std::time::Duration::from_secs(seconds.max(1));
            opts.keep = keep;
            let outcome = match vcuda_demo::run(&opts) {
                Ok(o) => o,
                // Cleaned up already; the shell's convention for Ctrl-C.
                Err(vcuda_demo::DemoError::Interrupted) => std::process::exit(130),
                Err(e) => return Err(e.into()),
            };
            if !outcome.passed() {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Install {
            node,
            root,
            artifacts,
            host_dev,
        } => {
            let artifacts = match artifacts {
                Some(a) => a,
                None => std::env::current_exe()
                    .context("locating gpu-sim's own directory")?
                    .parent()
                    .context("gpu-sim has no parent directory")?
                    .to_path_buf(),
            };
            let report = install::install(&node, &root, &artifacts, host_dev.as_deref())?;
            let n = &report.node;
            let state = match report.state {
                InstallOutcome::Created => "created",
                InstallOutcome::Kept => "kept (same node description)",
                InstallOutcome::Replaced => "replaced (node description changed)",
            };
            println!(
                "installed {} ({} GPU{}, driver {}, CUDA {}) under {}; shared state {state}",
                n.name,
                n.gpus.len(),
                if n.gpus.len() == 1 { "" } else { "s" },
                n.driver_version,
                n.cuda_version_string(),
                root.display()
            );
            for (path, what) in &report.host_dev {
                match what {
                    install::HostDev::Created => {
                        println!("host device node {} created (1:3)", path.display())
                    }
                    install::HostDev::Kept => {
                        println!("host device node {} kept (1:3)", path.display())
                    }
                    install::HostDev::LeftAlone(d) => eprintln!(
                        "gpu-sim: warning: {} exists ({d}); left alone",
                        path.display()
                    ),
                }
            }
            if !report.device_nodes_are_char_devices {
                eprintln!(
                    "gpu-sim: warning: no permission to create character devices; \
                     device nodes are regular files and cannot be passed to containers"
                );
            }
            Ok(())
        }
        Command::Xid { root, gpu, code } => {
            let state = SharedState::open(&SimRoot::new(&root))?;
            if gpu >= state.gpu_count() {
                bail!(
                    "--gpu {gpu}: the node has {} GPUs (0..{})",
                    state.gpu_count(),
                    state.gpu_count() - 1
                );
            }
            let seq = state.inject_xid(gpu, code);
            println!("injected Xid {code} on GPU {gpu} (event {seq})");
            Ok(())
        }
    }
}
