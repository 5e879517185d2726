//! Phase 1c: vcuda-webhook in front of the real 1.20 API server (issue 35):
//! the API server calls the real binary over TLS (a CA of this phase's own
//! in the configurations' caBundle), for pods of one labelled namespace
//! (namespaceSelector: the host manager's own patches stay out of it).
//! Refused at `kubectl apply`, each with the message naming what was
//! wrong: vcuda-core 150, a share without memory, memory without cores,
//! more memory than any GPU of the cluster (this node's published
//! inventory), forged placement annotations. A valid pod is admitted; a
//! server-side dry run of it passes. Then `--self-managed`: the webhook's
//! own CA, patched into a configuration and rotated twice under calls that
//! never fail.
//!
//! Only the validating webhook here: Debian's 1.20.2 API server, built with
//! Go 1.19, dies (SIGSEGV in json-iterator's map encoder: modern-go/reflect2
//! 1.0.1 under Go ≥ 1.18's map iteration; upstream moved to reflect2 1.0.2
//! in 1.24) when it records any mutating webhook's JSON Patch in its
//! audit annotation. The mutations are checked on the ≥ 1.36 node.

use std::fs;
use std::path::Path;
use test_support::k8s::cluster::{Cluster, Work};
use test_support::k8s::util::{tail, wait};
use test_support::k8s::webhook::{NS_LABEL, Webhook};

const NS: &str = "vcuda-webhook-test";
const PORT: u16 = 28443;

fn pod(name: &str, limits: &str, annotations: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}, annotations: {{{annotations}}}}}
spec:
  containers:
    - name: main
      image: docker.io/vcuda-test/busybox:local
      command: [sleep, '1000']
      resources: {{limits: {{{limits}}}}}
"
    )
}

/// The API server's first refusal of `bad` (a pod named core-150), within
/// `secs`: a configuration takes a moment to reach its admission chain.
fn first_refusal(c: &Cluster, dir: &Path, bad: &str, what: &str, secs: u64) -> String {
    wait(what, secs, || match apply(c, dir, "core-150", bad, &[]) {
        Err(e) if e.contains("denied the request") => Ok(e),
        Err(e) => Err(e),
        Ok(o) => {
            let _ = c.kubectl(&["-n", NS, "delete", "pod", "core-150", "--wait=false"]);
            Err(format!("admitted: {o}"))
        }
    })
}

/// `kubectl apply` of `yaml`: the API server's answer.
fn apply(
    c: &Cluster,
    dir: &Path,
    name: &str,
    yaml: &str,
    extra: &[&str],
) -> Result<String, String> {
    let f = dir.join(format!("{name}.yaml"));
    fs::write(&f, yaml).unwrap();
    let mut args = vec!["apply", "-f", f.to_str().unwrap()];
    args.extend_from_slice(extra);
    c.kubectl(&args)
}

