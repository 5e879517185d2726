//! `vcuda-demo`: the whole system on one simulated GPU node (see the
//! library). A thin binary: flags in, [`vcuda_demo::run`], exit status out.

use std::path::PathBuf;

use clap::Parser;

/// The whole system on one simulated node: installs it, starts gpu-manager
/// with the kubelet and API server emulators, admits the sample pods, runs
/// their workloads under the interposer (Docker, or mount namespaces),
/// measures them, prints the graph, usage and metrics, and cleans up.
/// Exits 1 if a check fails, 130 after Ctrl-C.
#[derive(Parser)]
#[command(name = "vcuda-demo", version)]
struct Args {
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
}

fn fail(msg: &str) -> ! {
    eprintln!("vcuda-demo: error: {msg}");
    std::process::exit(1);
}

fn main() {
    let a = Args::parse();
    let artifacts = match a.artifacts {
        Some(p) => p,
        None => std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(PathBuf::from))
            .unwrap_or_else(|| fail("cannot locate this executable's directory; pass --artifacts")),
    };
    let mut opts = vcuda_demo::Options::with_defaults(artifacts);
    if let Some(n) = a.node {
        opts.node = n;
    }
    if let Some(s) = a.samples {
        opts.samples = s;
    }
    opts.runtime = match a.runtime.as_str() {
        "auto" => vcuda_demo::RuntimeChoice::Auto,
        "docker" => vcuda_demo::RuntimeChoice::Docker,
        "namespaces" => vcuda_demo::RuntimeChoice::Namespaces,
        other => fail(&format!(
            "--runtime {other:?}: expected auto, docker or namespaces"
        )),
    };
    opts.measure = std::time::Duration::from_secs(a.seconds.max(1));
    opts.keep = a.keep;
    match vcuda_demo::run(&opts) {
        Ok(o) if o.passed() => {}
        Ok(_) => std::process::exit(1),
        // Cleaned up already; the shell's convention for Ctrl-C.
        Err(vcuda_demo::DemoError::Interrupted) => std::process::exit(130),
        Err(e) => fail(&e.to_string()),
    }
}
