//! One manifest in either mode (issue 35): the pod the device plugins
//! serve (`share_pod`: `tencent.com/vcuda-core: 30`,
//! `tencent.com/vcuda-memory: 8`, a `-lcuda` program that allocates to OOM)
//! applied unchanged to the DRA node with `vcuda-webhook --mode dra` in
//! front of the API server: rewritten into a claim from the
//! `vcuda-30c-2048mi` template the webhook created, allocated by the
//! scheduler with 30 cores and 2 GiB of a GPU, prepared by the driver, the
//! program held to 2 GiB and its kernel loop to 30 % of the GPU. The
//! device-plugin phase runs the same manifest under gpu-manager
//! (`device_plugins.rs`).

use std::path::Path;
use std::time::Duration;
use test_support::k8s::util::{MIB, pids_of_pod, wait};
use test_support::k8s::webhook::{NS_LABEL, Webhook};

use crate::parts::*;

const PORT: u16 = 29443;
/// The manifest's program: allocate to OOM, then a kernel loop (the
/// compute check reads its share of the GPU from outside).
pub const QUOTA_CMD: &str =
    "/work/shim_client quota 256; echo ---done; exec /work/shim_compute saturate 90";

/// The pod's share of its GPU while its kernel loop runs, read from the
/// simulated GPU's own timeline (the interposer cannot write it): 30 ± 5 %,
/// the tolerance k8s_node's phase 1 holds on the 1.20 node. Returns it.
pub fn check_thirty_percent(n: &Node, pod: &str, sim: &Path, who: &str) -> f64 {
    let p = n.json(&["-n", NS, "get", "pod", pod]).unwrap();
    let uid = p["metadata"]["uid"].as_str().unwrap().to_string();
    let state = test_support::sim::state_at(sim);
    let gpus = state.node().gpus.len();
    let ours = |g: usize| {
        let pids: Vec<u32> = state
            .processes(g)
            .iter()
            .filter_map(|p| p.host_pid)
            .collect();
        pids_of_pod(&uid, &pids)
    };
    let g = wait(&format!("{who}'s process on a GPU"), 60, || {
        (0..gpus)
            .find(|&g| !ours(g).is_empty())
            .ok_or_else(|| "not on any GPU yet".to_string())
    });
    // The throttle settles, then a measured window.
    std::thread::sleep(Duration::from_secs(5));
    let from = gpu_sim_core::state::now_ns();
    std::thread::sleep(Duration::from_secs(15));
    let to = gpu_sim_core::state::now_ns();
    let mine = ours(g);
    let busy: f64 = state
        .process_utilization(g, from, to)
        .iter()
        .filter(|(p, _)| p.host_pid.is_some_and(|h| mine.contains(&h)))
        .map(|(_, pct)| pct)
        .sum();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    assert!(
        (busy - 30.0).abs() <= 5.0,
        "{who}: held to {busy:.1} % of GPU {g}, not 30 ± 5 (load average {})",
        load.trim()
    );
    busy
}

/// The program held to 2 GiB (8 units): refused past it.
pub fn check_two_gib(out: &str, who: &str) {
    check_quota_of(out, who, 2048 * MIB);
}

pub fn same_manifest(n: &Node, w: &Path, bin: &Path, sim: &Path) {
    let hook = Webhook::start(&n.kubeconfig, &w.join("webhook"), PORT, &["--mode", "dra"]);
    n.ok(&[
        "label",
        "namespace",
        NS,
        &format!("{NS_LABEL}=1"),
        "--overwrite",
    ]);
    n.apply(&hook.configuration(
        "MutatingWebhookConfiguration",
        "vcuda-webhook-dra",
        "mutate",
        "CREATE",
    ));
    n.apply(&hook.configuration(
        "ValidatingWebhookConfiguration",
        "vcuda-webhook-dra",
        "validate",
        "CREATE",
    ));
    let manifest = share_pod("same-manifest", 30, 8, QUOTA_CMD, bin, sim);
    let file = w.join("same-manifest.yaml");
    std::fs::write(&file, &manifest).unwrap();
    // The configurations reach the API server's admission chain in a
    // moment: a server-side dry run shows when the rewrite is on.
    wait("the webhook's rewrite active (a dry run)", 30, || {
        let out = n.kubectl(&[
            "apply",
            "--dry-run=server",
            "-o",
            "json",
            "-f",
            file.to_str().unwrap(),
        ])?;
        if out.contains("vcuda-30c-2048mi") {
            Ok(())
        } else {
            Err("not rewritten yet".into())
        }
    });
    n.ok(&["apply", "-f", file.to_str().unwrap()]);
    wait_running(n, "same-manifest", 120);
    let p = n.json(&["-n", NS, "get", "pod", "same-manifest"]).unwrap();
    assert_eq!(
        p["spec"]["resourceClaims"][0]["resourceClaimTemplateName"], "vcuda-30c-2048mi",
        "{}",
        p["spec"]
    );
    let limits = &p["spec"]["containers"][0]["resources"]["limits"];
    assert!(
        limits.get("tencent.com/vcuda-core").is_none(),
        "the vcuda limits stay: {limits}"
    );
    let c = pod_claim(n, "same-manifest").unwrap();
    let r = &c["status"]["allocation"]["devices"]["results"][0];
    assert_eq!(r["driver"], DRIVER, "{c}");
    assert_eq!(r["consumedCapacity"]["cores"], "30", "{c}");
    assert_eq!(r["consumedCapacity"]["memory"], "2Gi", "{c}");
    check_two_gib(
        &log_with(n, "same-manifest", "---done"),
        "same-manifest (DRA, rewritten)",
    );
    let busy = check_thirty_percent(n, "same-manifest", sim, "same-manifest (DRA, rewritten)");
    // A bad request is refused at apply, with the node's words.
    let bad = w.join("bad.yaml");
    std::fs::write(&bad, share_pod("core-150", 150, 8, "true", bin, sim)).unwrap();
    let e = n
        .kubectl(&["apply", "-f", bad.to_str().unwrap()])
        .expect_err("vcuda-core 150 admitted");
    assert!(e.contains("vcuda-core 150 is not a valid request"), "{e}");
    let t = n
        .json(&["-n", NS, "get", "resourceclaimtemplate", "vcuda-30c-2048mi"])
        .unwrap();
    assert_eq!(
        t["metadata"]["labels"]["app.kubernetes.io/managed-by"], "vcuda-webhook",
        "{t}"
    );
    eprintln!(
        "k8s_dra: one manifest: vcuda-core 30 / vcuda-memory 8 rewritten into claim {} (30 cores, 2Gi), held to 2 GiB and {busy:.1} % of the GPU",
        c["metadata"]["name"]
    );
    n.ok(&["-n", NS, "delete", "pod", "same-manifest", "--wait=true"]);
    n.ok(&[
        "delete",
        "mutatingwebhookconfiguration,validatingwebhookconfiguration",
        "vcuda-webhook-dra",
    ]);
    n.ok(&["label", "namespace", NS, &format!("{NS_LABEL}-")]);
    assert!(!hook.log().contains("ERROR"), "{}", hook.log());
}
