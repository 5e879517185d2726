//! MIG devices whose instance is destroyed under a pod (docs/mig.md, *An
//! instance destroyed under a pod*): while the manager runs, and while
//! none runs.

use std::time::{Duration, Instant};

use super::{destroy, rescanning_3g_and_1g};
use test_support::manager::Env;

/// An operator destroys the 1g.10gb under a pod that holds it (its
/// program done): the manager keeps it advertised, Unhealthy (so the
/// kubelet counts none allocatable and shows the pod's device unhealthy),
/// the pod gets a `VcudaMigDeviceLost` Event naming the instance, and
/// `/metrics` shows `vcuda_mig_device_lost`; once the kubelet's `List` no
/// longer names a holder it is withdrawn. The build before withdrew it at
/// once and told nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_destroyed_under_a_pod_stays_unhealthy_and_the_pod_is_told() {
    let mut env = rescanning_3g_and_1g().await;
    let resource = "tencent.com/mig-1g.10gb";
    let pod = holding_the_1g(&mut env).await;
    let small = destroy(&env, "1g.10gb");
    let t = Instant::now();
    let ev = listed_lost_and_told(&env, &pod.name, &small.uuid).await;
    let note = ev["note"].as_str().unwrap_or_default();
    assert!(
        note.contains(&small.uuid) && note.contains(resource),
        "{ev}"
    );
    assert_eq!(ev["regarding"]["uid"], pod.uid.as_str(), "{ev}");
    println!(
        "a 1g.10gb destroyed under a pod: Unhealthy and the pod told {} ms after (rescan every 1 s)",
        t.elapsed().as_millis()
    );
    let (_, metrics) = test_support::process::http_get(env.http_addr, "/metrics");
    let line = metrics
        .lines()
        .find(|l| l.starts_with("vcuda_mig_device_lost{"))
        .unwrap_or_else(|| panic!("no vcuda_mig_device_lost in\n{metrics}"));
    assert!(line.contains(&small.uuid) && line.ends_with(" 1"), "{line}");

    // The pod gone (the kubelet's List no longer names it): withdrawn.
    env.kubelet.release_pod(&pod.uid).unwrap();
    let gone = env
        .kubelet
        .wait_for(Duration::from_secs(20), |v| {
            v.resources
                .get(resource)
                .is_some_and(|r| !r.devices.contains_key(&small.uuid))
        })
        .await;
    assert!(gone.is_ok(), "withdrawn\n{}", env.log_text());
}

/// The same destruction while no manager runs (kill -9, the instance
/// destroyed, a manager started again without rescans): the new manager
/// never finds the instance in NVML, but its predecessor's record
/// (`mig-served.json`) lists it, so it is advertised Unhealthy and the pod
/// holding it is told at start. The build before never listed it and told
/// nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_destroyed_while_no_manager_ran_is_reported_at_start() {
    let mut env = rescanning_3g_and_1g().await;
    let pod = holding_the_1g(&mut env).await;
    let mut args = test_support::cmdline(env.manager.id());
    let at = args
        .iter()
        .position(|a| a == "--mig-rescan-period")
        .unwrap();
    args[at + 1] = "0".into();
    let regs = env.registrations();
    let big = "tencent.com/mig-3g.40gb";
    let big_regs = env.kubelet.view().borrow().resources[big].registrations;
    env.kill9();
    let small = destroy(&env, "1g.10gb");
    let t = Instant::now();
    env.start_again(&args, regs).await;
    let ev = listed_lost_and_told(&env, &pod.name, &small.uuid).await;
    let note = ev["note"].as_str().unwrap_or_default();
    assert!(note.contains(&small.uuid) && note.contains("GPU 0"), "{ev}");
    assert_eq!(ev["regarding"]["uid"], pod.uid.as_str(), "{ev}");
    println!(
        "a 1g.10gb destroyed while no manager ran: its pod told {} ms after the restart began",
        t.elapsed().as_millis()
    );
    let http = env.logged_http_addr().expect("the new manager's address");
    let (_, metrics) = test_support::process::http_get(http, "/metrics");
    let line = metrics
        .lines()
        .find(|l| l.starts_with("vcuda_mig_device_lost{"))
        .unwrap_or_else(|| panic!("no vcuda_mig_device_lost in\n{metrics}"));
    assert!(line.contains(&small.uuid) && line.ends_with(" 1"), "{line}");
    // The kubelet keeps a plugin's devices after its end: only a new
    // registration says the new manager serves the 3g.40gb.
    let served = env
        .kubelet
        .wait_for(Duration::from_secs(20), |v| {
            v.resources.get(big).is_some_and(|r| {
                r.connected && r.registrations > big_regs && r.healthy_ids().len() == 1
            })
        })
        .await;
    assert!(
        served.is_ok(),
        "the other instance is served as before:\n{}",
        env.log_text()
    );
}

/// Waits until the 1g.10gb `uuid` is listed Unhealthy and pod `name` has
/// its `VcudaMigDeviceLost` Event, which it returns.
async fn listed_lost_and_told(env: &Env, name: &str, uuid: &str) -> serde_json::Value {
    let resource = "tencent.com/mig-1g.10gb";
    let listed = env
        .kubelet
        .wait_for(Duration::from_secs(20), |v| {
            v.resources
                .get(resource)
                .is_some_and(|r| r.devices.get(uuid).is_some_and(|d| !d.healthy))
        })
        .await;
    assert!(listed.is_ok(), "listed, Unhealthy\n{}", env.log_text());
    env.wait_event("VcudaMigDeviceLost", name, Duration::from_secs(20))
        .await
}

/// A pod admitted to the 1g.10gb.
async fn holding_the_1g(env: &mut Env) -> kubelet_emulator::PodRef {
    let pod = env.pod(&[], &[]);
    env.kubelet
        .admit(&pod, "main", &[("tencent.com/mig-1g.10gb", 1)])
        .await
        .unwrap_or_else(|e| panic!("admitting to the 1g.10gb: {e}\n{}", env.log_text()));
    pod
}
