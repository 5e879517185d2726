//! `gpu-sim`: the simulated GPU node's command-line tool.

mod install;
mod mig;

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
        /// The MIG GPU instance the error is in (NVML's event then names
        /// it, as the driver does for errors inside an instance).
        #[arg(long)]
        gpu_instance: Option<u32>,
        /// Its compute instance [default: 0].
        #[arg(long, requires = "gpu_instance")]
        compute_instance: Option<u32>,
    },
    /// MIG on one GPU, as `nvidia-smi -mig 1` and `nvidia-smi mig -cgi
    /// <ids> -C`: enable the mode, create GPU instances (each with one
    /// compute instance spanning it), then list the MIG devices and UUIDs.
    Mig {
        #[arg(long)]
        root: PathBuf,
        /// GPU index in the node description.
        #[arg(long)]
        gpu: usize,
        /// Enable MIG mode first (applies at once on an idle GPU).
        #[arg(long)]
        enable: bool,
        /// GPU-instance profile ids to create, e.g. 19,9 (1g.10gb, 3g.40gb
        /// on an H100 80GB; `nvidia-smi mig -lgip` lists them).
        #[arg(long, value_delimiter = ',')]
        create: Vec<u32>,
    },
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("gpu-sim: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
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
        Command::Xid {
            root,
            gpu,
            code,
            gpu_instance,
            compute_instance,
        } => {
            let state = SharedState::open(&SimRoot::new(&root))?;
            if gpu >= state.gpu_count() {
                bail!(
                    "--gpu {gpu}: the node has {} GPUs (0..{})",
                    state.gpu_count(),
                    state.gpu_count() - 1
                );
            }
            let instance = gpu_instance.map(|gi| (gi, compute_instance.unwrap_or(0)));
            let seq = state.inject_xid_in(gpu, code, instance);
            match instance {
                None => println!("injected Xid {code} on GPU {gpu} (event {seq})"),
                Some((gi, ci)) => println!(
                    "injected Xid {code} on GPU {gpu}, GPU instance {gi}, compute instance {ci} (event {seq})"
                ),
            }
            Ok(())
        }
        Command::Mig {
            root,
            gpu,
            enable,
            create,
        } => {
            let state = SharedState::open(&SimRoot::new(&root))?;
            mig::run(&state, gpu, enable, &create)
        }
    }
}
