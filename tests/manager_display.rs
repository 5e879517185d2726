//! The display service wired into the real manager: the `gpu-manager`
//! binary on a simulated node (see test-support's `manager`), its HTTP query port
//! (`/readyz`, `/graph`, `/usage`, `/metrics`) and `vcudactl` on its
//! display socket. Needs `cargo build --workspace` first.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use test_support::manager::{Env, Options, VCORE};
use test_support::{http_get, target_dir};

/// The value of the one sample of `name` whose labels include all of `labels`.
fn sample(metrics: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

fn vcudactl(socket: &Path, args: &[&str]) -> String {
    let exe = target_dir().join("vcudactl");
    assert!(
        exe.is_file(),
        "{} missing: cargo build --workspace",
        exe.display()
    );
    let out = Command::new(exe)
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vcudactl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_serves_graph_usage_metrics_and_vcudactl() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let addr = env.http_addr;
    assert!(
        env.display_socket.exists(),
        "no display socket at {}",
        env.display_socket.display()
    );

    // Live from the start; ready once the plugins registered.
    let (code, _) = tokio::task::spawn_blocking(move || http_get(addr, "/healthz"))
        .await
        .unwrap();
    assert_eq!(code, 200);
    let t = Instant::now();
    loop {
        let (code, _) = tokio::task::spawn_blocking(move || http_get(addr, "/readyz"))
            .await
            .unwrap();
        if code == 200 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "/readyz still {code} after registration; log:\n{}",
            env.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let share = env.pod(&[("main", 30, 4)], &[]);
    let resp = env.admit(&share, "main", 30, 4).await.unwrap();
    let share_minor = Env::minors(&resp)[0];
    let whole = env.pod(&[("w", 100, 0)], &[]);
    let resp = env.admit(&whole, "w", 100, 0).await.unwrap();
    let whole_minor = Env::minors(&resp)[0];
    assert_ne!(share_minor, whole_minor);
    assert!(resp[VCORE].annotations.contains_key(VCORE));
    // Refused: no pod asks for this.
    let ghost = kubelet_emulator::PodRef {
        uid: "ghost".into(),
        name: "ghost".into(),
        namespace: "default".into(),
    };
    env.admit(&ghost, "main", 42, 1).await.unwrap_err();

    // The share's ledger, counted into as its interposers would: 1.5 s
    // asleep for compute tokens, two allocations refused.
    let l = test_support::ledger::live(&env.vm_dir().join(&share.uid).join("main"), 0);
    l.add_throttled_ns(1_500_000_000);
    l.add_qos_held_ns(250_000_000);
    l.count_refused_allocation();
    l.count_refused_allocation();

    let sock = env.display_socket.clone();
    let (share_name, whole_name) = (share.name.clone(), whole.name.clone());
    let (share_uid, whole_uid) = (share.uid.clone(), whole.uid.clone());
    tokio::task::spawn_blocking(move || {
        // /graph: the allocator's tree with the share's cores and the whole GPU.
        let (code, graph) = http_get(addr, "/graph");
        assert_eq!(code, 200);
        let line = |minor: u32| {
            graph
                .lines()
                .find(|l| l.contains(&format!("/dev/nvidia{minor} ")))
                .unwrap_or_else(|| panic!("no /dev/nvidia{minor} in /graph:\n{graph}"))
                .to_string()
        };
        assert!(
            line(share_minor).contains("cores 30/100 used")
                && line(share_minor).contains("memory 1024/"),
            "{graph}"
        );
        assert!(
            line(whole_minor).contains("cores 100/100 used")
                && line(whole_minor).contains("[whole]"),
            "{graph}"
        );

        // /usage: both containers with their quotas.
        let (code, usage) = http_get(addr, "/usage");
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_str(&usage).unwrap();
        let s = &v["usage"][&share_uid];
        assert_eq!(s["pod_name"], share_name.as_str(), "{usage}");
        assert_eq!(s["project"], "default", "{usage}");
        assert_eq!(s["spec"]["main"]["gpu"], 30.0, "{usage}");
        assert_eq!(s["spec"]["main"]["mem"], 1024.0, "{usage}");
        assert_eq!(s["stat"]["main"]["dev"].as_array().unwrap().len(), 1);
        let w = &v["usage"][&whole_uid];
        assert_eq!(w["pod_name"], whole_name.as_str(), "{usage}");
        assert_eq!(w["spec"]["w"]["gpu"], 100.0, "{usage}");
        assert!(
            w["spec"]["w"]["mem"].as_f64().unwrap() > 1024.0,
            "whole GPU's memory as quota: {usage}"
        );

        // /metrics: the manager's counters and the container gauges.
        let (code, m) = http_get(addr, "/metrics");
        assert_eq!(code, 200);
        let ok = sample(
            &m,
            "vcuda_manager_allocations_total",
            &[("resource", VCORE)],
        )
        .unwrap_or_else(|| panic!("no allocations counter:\n{m}"));
        assert!(ok >= 2.0, "{ok}\n{m}");
        let refused = sample(
            &m,
            "vcuda_manager_allocation_failures_total",
            &[("resource", VCORE), ("reason", "failed_precondition")],
        );
        assert_eq!(refused, Some(1.0), "{m}");
        assert!(
            m.contains("vcuda_manager_allocate_duration_seconds_count"),
            "{m}"
        );
        assert_eq!(sample(&m, "vcuda_manager_ready", &[]), Some(1.0), "{m}");
        assert!(
            sample(&m, "vcuda_manager_recovery_duration_seconds", &[]).is_some(),
            "{m}"
        );
        let pod = |n: &str| [("pod", n.to_string()), ("node", "sim-node".to_string())];
        let core_q = |n: &str, c: &str| {
            let p = pod(n);
            sample(
                &m,
                "vcuda_container_core_quota_ratio",
                &[(p[0].0, &p[0].1), (p[1].0, &p[1].1), ("container", c)],
            )
        };
        let mem_q = |n: &str, c: &str| {
            let p = pod(n);
            sample(
                &m,
                "vcuda_container_memory_quota_bytes",
                &[(p[0].0, &p[0].1), (p[1].0, &p[1].1), ("container", c)],
            )
        };
        assert_eq!(core_q(&share_name, "main"), Some(0.3), "{m}");
        assert_eq!(mem_q(&share_name, "main"), Some((1u64 << 30) as f64), "{m}");
        assert_eq!(core_q(&whole_name, "w"), Some(1.0), "{m}");
        assert!(
            mem_q(&whole_name, "w").unwrap_or(0.0) > (1u64 << 30) as f64,
            "{m}"
        );
        assert!(m.contains("vcuda_gpu_allocated_cores_ratio"), "{m}");
        // The ledger's counters; none for a whole GPU (no interposer, no ledger).
        let counter =
            |name: &str, pod: &str, c: &str| sample(&m, name, &[("pod", pod), ("container", c)]);
        let (thr, refd, held) = (
            "vcuda_container_throttled_seconds_total",
            "vcuda_container_allocations_refused_total",
            "vcuda_container_batch_held_seconds_total",
        );
        assert_eq!(counter(thr, &share_name, "main"), Some(1.5), "{m}");
        assert_eq!(counter(refd, &share_name, "main"), Some(2.0), "{m}");
        assert_eq!(counter(held, &share_name, "main"), Some(0.25), "{m}");
        assert_eq!(counter(thr, &whole_name, "w"), None, "{m}");
        assert_eq!(counter(refd, &whole_name, "w"), None, "{m}");
        assert_eq!(counter(held, &whole_name, "w"), None, "{m}");

        // vcudactl on the manager's socket: pods by namespace and name,
        // their UIDs with --wide.
        let t = vcudactl(&sock, &["usage"]);
        let row = |name: &str| {
            t.lines()
                .find(|l| l.split_whitespace().take(2).eq(["default", name]))
                .unwrap_or_else(|| panic!("no default/{name} in vcudactl usage:\n{t}"))
                .to_string()
        };
        assert!(row(&share_name).contains("/ 30%"), "{t}");
        assert!(row(&share_name).contains("/ 1024 MiB"), "{t}");
        assert!(row(&whole_name).contains("/ 100%"), "{t}");
        assert!(!t.contains(&share_uid), "{t}");
        let w = vcudactl(&sock, &["usage", "--wide"]);
        for (name, uid) in [(&share_name, &share_uid), (&whole_name, &whole_uid)] {
            assert!(
                w.lines()
                    .any(|l| l.split_whitespace().take(3).eq(["default", name, uid])),
                "no default/{name} {uid} in vcudactl usage --wide:\n{w}"
            );
        }
        let g = vcudactl(&sock, &["graph"]);
        assert!(g.contains("cores 30/100 used"), "{g}");

        // Anything else is 404.
        assert_eq!(http_get(addr, "/nope").0, 404);
        assert_eq!(http_get(addr, "/healthz").0, 200);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_removes_its_display_socket_on_shutdown() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let sock = env.display_socket.clone();
    assert!(sock.exists());
    // SAFETY: SIGTERM to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    let status = loop {
        if let Some(s) = env.manager.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "manager did not stop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}; log:\n{}", env.log_text());
    assert!(
        !sock.exists(),
        "display socket left behind; log:\n{}",
        env.log_text()
    );
}
