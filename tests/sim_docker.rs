//! The simulated driver inside a real Docker container: a process in the
//! container allocates, and the host's view (the shared state NVML reads, and
//! nvidia-smi) reports it under its host PID, as the real driver does.

use gpu_sim_core::{SharedState, SimRoot};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::{Duration, Instant};
use test_support::{Docker, SimNode, compile_c};

/// `docker run` arguments for a busybox container that runs `bin/hold_memory`
/// on the simulated node with `devices` passed in, as the device plugin's
/// response would: the driver libraries at /usr/local/nvidia/lib64 and the
/// simulator's state at /run/gpu-sim (where the simulated driver looks).
fn run_args(
    docker: &Docker,
    node: &SimNode,
    bin: &Path,
    devices: &[&str],
    extra: &[&str],
) -> Vec<String> {
    let root = node.root().to_str().unwrap();
    let mut args: Vec<String> = ["run", "--rm", "--network", "none"]
        .map(String::from)
        .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    for d in devices {
        args.push("--device".into());
        args.push(format!("{root}/dev/{d}:/dev/{d}"));
    }
    args.extend(Docker::glibc_mounts());
    args.extend([
        "-v".into(),
        format!("{}:/usr/local/nvidia/lib64:ro", node.lib_dir().display()),
        "-v".into(),
        format!("{root}/run/gpu-sim:/run/gpu-sim"),
        "-v".into(),
        format!("{}:/work:ro", bin.display()),
        "-e".into(),
        "LD_LIBRARY_PATH=/usr/local/nvidia/lib64".into(),
        docker.image.clone(),
        "/work/hold_memory".into(),
    ]);
    args
}

#[test]
fn container_process_is_reported_under_its_host_pid() {
    let Some(docker) = Docker::get() else { return };
    let node = SimNode::install("sim-1gpu");
    let bin = tempfile::tempdir().unwrap();
    compile_c("hold_memory", &node, bin.path());

    let name = format!("vcuda-sim-{}", std::process::id());
    let mut args = run_args(
        &docker,
        &node,
        bin.path(),
        &["nvidia0", "nvidiactl", "nvidia-uvm"],
        &["-i", "--name", &name],
    );
    args.push("96".into());
    let mut child = docker
        .command()
        .args(&args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.starts_with("pid="), "container program said: {line:?}");
    assert!(line.contains("allocated_mib=96"), "{line}");
    // Inside its own PID namespace the program is PID 1.
    assert!(line.starts_with("pid=1 "), "{line}");

    let host_pid: u32 = docker
        .ok(&["inspect", "--format", "{{.State.Pid}}", &name])
        .parse()
        .unwrap();
    assert!(host_pid > 1);

    let state = SharedState::open(&SimRoot::new(node.root())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let procs = loop {
        let p = state.processes(0);
        if !p.is_empty() || Instant::now() > deadline {
            break p;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].host_pid, Some(host_pid), "{procs:?}");
    assert_eq!(procs[0].ns_pid, 1);
    // Its 96 MiB, and its context (overhead and 8 MiB heap).
    let used = (96 << 20) + state.node().gpus[0].context_overhead_bytes() + (8 << 20);
    assert_eq!(procs[0].used_bytes, used);
    assert_eq!(state.memory_used(0), used);

    // The simulated nvidia-smi on the host shows the same PID.
    let smi = std::process::Command::new(node.root().join("usr/bin/nvidia-smi"))
        .env("LD_LIBRARY_PATH", node.lib_dir())
        .output()
        .unwrap();
    let smi_out = String::from_utf8_lossy(&smi.stdout);
    assert!(
        smi.status.success(),
        "nvidia-smi: {}",
        String::from_utf8_lossy(&smi.stderr)
    );
    assert!(
        smi_out.contains(&host_pid.to_string()),
        "nvidia-smi does not list {host_pid}:\n{smi_out}"
    );

    // Closing stdin makes the program free and exit; the memory is back.
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success());
    assert_eq!(state.memory_used(0), 0);
    assert!(state.processes(0).is_empty());
}

#[test]
fn container_without_the_device_node_sees_no_gpu() {
    let Some(docker) = Docker::get() else { return };
    let node = SimNode::install("sim-1gpu");
    let bin = tempfile::tempdir().unwrap();
    compile_c("hold_memory", &node, bin.path());
    // nvidiactl but no /dev/nvidia0.
    let args = run_args(&docker, &node, bin.path(), &["nvidiactl"], &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = docker.cli(&args).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("FAIL cuDeviceGet") || stdout.contains("FAIL cuInit"),
        "expected no visible device, got: {stdout}"
    );
}
