//! The manager's supervisor (crates/node/gpu-manager/src/lifecycle/supervise.rs) keeps
//! the kubelet's plugin sockets, registration and connections across a
//! kill -9 of the manager it runs: the kubelet's ListAndWatch streams never
//! end (the real kubelet marks the resources unhealthy when they do, and
//! refuses the pods it admits meanwhile: pkg/kubelet/cm/devicemanager,
//! `PluginDisconnected` → `markResourceUnhealthy`), no new registration is
//! made, and an Allocate the manager dies under, or that comes while no
//! manager runs, is answered by the next one. Real gpu-manager binary on a
//! simulated node, driven by the kubelet emulator.

use std::time::{Duration, Instant};

use test_support::manager::{Env, Options, VCORE, VMEM};
use test_support::process::tree;

/// The manager run by `env`'s supervisor.
fn manager_pid(env: &Env) -> u32 {
    let t = Instant::now();
    loop {
        if let Some(&pid) = tree(env.manager.id()).get(1) {
            return pid;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the supervisor runs no manager"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: a signal to a child of our own child.
    unsafe { libc::kill(pid as i32, sig) };
}

fn log(env: &Env) -> String {
    std::fs::read_to_string(&env.log).unwrap_or_default()
}

/// Every moment the kubelet saw a resource's stream closed, or fewer
/// healthy devices than at the start, until `stop`.
fn watch_streams(
    env: &Env,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Vec<String>> {
    let mut rx = env.kubelet.view();
    let healthy0: Vec<usize> = [VCORE, VMEM]
        .map(|r| rx.borrow().resources[r].healthy_ids().len())
        .to_vec();
    tokio::spawn(async move {
        let mut seen = Vec::new();
        loop {
            {
                let v = rx.borrow_and_update();
                for (r, h0) in [VCORE, VMEM].iter().zip(&healthy0) {
                    let x = &v.resources[*r];
                    if !x.connected || x.healthy_ids().len() < *h0 {
                        seen.push(format!(
                            "{r}: connected {}, healthy {} of {h0}",
                            x.connected,
                            x.healthy_ids().len()
                        ));
                    }
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return seen },
                () = stop.cancelled() => return seen,
            }
        }
    })
}

fn registrations(env: &Env) -> Vec<u64> {
    [VCORE, VMEM]
        .map(|r| env.kubelet.view().borrow().resources[r].registrations)
        .to_vec()
}

/// What the kubelet must not see while a manager dies: a stream end, a
/// device lost, a new registration.
struct Unbroken {
    stop: tokio_util::sync::CancellationToken,
    watcher: tokio::task::JoinHandle<Vec<String>>,
    registrations: Vec<u64>,
}

impl Unbroken {
    fn watch(env: &Env) -> Unbroken {
        let stop = tokio_util::sync::CancellationToken::new();
        Unbroken {
            watcher: watch_streams(env, stop.clone()),
            stop,
            registrations: registrations(env),
        }
    }

    /// Stops watching and asserts; `text` (the manager's log) in failures.
    async fn check(self, env: &Env, text: &str) {
        self.stop.cancel();
        let closed = self.watcher.await.unwrap();
        assert!(
            closed.is_empty(),
            "the kubelet saw its streams end or lose devices: {closed:?}\n{text}"
        );
        assert_eq!(
            registrations(env),
            self.registrations,
            "the plugins registered again"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_manager_loses_no_call_and_the_kubelet_sees_no_stream_end() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let p1 = env.pod(&[("main", 30, 4)], &[]);
    env.admit(&p1, "main", 30, 4).await.unwrap();
    let unbroken = Unbroken::watch(&env);

    // The manager holds an Allocate (stopped) and dies under it.
    let first = manager_pid(&env);
    kill(first, libc::SIGSTOP);
    let p2 = env.pod(&[("main", 20, 2)], &[]);
    let held = {
        let (kubelet, p2) = (env.kubelet.clone(), p2.clone());
        tokio::spawn(async move { kubelet.admit(&p2, "main", &[(VCORE, 20), (VMEM, 2)]).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!held.is_finished(), "a stopped manager answered");
    let killed = Instant::now();
    kill(first, libc::SIGKILL);
    // A pod admitted while no manager runs waits for the next one.
    let p3 = env.pod(&[("main", 10, 1)], &[]);
    let r3 = env.admit(&p3, "main", 10, 1).await;
    let r2 = tokio::time::timeout(Duration::from_secs(30), held)
        .await
        .expect("the held Allocate was never answered")
        .unwrap();
    let waited = killed.elapsed();
    let text = log(&env);
    r2.unwrap_or_else(|e| panic!("the held Allocate failed: {e}\n{text}"));
    r3.unwrap_or_else(|e| panic!("the Allocate during the restart failed: {e}\n{text}"));
    assert!(
        text.contains("answered by the next manager process"),
        "the held call was not relayed to the next manager:\n{text}"
    );
    let second = manager_pid(&env);
    assert_ne!(first, second, "the supervisor started no new manager");

    // Both share pods are booked once, on the state the first one left.
    let p4 = env.pod(&[("main", 100, 0)], &[]);
    env.admit(&p4, "main", 100, 0).await.unwrap();
    unbroken.check(&env, &text).await;
    eprintln!(
        "killed manager {first} → held and new Allocate answered {} ms after the kill, by manager {second}",
        waited.as_millis()
    );

    // SIGTERM: the supervisor stops its manager, then removes its sockets.
    kill(env.manager.id(), libc::SIGTERM);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = env.manager.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "SIGTERM did not stop the supervisor"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}\n{}", log(&env));
    eprintln!(
        "SIGTERM → supervisor exited in {} ms",
        t.elapsed().as_millis()
    );
    let left: Vec<_> = std::fs::read_dir(env.tmp.path().join("device-plugins"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("vcore-") || n.starts_with("vmemory-"))
        .collect();
    assert!(left.is_empty(), "plugin sockets left: {left:?}");
    assert!(
        !std::path::Path::new(&format!("/proc/{second}")).exists(),
        "the manager outlived its supervisor"
    );
}

/// A hung manager (stopped here, as a deadlock or a stuck syscall leaves
/// it) stops its heartbeat; its supervisor kills it after
/// `supervise::HUNG` (10 s) and the call it held is answered by the next
/// one, the kubelet's streams open throughout. Left to the kubelet's
/// liveness probe, the whole container would be killed, which refuses the
/// pods admitted until it is back (docs/architecture.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_manager_is_killed_by_its_supervisor_and_its_call_answered_by_the_next() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let unbroken = Unbroken::watch(&env);
    let hung = manager_pid(&env);
    kill(hung, libc::SIGSTOP);
    let stopped = Instant::now();
    let p = env.pod(&[("main", 20, 2)], &[]);
    let r = tokio::time::timeout(Duration::from_secs(30), env.admit(&p, "main", 20, 2))
        .await
        .unwrap_or_else(|_| panic!("the held Allocate was never answered:\n{}", log(&env)));
    let waited = stopped.elapsed();
    let text = log(&env);
    r.unwrap_or_else(|e| panic!("the held Allocate failed: {e}\n{text}"));
    assert!(
        text.contains("the manager is hung (no heartbeat): killing it"),
        "the supervisor did not kill the hung manager:\n{text}"
    );
    assert_ne!(manager_pid(&env), hung, "the hung manager still runs");
    assert!(
        waited >= Duration::from_secs(9),
        "answered after {waited:?}: before the hang limit, so not by the next manager"
    );
    unbroken.check(&env, &text).await;
    eprintln!(
        "hung manager {hung} → killed and its call answered {} ms after it stopped",
        waited.as_millis()
    );
}

/// A manager that fails before the kubelet ever registered it (here: no
/// device-plugin directory) is not restarted: its supervisor exits with
/// its status, so the pod shows the error.
#[test]
fn a_manager_failing_at_start_ends_its_supervisor_with_its_error() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-device-plugins");
    let out = std::process::Command::new(test_support::paths::target_dir().join("gpu-manager"))
        .arg("--device-plugin-path")
        .arg(&missing)
        .arg("--checkpoint-path")
        .arg(tmp.path().join("checkpoint"))
        .arg("--query-port")
        .arg("0")
        .arg("--display-socket")
        .arg(tmp.path().join("display.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{} does not exist", missing.display())),
        "the manager's error is not shown: {err}"
    );
    assert!(
        err.contains("exited before the kubelet registered it"),
        "the supervisor did not say why it stopped: {err}"
    );
}

/// A manager started while the node's DRA driver is still serving (a mode
/// switch: the driver's DaemonSet deleted, its process stopping) waits for
/// the driver's registration socket to close, then starts and registers;
/// it is not refused (the driver side: dra-driver's supervisor tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_started_beside_a_stopping_dra_driver_waits_for_it() {
    fn stopping_driver(dir: &std::path::Path) {
        let reg = dir.join("plugins_registry");
        std::fs::create_dir_all(&reg).unwrap();
        let name = node_agent::mode::dra_registration_socket("1764245000000-9-0");
        let driver = std::os::unix::net::UnixListener::bind(reg.join(name)).unwrap();
        // Its sockets close 3 s later (well within the manager's patience).
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(3));
            drop(driver);
        });
    }
    let env = Env::start(
        "sim-1gpu",
        Options {
            beside: Some(stopping_driver),
            ..Default::default()
        },
    )
    .await;
    let log = env.log_text();
    assert!(log.contains("waiting for it to stop"), "{log}");
    assert!(!log.contains("still serving after"), "{log}");
    assert!(
        env.started.elapsed() >= Duration::from_secs(3),
        "registered only once the driver's socket closed"
    );
}