pub fn run(c: &Cluster, _w: &Work, figures: &mut Vec<String>) {
    eprintln!("k8s_node: phase 1c: vcuda-webhook in front of the API server");
    let dir = c.dir.join("work/webhook");
    let hook = Webhook::start(
        &c.kubeconfig(),
        &dir,
        PORT,
        &[
            "--trusted-user",
            "system:serviceaccount:kube-system:vcuda-scheduler",
        ],
    );
    c.kubectl_ok(&["create", "namespace", NS]);
    c.kubectl_ok(&["label", "namespace", NS, &format!("{NS_LABEL}=1")]);
    c.apply(&hook.configuration(
        "ValidatingWebhookConfiguration",
        "vcuda-webhook-test",
        "validate",
        "CREATE, UPDATE",
    ));
    let t = std::time::Instant::now();
    let core = "tencent.com/vcuda-core";
    let mem = "tencent.com/vcuda-memory";
    // A configuration takes a moment to reach the API server's admission
    // chain: the first refusal is awaited.
    let bad = pod("core-150", &format!("{core}: 150, {mem}: 4"), "");
    let e = first_refusal(c, &dir, &bad, "the webhook's first refusal", 30);
    figures.push(format!(
        "webhook configured -> first refusal: {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    assert!(e.contains("vcuda-core 150 is not a valid request"), "{e}");
    assert!(
        e.contains(&format!("pod {NS}/core-150 container main")),
        "{e}"
    );
    let refused = |name: &str, yaml: String, want: &str| {
        let e = apply(c, &dir, name, &yaml, &[]).expect_err(&format!("{name} was admitted"));
        assert!(
            e.contains("denied the request") && e.contains(want),
            "{name}: {e}"
        );
        eprintln!(
            "k8s_node: refused {name}: {}",
            e.lines().last().unwrap_or("")
        );
    };
    refused(
        "no-memory",
        pod("no-memory", &format!("{core}: 30"), ""),
        "asks for a share of one GPU but vcuda-memory is 0",
    );
    refused(
        "no-core",
        pod("no-core", &format!("{mem}: 8"), ""),
        "vcuda-memory 8 without vcuda-core",
    );
    refused(
        "too-much",
        pod("too-much", &format!("{core}: 30, {mem}: 1000"), ""),
        "is more than the largest GPU on this node holds",
    );
    refused(
        "forged",
        pod(
            "forged",
            &format!("{core}: 30, {mem}: 4"),
            "tencent.com/predicate-gpu-idx-0: '0', tencent.com/predicate-node: x",
        ),
        "only vcuda writes it",
    );
    // Valid: admitted; a dry run too.
    let good = pod("good", &format!("{core}: 30, {mem}: 4"), "");
    apply(c, &dir, "good-dry", &good, &["--dry-run=server"])
        .expect("a valid pod's server-side dry run");
    apply(c, &dir, "good", &good, &[]).expect("a valid pod");
    let p = c.json(&["-n", NS, "pod", "good"]).unwrap();
    assert_eq!(p["metadata"]["name"], "good", "{p}");
    let log = hook.log();
    assert!(!log.contains("ERROR"), "webhook log: {}", tail(&log, 20));
    c.kubectl_ok(&[
        "delete",
        "validatingwebhookconfiguration",
        "vcuda-webhook-test",
    ]);
    drop(hook);
    self_managed(c, &dir, &bad, figures);
    c.kubectl_ok(&["delete", "namespace", NS, "--wait=true"]);
}

/// The Secret and configuration of the self-managed part.
const ROTATE: &str = "vcuda-webhook-rotate";

/// `--self-managed` against the real API server: the webhook makes its CA
/// and certificate, patches the CA into a configuration created without
/// one, and renews both (60 s of 30 s CAs, 10 s certificates, 4 s of
/// overlap: two CA rotations, several certificates) while a refused pod
/// is applied every second. With `failurePolicy: Fail`, a call the API
/// server could not make (a certificate it did not trust) would be an
/// error instead of the refusal: none may be.
fn self_managed(c: &Cluster, dir: &Path, bad: &str, figures: &mut Vec<String>) {
    eprintln!("k8s_node: phase 1c: --self-managed certificates, rotated under calls");
    let dir = dir.join("self-managed");
    let secret = format!("kube-system/{ROTATE}");
    let config = format!("validating/{ROTATE}");
    let _ = c.kubectl(&[
        "-n",
        "kube-system",
        "delete",
        "secret",
        ROTATE,
        "--ignore-not-found",
    ]);
    let hook = Webhook::start_self_managed(
        &c.kubeconfig(),
        &dir,
        PORT + 2,
        // Its files are the --tls-cert and --tls-key in `dir` the helper names.
        &[
            "--self-managed",
            &secret,
            "--ca-bundle-of",
            &config,
            "--cert-name",
            "127.0.0.1",
            "--ca-validity",
            "30s",
            "--cert-validity",
            "10s",
            "--ca-overlap",
            "4s",
        ],
    );
    // Created after the webhook started, without a caBundle: the webhook's
    // next pass (at most 30 s; sooner when a certificate is due) sets it.
    c.apply(&hook.configuration(
        "ValidatingWebhookConfiguration",
        ROTATE,
        "validate",
        "CREATE, UPDATE",
    ));
    let refused = |e: &str| e.contains("denied the request") && e.contains("vcuda-core 150");
    let t = std::time::Instant::now();
    first_refusal(
        c,
        &dir,
        bad,
        "the first refusal through the self-managed CA",
        40,
    );
    figures.push(format!(
        "self-managed webhook: configuration -> first refusal {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let ca_name = || -> String {
        let s = c.json(&["-n", "kube-system", "secret", ROTATE]).unwrap();
        let meta = s["metadata"]["annotations"]["vcuda.io/webhook-certificates"]
            .as_str()
            .unwrap_or("{}")
            .to_string();
        let m: serde_json::Value = serde_json::from_str(&meta).unwrap();
        m["ca_name"].as_str().unwrap_or("").to_string()
    };
    let mut cas = vec![ca_name()];
    let (mut calls, mut failures) = (0, Vec::new());
    let t = std::time::Instant::now();
    while t.elapsed().as_secs() < 60 {
        calls += 1;
        match apply(c, &dir, "core-150", bad, &[]) {
            Err(e) if refused(&e) => {}
            other => failures.push(format!("{:.0} s: {other:?}", t.elapsed().as_secs_f64())),
        }
        let now = ca_name();
        if cas.last() != Some(&now) {
            cas.push(now);
        }
        std::thread::sleep(std::time::Duration::from_millis(700));
    }
    figures.push(format!(
        "self-managed webhook: {calls} calls over 60 s, {} CAs, {} failed",
        cas.len(),
        failures.len()
    ));
    assert!(
        failures.is_empty(),
        "calls the API server could not make: {failures:#?}\n{}",
        tail(&hook.log(), 30)
    );
    assert!(
        cas.len() >= 3,
        "CAs seen over 60 s: {cas:?}\n{}",
        tail(&hook.log(), 30)
    );
    let log = hook.log();
    assert!(
        log.contains("PromoteCa") && log.contains("caBundle updated"),
        "{}",
        tail(&log, 30)
    );
    c.kubectl_ok(&["delete", "validatingwebhookconfiguration", ROTATE]);
    let _ = c.kubectl(&["-n", "kube-system", "delete", "secret", ROTATE]);
    drop(hook);
}
