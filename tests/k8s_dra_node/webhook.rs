//! One manifest in either mode (issue 35): the pod the device plugins
//! serve (`share_pod`: `tencent.com/vcuda-core: 30`,
//! `tencent.com/vcuda-memory: 8`, a `-lcuda` program that allocates to OOM)
//! applied unchanged to the DRA node with `vcuda-webhook --mode dra` in
//! front of the API server: rewritten into a claim from the
//! `vcuda-30c-2048mi` template the webhook created, allocated by the
//! scheduler with 30 cores and 2 GiB of a GPU, prepared by the driver, and
//! the program held to 2 GiB. The device-plugin phase runs the same
//! manifest under gpu-manager (`device_plugins.rs`).

use std::path::Path;
use test_support::k8s::util::{MIB, wait};
use test_support::k8s::webhook::{NS_LABEL, Webhook};

use crate::parts::*;

const PORT: u16 = 29443;
pub const QUOTA_CMD: &str = "/work/shim_client quota 256; echo ---done; sleep 100000";

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
        "k8s_dra: one manifest: vcuda-core 30 / vcuda-memory 8 rewritten into claim {} (30 cores, 2Gi), held to 2 GiB",
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
