//! Issue 24: a rolling update with surge in device-plugin mode. The new
//! manager starts beside the old one on the same node (same checkpoint,
//! vm directories, display socket, kubelet), registers under its own
//! socket names and holds Allocate until the old one has handed the state
//! over; the old one, stopping afterwards, leaves the node's allocatable
//! alone. The kubelet emulator behaves as kubelet ≥ 1.26 does
//! (`pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go`, `runClient`):
//! were the old manager's streams to end it would disconnect the *newest*
//! registration; the old manager hands its kubelet connections to the new
//! one, so they never end.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use test_support::cmdline;
use test_support::manager::{Env, NODE, Options, VCORE, VMEM};

/// `sig` to a manager: its supervisor and the manager it runs.
fn signal(child: &Child, sig: i32) {
    for pid in test_support::process::tree(child.id()) {
        // SAFETY: a signal to our own child and its children.
        unsafe { libc::kill(pid as i32, sig) };
    }
}

/// The same command line as `env`'s manager, logging to `log`.
fn start_beside(env: &Env, log: &Path) -> Child {
    let args = cmdline(env.manager.id());
    Command::new(&args[0])
        .args(&args[1..])
        .env("RUST_LOG", "info,gpu_manager=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Stops the second manager however the test ends.
struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// SIGTERM to the old manager; returns once it has exited (10 s at most).
async fn stop_old(manager: &mut Child) {
    signal(manager, libc::SIGTERM);
    let t = Instant::now();
    while manager.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the old manager did not stop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_text(path: &Path, needle: &str) -> String {
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no {needle:?} in {}:\n{text}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn endpoint(env: &Env, resource: &str) -> Option<String> {
    let v = env.kubelet.view().borrow().clone();
    v.resources
        .get(resource)
        .filter(|r| r.connected)
        .map(|r| r.endpoint.clone())
}

fn allocatable(env: &Env) -> serde_json::Value {
    env.api.node(NODE).unwrap()["status"]["allocatable"][VCORE].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_started_beside_the_old_one_takes_over_and_no_call_fails() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let p1 = env.pod(&[("main", 30, 4)], &[]);
    env.admit(&p1, "main", 30, 4).await.unwrap();
    let old_vcore = endpoint(&env, VCORE).unwrap();
    assert!(
        old_vcore.starts_with("vcore-") && old_vcore != "vcore.sock",
        "each start names its own socket: {old_vcore}"
    );

    // The old manager is frozen, so it cannot hand over yet: the new one
    // must register and then hold kubelet's calls.
    signal(&env.manager, libc::SIGSTOP);
    let new_log = env.tmp.path().join("new-manager.log");
    let mut new = Stop(start_beside(&env, &new_log));
    env.kubelet
        .wait_for(Duration::from_secs(30), |v| {
            [VCORE, VMEM].iter().all(|r| {
                v.resources
                    .get(*r)
                    .is_some_and(|x| x.connected && !x.endpoint.ends_with(&old_vcore[6..]))
            })
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the new manager never registered beside the old one:\n{}",
                std::fs::read_to_string(&new_log).unwrap_or_default()
            )
        });
    wait_text(&new_log, "another manager owns this node's state").await;
    assert!(
        Path::new(&env.display_socket).exists(),
        "the display socket was taken over"
    );
    let p2 = env.pod(&[("main", 20, 2)], &[]);
    let kubelet = env.kubelet.clone();
    let p2c = p2.clone();
    let admit =
        tokio::spawn(async move { kubelet.admit(&p2c, "main", &[(VCORE, 20), (VMEM, 2)]).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !admit.is_finished(),
        "the new manager answered Allocate before it owned the state"
    );

    // Thawed, the old one sees its successor and hands over; the held
    // Allocate is answered from the state it left.
    signal(&env.manager, libc::SIGCONT);
    tokio::time::timeout(Duration::from_secs(10), admit)
        .await
        .expect("the held Allocate was never answered")
        .unwrap()
        .expect("the held Allocate failed");
    wait_text(&env.log, "handed over; serving the running shares").await;
    wait_text(&new_log, "the previous manager handed the node over").await;
    let allocs = env.allocations_by_container();
    assert!(
        allocs.keys().any(|k| k.contains(&p1.uid)) && allocs.keys().any(|k| k.contains(&p2.uid)),
        "the checkpoint holds the old manager's allocation and the new one's: {allocs:?}"
    );
    // The old one answers nothing any more, with a reason.
    let old = env.kubelet.dir().join(&old_vcore);
    let ch = device_plugin::connect_unix(&old, Duration::from_secs(2))
        .await
        .unwrap();
    let e = vcuda_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient::new(ch)
        .allocate(vcuda_api::deviceplugin::v1beta1::AllocateRequest {
            container_requests: vec![vcuda_api::deviceplugin::v1beta1::ContainerAllocateRequest {
                devices_ids: vec!["vcore-1-00".into()],
            }],
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("handed the node over"), "{e:?}");

    // The old one stops (its pod deleted). It handed kubelet's connections
    // to the new one, so its streams do not end and kubelet (≥ 1.26, as
    // emulated) keeps the new registration; the node's allocatable is not
    // written to 0.
    wait_text(&env.log, "kubelet's connections handed over").await;
    wait_text(
        &new_log,
        "kept kubelet's connections to the previous manager open",
    )
    .await;
    let before = allocatable(&env);
    assert_ne!(before, serde_json::json!("0"));
    let regs = env.kubelet.view().borrow().resources[VCORE].registrations;
    stop_old(&mut env.manager).await;
    let old_text = wait_text(&env.log, "leaving kubelet's connections open").await;
    assert!(!old_text.contains("vcuda allocatable written node=sim-node vcore=0"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let v = env.kubelet.view().borrow().resources[VCORE].clone();
    let new_text = std::fs::read_to_string(&new_log).unwrap_or_default();
    assert!(
        v.connected && v.registrations == regs && !new_text.contains("kubelet dropped"),
        "kubelet dropped the new manager when the old one stopped ({} registrations, were {regs}):\n{new_text}\nthe old one:\n{}",
        v.registrations,
        env.log_text()
    );
    assert_eq!(allocatable(&env), before);
    assert!(
        Path::new(&env.display_socket).exists(),
        "the old manager removed the new one's display socket"
    );
    let p3 = env.pod(&[("main", 10, 1)], &[]);
    env.admit(&p3, "main", 10, 1).await.unwrap();

    // From here Env's drop stops the new manager (with SIGTERM).
    std::mem::swap(&mut env.manager, &mut new.0);
}

/// A new version that dies once it has taken over (a crash after its
/// registration): the old manager, still running, takes the node back,
/// with what the new one allocated, and kubelet calls it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_manager_takes_the_node_back_when_the_new_one_dies() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let p1 = env.pod(&[("main", 30, 4)], &[]);
    env.admit(&p1, "main", 30, 4).await.unwrap();
    let old_vcore = endpoint(&env, VCORE).unwrap();
    let new_log = env.tmp.path().join("new-manager.log");
    let mut new = Stop(start_beside(&env, &new_log));
    wait_text(&new_log, "the previous manager handed the node over").await;
    let p2 = env.pod(&[("main", 20, 2)], &[]);
    env.admit(&p2, "main", 20, 2).await.unwrap();
    assert_ne!(endpoint(&env, VCORE).as_deref(), Some(old_vcore.as_str()));

    new.0.kill().unwrap();
    let _ = new.0.wait();
    wait_text(&env.log, "taking it back").await;
    env.kubelet
        .wait_for(Duration::from_secs(10), |v| {
            v.resources
                .get(VCORE)
                .is_some_and(|r| r.connected && r.endpoint == old_vcore)
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "kubelet does not call the old manager again:\n{}",
                env.log_text()
            )
        });
    let p3 = env.pod(&[("main", 10, 1)], &[]);
    env.admit(&p3, "main", 10, 1).await.unwrap();
    let allocs = env.allocations_by_container();
    for p in [&p1, &p2, &p3] {
        assert!(
            allocs.keys().any(|k| k.contains(&p.uid)),
            "{} missing from the checkpoint: {allocs:?}",
            p.name
        );
    }
    // The display socket the dead one had taken over is served again.
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&env.display_socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "nobody serves the display socket"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The MIG plugins (served by the manager itself, not its supervisor)
/// through the same rolling update: the old manager hands its kubelet
/// connections to those over too, so when it stops the kubelet (≥ 1.26,
/// as emulated) keeps the new manager's MIG registrations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mig_plugins_survive_a_rolling_update() {
    const MIG: [&str; 2] = ["tencent.com/mig-1g.10gb", "tencent.com/mig-3g.40gb"];
    let mut env = Env::start(
        "sim-mig-h100",
        Options {
            prepare: Some(test_support::sim::SimNode::mig_3g_and_1g),
            ..Default::default()
        },
    )
    .await;
    // Env::start waits for vcuda-core and vcuda-memory only; the MIG
    // plugins register on their own a moment later.
    env.kubelet
        .wait_for(Duration::from_secs(30), |v| {
            MIG.iter()
                .all(|r| v.resources.get(*r).is_some_and(|x| x.connected))
        })
        .await
        .unwrap_or_else(|_| panic!("the MIG plugins never registered:\n{}", env.log_text()));
    let old: Vec<String> = MIG.iter().map(|r| endpoint(&env, r).unwrap()).collect();
    let new_log = env.tmp.path().join("new-manager.log");
    let mut new = Stop(start_beside(&env, &new_log));
    let moved = |v: &kubelet_emulator::View| {
        MIG.iter().zip(&old).all(|(r, o)| {
            v.resources
                .get(*r)
                .is_some_and(|x| x.connected && x.endpoint != *o)
        })
    };
    env.kubelet
        .wait_for(Duration::from_secs(30), moved)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no new MIG registration:\n{}",
                std::fs::read_to_string(&new_log).unwrap_or_default()
            )
        });
    wait_text(&env.log, "kubelet's connections handed over").await;
    let regs: Vec<u64> = MIG
        .iter()
        .map(|r| env.kubelet.view().borrow().resources[*r].registrations)
        .collect();
    stop_old(&mut env.manager).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let v = env.kubelet.view().borrow().clone();
    for (r, n) in MIG.iter().zip(&regs) {
        let x = &v.resources[*r];
        assert!(
            x.connected && x.registrations == *n && x.healthy_ids().len() == 1,
            "{r}: kubelet dropped the new manager's registration when the old one stopped:\n{}\nthe old one:\n{}",
            std::fs::read_to_string(&new_log).unwrap_or_default(),
            env.log_text()
        );
    }
    std::mem::swap(&mut env.manager, &mut new.0);
}
