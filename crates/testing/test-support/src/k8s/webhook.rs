//! The real `vcuda-webhook` binary on the host, in front of a real API
//! server: a CA and serving certificate of the test's own (openssl), the
//! process with its probes listener, and webhook configurations that call
//! it by URL for one labelled namespace (the daemons' own patches stay out
//! of it).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use crate::k8s::util::{tail, wait};
use crate::target_dir;

/// The label a test namespace carries for the configurations to apply.
pub const NS_LABEL: &str = "vcuda.io/webhook-test";

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

/// The webhook process; killed on drop.
pub struct Webhook {
    child: Child,
    pub port: u16,
    pub stderr: PathBuf,
    /// The CA's certificate, base64 (a configuration's `caBundle`); none
    /// when the webhook manages its own (`--self-managed`).
    pub ca_bundle: Option<String>,
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Webhook {
    /// Starts `vcuda-webhook` on 127.0.0.1:`port` (probes on `port + 1`)
    /// with `args`, its files in `dir`; waits for `/healthz`.
    pub fn start(kubeconfig: &Path, dir: &Path, port: u16, args: &[&str]) -> Webhook {
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
        let days = ["-days", "1"];
        openssl(
            dir,
            &[
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
                    "-subj",
                    "/CN=vcuda-webhook-test-ca",
                ][..],
                &days,
            ]
            .concat(),
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
                    "-extfile",
                    "san.ext",
                ][..],
                &days,
            ]
            .concat(),
        );
        let ca_bundle = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(fs::read(dir.join("ca.crt")).unwrap())
        };
        Self::spawn(kubeconfig, dir, port, args, Some(ca_bundle))
    }

    /// Starts `vcuda-webhook` with `args` that make it manage its own
    /// certificates (`--self-managed ...`): the files it writes in `dir`.
    pub fn start_self_managed(kubeconfig: &Path, dir: &Path, port: u16, args: &[&str]) -> Webhook {
        fs::create_dir_all(dir).unwrap();
        Self::spawn(kubeconfig, dir, port, args, None)
    }

    fn spawn(
        kubeconfig: &Path,
        dir: &Path,
        port: u16,
        args: &[&str],
        ca_bundle: Option<String>,
    ) -> Webhook {
        let stderr = dir.join("webhook.err");
        let health = port + 1;
        let child = Command::new(target_dir().join("vcuda-webhook"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--health-listen", &format!("127.0.0.1:{health}")])
            .arg("--tls-cert")
            .arg(dir.join("tls.crt"))
            .arg("--tls-key")
            .arg(dir.join("tls.key"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .stdout(fs::File::create(dir.join("webhook.log")).unwrap())
            .stderr(fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("vcuda-webhook: cargo build --workspace first");
        let w = Webhook {
            child,
            port,
            stderr,
            ca_bundle,
        };
        wait("vcuda-webhook's /healthz", 60, || {
            let out = Command::new("curl")
                .args(["-sf", &format!("http://127.0.0.1:{health}/healthz")])
                .output()
                .unwrap();
            if out.status.success() {
                Ok(())
            } else {
                Err(tail(&w.log(), 5))
            }
        });
        w
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// A `kind` (Mutating/ValidatingWebhookConfiguration) named `name`
    /// calling `/<path>` for pods on `ops`, in namespaces labelled
    /// [`NS_LABEL`]; `failurePolicy: Fail`, so a call the API server
    /// cannot make (a CA it does not trust) is an error, never a pass.
    pub fn configuration(&self, kind: &str, name: &str, path: &str, ops: &str) -> String {
        let ca = match &self.ca_bundle {
            Some(b) => format!(", caBundle: {b}"),
            None => String::new(),
        };
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
    namespaceSelector: {{matchLabels: {{{NS_LABEL}: \"1\"}}}}
    clientConfig: {{url: \"https://127.0.0.1:{port}/{path}\"{ca}}}
    rules:
      - {{apiGroups: [\"\"], apiVersions: [v1], resources: [pods], operations: [{ops}]}}
",
            port = self.port,
        )
    }
}
