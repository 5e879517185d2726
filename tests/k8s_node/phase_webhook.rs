//! Phase 1c: vcuda-webhook in front of the real 1.20 API server (issue 35):
//! the API server calls the real binary over TLS (a CA of this phase's own
//! in the configurations' caBundle), for pods of one labelled namespace
//! (namespaceSelector: the host manager's own patches stay out of it).
//! Refused at `kubectl apply`, each with the message naming what was
//! wrong: vcuda-core 150, a share without memory, memory without cores,
//! more memory than any GPU of the cluster (this node's published
//! inventory), forged placement annotations. A valid pod is admitted; a
//! server-side dry run of it passes.
//!
//! Only the validating webhook here: Debian's 1.20.2 API server, built with
//! Go 1.19, dies (SIGSEGV in json-iterator's map encoder: modern-go/reflect2
//! 1.0.1 under Go ≥ 1.18's map iteration; upstream moved to reflect2 1.0.2
//! in 1.24) when it records any mutating webhook's JSON Patch in its
//! audit annotation. The mutations are checked on the ≥ 1.36 node.

use std::fs;
use std::path::Path;
use std::process::{Child, Command};
use test_support::k8s::cluster::{Cluster, Work};
use test_support::k8s::util::{tail, wait};
use test_support::target_dir;

const NS: &str = "vcuda-webhook-test";
const PORT: u16 = 28443;
const HEALTH: u16 = 28444;

struct Webhook(Child, std::path::PathBuf);

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a serving certificate for 127.0.0.1 signed by it.
fn certificates(dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "1",
            "-subj",
            "/CN=vcuda-webhook-test-ca",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "tls.key",
            "-out",
            "tls.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "tls.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "tls.crt",
            "-days",
            "1",
            "-extfile",
            "san.ext",
        ],
    );
}

fn start(c: &Cluster, dir: &Path) -> Webhook {
    let log = dir.join("webhook.log");
    let child = Command::new(target_dir().join("vcuda-webhook"))
        .args(["--listen", &format!("127.0.0.1:{PORT}")])
        .args(["--health-listen", &format!("127.0.0.1:{HEALTH}")])
        .arg("--tls-cert")
        .arg(dir.join("tls.crt"))
        .arg("--tls-key")
        .arg(dir.join("tls.key"))
        .arg("--kubeconfig")
        .arg(c.kubeconfig())
        .args([
            "--trusted-user",
            "system:serviceaccount:kube-system:vcuda-scheduler",
        ])
        .stdout(fs::File::create(&log).unwrap())
        .stderr(fs::File::create(dir.join("webhook.err")).unwrap())
        .spawn()
        .expect("vcuda-webhook: cargo build --workspace first");
    let w = Webhook(child, dir.join("webhook.err"));
    wait("vcuda-webhook's /healthz", 60, || {
        let out = Command::new("curl")
            .args(["-sf", &format!("http://127.0.0.1:{HEALTH}/healthz")])
            .output()
            .unwrap();
        if out.status.success() {
            Ok(())
        } else {
            Err(tail(&fs::read_to_string(&w.1).unwrap_or_default(), 5))
        }
    });
    w
}

fn configurations(ca: &str) -> String {
    let hook = |kind: &str, name: &str, path: &str, ops: &str| {
        format!(
            "apiVersion: admissionregistration.k8s.io/v1
kind: {kind}
metadata: {{name: {name}}}
webhooks:
  - name: {path}.vcuda.tencent.com
    admissionReviewVersions: [v1]
    sideEffects: NoneOnDryRun
    failurePolicy: Fail
    timeoutSeconds: 5
    namespaceSelector: {{matchLabels: {{vcuda.io/webhook-test: \"1\"}}}}
    clientConfig: {{url: \"https://127.0.0.1:{PORT}/{path}\", caBundle: {ca}}}
    rules:
      - {{apiGroups: [\"\"], apiVersions: [v1], resources: [pods], operations: [{ops}]}}
"
        )
    };
    hook(
        "ValidatingWebhookConfiguration",
        "vcuda-webhook-test",
        "validate",
        "CREATE, UPDATE",
    )
}

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
    certificates(&dir);
    let hook = start(c, &dir);
    let ca = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(fs::read(dir.join("ca.crt")).unwrap())
    };
    c.kubectl_ok(&["create", "namespace", NS]);
    c.kubectl_ok(&["label", "namespace", NS, "vcuda.io/webhook-test=1"]);
    c.apply(&configurations(&ca));
    let t = std::time::Instant::now();
    let core = "tencent.com/vcuda-core";
    let mem = "tencent.com/vcuda-memory";
    // A configuration takes a moment to reach the API server's admission
    // chain: the first refusal is awaited.
    let bad = pod("core-150", &format!("{core}: 150, {mem}: 4"), "");
    let e = wait("the webhook's first refusal", 30, || {
        match apply(c, &dir, "core-150", &bad, &[]) {
            Err(e) if e.contains("denied the request") => Ok(e),
            Err(e) => Err(e),
            Ok(o) => {
                let _ = c.kubectl(&["-n", NS, "delete", "pod", "core-150", "--wait=false"]);
                Err(format!("admitted: {o}"))
            }
        }
    });
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
    let log = fs::read_to_string(&hook.1).unwrap_or_default();
    assert!(!log.contains("ERROR"), "webhook log: {}", tail(&log, 20));
    c.kubectl_ok(&[
        "delete",
        "validatingwebhookconfiguration",
        "vcuda-webhook-test",
    ]);
    c.kubectl_ok(&["delete", "namespace", NS, "--wait=true"]);
    drop(hook);
}
