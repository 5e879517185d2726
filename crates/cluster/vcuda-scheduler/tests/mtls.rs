//! Who may call the extender, on the `vcuda-scheduler` binary: with
//! --tls-cert/--tls-key/--client-ca it answers only a client whose
//! certificate chains to the CA (kube-scheduler's extender `tlsConfig`);
//! without a certificate, with one from another CA, or in plain HTTP, the
//! call never reaches `/bind` or `/filter`. A plain listener outside
//! loopback, or a partial set of TLS flags, is refused at start, naming
//! why. Certificates made with openssl (a CI requirement already:
//! tests/k8s/cluster.sh).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ca` signs `name` (a server certificate for 127.0.0.1, or a client's).
fn issue(dir: &Path, ca: &str, name: &str, server: bool) {
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-subj",
            &format!("/CN={name}"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    let ext = if server {
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    } else {
        "extendedKeyUsage=clientAuth\n"
    };
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.crt"),
        ],
    );
}

fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-subj",
            &format!("/CN={name}"),
            "-days",
            "2",
            "-out",
            &format!("{name}.crt"),
        ],
    );
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The extender over the emulated API server; its address from its log.
async fn start(
    dir: &Path,
    args: &[&str],
) -> (Killed, std::net::SocketAddr, apiserver_emulator::ApiServer) {
    let api = apiserver_emulator::ApiServer::start("127.0.0.1:0")
        .await
        .unwrap();
    api.write_kubeconfig(&dir.join("kubeconfig")).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_vcuda-scheduler"))
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(c.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines
            .next()
            .expect("the extender logs its address")
            .unwrap();
        if let Some(rest) = l.split("addr=").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (Killed(c), addr, api)
}

fn client_config(dir: &Path, client: Option<&str>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(dir.join("ca.crt")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let b = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    Arc::new(match client {
        Some(name) => {
            let chain = CertificateDer::pem_file_iter(dir.join(format!("{name}.crt")))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).unwrap();
            b.with_client_auth_cert(chain, key).unwrap()
        }
        None => b.with_no_client_auth(),
    })
}

/// POSTs `body` to `path` over TLS; the status line, or why it failed.
async fn post(
    addr: std::net::SocketAddr,
    cfg: Arc<rustls::ClientConfig>,
    path: &str,
    body: &str,
) -> Result<String, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let c = tokio_rustls::TlsConnector::from(cfg);
    let mut s = c
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .await
        .map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&out).into_owned();
    if text.is_empty() {
        return Err("connection closed without an answer".into());
    }
    Ok(text)
}

const BIND: &str = r#"{"PodName":"p","PodNamespace":"default","PodUID":"u","Node":"n"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_client_certificate_from_the_ca_reaches_the_extender() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    ca(d, "ca");
    ca(d, "other-ca");
    issue(d, "ca", "server", true);
    issue(d, "ca", "kube-scheduler", false);
    issue(d, "other-ca", "intruder", false);
    let p = |n: &str| d.join(n).display().to_string();
    let (_x, addr, _api) = start(
        d,
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &p("server.crt"),
            "--tls-key",
            &p("server.key"),
            "--client-ca",
            &p("ca.crt"),
        ],
    )
    .await;
    // kube-scheduler's certificate: /bind answers (the pod is unknown).
    let t0 = Instant::now();
    let ok = loop {
        match post(
            addr,
            client_config(d, Some("kube-scheduler")),
            "/bind",
            BIND,
        )
        .await
        {
            Ok(r) => break r,
            Err(e) if t0.elapsed() < Duration::from_secs(20) => {
                eprintln!("waiting: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(
        ok.contains("pod default/p on node n"),
        "bind's answer: {ok}"
    );
    // No certificate, another CA's: the handshake is refused.
    for who in [None, Some("intruder")] {
        let r = post(addr, client_config(d, who), "/bind", BIND).await;
        assert!(r.is_err(), "{who:?} got an answer: {r:?}");
    }
    // Plain HTTP to the TLS port: nothing answers it.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "POST /bind HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{BIND}",
            BIND.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    assert!(
        !String::from_utf8_lossy(&out).contains("HTTP/1.1 200"),
        "plain HTTP answered"
    );
}

#[test]
fn a_plain_listener_outside_loopback_or_half_the_tls_flags_is_refused() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_vcuda-scheduler"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(&["--listen", "0.0.0.0:0"]);
    assert!(
        e.contains("reachable from other hosts") && e.contains("--client-ca"),
        "{e}"
    );
    let e = run(&["--listen", "127.0.0.1:0", "--tls-cert", "/x.crt"]);
    assert!(e.contains("missing: --tls-key, --client-ca"), "{e}");
    let e = run(&[
        "--tls-cert",
        "/nonexistent.crt",
        "--tls-key",
        "/k",
        "--client-ca",
        "/c",
    ]);
    assert!(e.contains("--tls-cert /nonexistent.crt"), "{e}");
}
