//! Benchmark harness (prints figures, asserts nothing about time): recovery
//! of a SIGKILLed manager with 100 live containers on the private Docker
//! engine. Run with `cargo build --workspace && cargo bench --profile dev -p
//! vcuda-tests --bench manager_recovery_bench` (DOCKER_HOST from
//! tests/docker/engine.sh).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use test_support::manager::{Env, Options, VCORE};
use test_support::{Docker, cmdline};

fn recovery_ms(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("recovery finished"))
        .filter_map(|l| {
            l.split("recovery_ms=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(docker) = Docker::get() else { return };
    // SAFETY: set before any other thread of this process reads the environment.
    unsafe { std::env::set_var("GPU_MANAGER_CONTAINER_RUNTIME_ENDPOINT", &docker.host) };
    let mut env = Env::start("sim-8gpu-nvlink", Options::default()).await;
    let n = 100;
    // Removes the containers also when the harness panics.
    struct Cleanup(Docker, Vec<String>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for n in &self.1 {
                let _ = self.0.cli(&["rm", "-f", n]);
            }
        }
    }
    let mut names = Cleanup(Docker::get().unwrap(), Vec::new());
    let t = Instant::now();
    for i in 0..n {
        let pod = env.pod(&[("main", 5, 1)], &[]);
        // Give the manager's pod watch a moment (API-server latency, not
        // what is measured here).
        while env.api.pod("default", &pod.name).is_none() {}
        tokio::time::sleep(Duration::from_millis(20)).await;
        let r = env.admit(&pod, "main", 5, 1).await.unwrap();
        let vm = r[VCORE]
            .mounts
            .iter()
            .find(|m| m.container_path == "/etc/vcuda")
            .unwrap();
        let name = format!("vcuda-rbench-{}-{i}", std::process::id());
        docker.ok(&[
            "run",
            "-d",
            "--network",
            "none",
            "--name",
            &name,
            "--label",
            &format!("io.kubernetes.pod.uid={}", pod.uid),
            "--label",
            &format!("io.kubernetes.pod.name={}", pod.name),
            "--label",
            "io.kubernetes.pod.namespace=default",
            "--label",
            "io.kubernetes.container.name=main",
            "--mount",
            &format!(
                "type=bind,source={},target=/etc/vcuda,readonly",
                vm.host_path
            ),
            "-e",
            &format!(
                "NVIDIA_VISIBLE_DEVICES={}",
                r[VCORE].envs["NVIDIA_VISIBLE_DEVICES"]
            ),
            &docker.image,
            "sleep",
            "3600",
        ]);
        names.1.push(name);
    }
    println!("{n} containers admitted and started in {:?}", t.elapsed());
    let args = cmdline(env.manager.id());
    for round in 0..3 {
        let regs = env.registrations();
        // SAFETY: SIGKILL to our own child, not yet reaped.
        unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
        let _ = env.manager.wait();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&env.log)
            .unwrap();
        let t = Instant::now();
        env.manager = Command::new(&args[0])
            .args(&args[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        env.wait_registered_since(regs).await;
        let spawn_to_registered = t.elapsed();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ms = recovery_ms(&env.log_text());
        println!(
            "round {round}: recovery (checkpoint + kubelet + docker + {n} vm dirs and sockets) {} ms; spawn -> re-registered {:?}; allocations {}",
            ms.last().copied().unwrap_or(0),
            spawn_to_registered,
            env.allocation_count()
        );
    }
    drop(names);
}
