//! The display service's servers at their edges: what HTTP and gRPC refuse
//! (unknown paths and methods, oversize requests) while they keep serving,
//! readiness, and `vcudactl`'s answers and errors (no socket, a stale
//! socket, a manager without the display service).
//!
//! Needs `cargo build --workspace` (the vcudactl binary).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use gpu_display::sampler::{GpuSample, ProcSample};
use gpu_display::{ContainerView, Display, DisplayOptions, GpuRef, GpuView, Running, Snapshot};
use gpu_display_fixture::{FixtureState, StaticSource};
use test_support::target_dir;
use tokio_util::sync::CancellationToken;
use vcuda_api::display::gpu_display_client::GpuDisplayClient;

fn fixture() -> FixtureState {
    let g = GpuRef {
        index: 0,
        uuid: "GPU-0000".into(),
        bus_id: "00000000:07:00.0".into(),
    };
    FixtureState {
        node: "node-1".into(),
        graph: None,
        gpus: vec![GpuView {
            index: 0,
            uuid: "GPU-0000".into(),
            bus_id: "00000000:07:00.0".into(),
            memory_total_bytes: 40 << 30,
            allocated_cores: 50,
            allocated_memory_bytes: 3 << 30,
            healthy: true,
            tenants: 2,
            ..Default::default()
        }],
        containers: vec![
            ContainerView {
                pod_uid: "uid-1".into(),
                pod_name: "trainer".into(),
                namespace: "ml".into(),
                container: "main".into(),
                gpus: vec![g.clone()],
                core_quota: 20,
                memory_quota_bytes: 1 << 30,
                host_pids: vec![4001],
                ..Default::default()
            },
            ContainerView {
                pod_uid: "uid-2".into(),
                pod_name: "server".into(),
                namespace: "web".into(),
                container: "infer".into(),
                gpus: vec![g],
                core_quota: 30,
                memory_quota_bytes: 2 << 30,
                host_pids: vec![4002],
                ..Default::default()
            },
        ],
    }
}

struct Served {
    display: Display,
    running: Option<Running>,
    cancel: CancellationToken,
    addr: SocketAddr,
    /// The probe listener.
    health: SocketAddr,
    /// The metrics listener.
    metrics: SocketAddr,
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Served {
    async fn stop(mut self) {
        self.cancel.cancel();
        self.running.take().unwrap().wait().await;
    }
}

async fn serve() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let display = Display::new(Arc::new(StaticSource::new(fixture())));
    let mut procs = std::collections::HashMap::new();
    procs.insert(
        4001,
        ProcSample {
            utilization_percent: 12.0,
            memory_used_bytes: 300 << 20,
        },
    );
    display.store_snapshot(Snapshot {
        taken: None,
        gpus: vec![GpuSample {
            index: 0,
            uuid: "GPU-0000".into(),
            memory_total_bytes: 40 << 30,
            processes: procs,
            ..Default::default()
        }],
    });
    let cancel = CancellationToken::new();
    let opts = DisplayOptions {
        socket: dir.path().join("run/gpu-manager.sock"),
        query_addr: "127.0.0.1:0".parse().unwrap(),
        health_addr: Some("127.0.0.1:0".parse().unwrap()),
        metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let running = display.start(&opts, None, cancel.clone()).await.unwrap();
    Served {
        display,
        addr: running.http_addr,
        health: running.health_addr.expect("a probe listener was asked for"),
        metrics: running
            .metrics_addr
            .expect("a metrics listener was asked for"),
        running: Some(running),
        cancel,
        socket: opts.socket,
        _dir: dir,
    }
}

/// Sends raw bytes, returns the status code of the first response (0 when
/// the server closed without one).
fn raw(addr: SocketAddr, req: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The server may answer and close before it has read everything.
    let _ = s.write_all(req);
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (code, body)
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    raw(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
}

/// `/healthz` is the liveness probe: it fails, with the reason, once the
/// source says the process needs a restart (the manager: a poisoned lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_when_the_source_needs_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let source = Arc::new(StaticSource::new(fixture()));
    let display = Display::new(source.clone());
    let cancel = CancellationToken::new();
    let opts = DisplayOptions {
        socket: dir.path().join("gpu-manager.sock"),
        query_addr: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    let running = display.start(&opts, None, cancel.clone()).await.unwrap();
    let addr = running.http_addr;
    tokio::task::spawn_blocking(move || {
        assert_eq!(get(addr, "/healthz"), (200, "ok\n".into()));
        source.set_unhealthy(Some("state poisoned by a panic"));
        let (code, body) = get(addr, "/healthz");
        assert_eq!(code, 503);
        assert!(body.contains("state poisoned by a panic"), "{body}");
    })
    .await
    .unwrap();
    cancel.cancel();
    running.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_rejects_what_it_should_and_keeps_serving() {
    let s = serve().await;
    let addr = s.addr;
    let display = s.display.clone();
    tokio::task::spawn_blocking(move || {
        assert_eq!(get(addr, "/healthz"), (200, "ok\n".into()));
        assert_eq!(get(addr, "/readyz").0, 503, "not ready before the manager says so");
        display.set_ready(true);
        assert_eq!(get(addr, "/readyz").0, 200);

        assert_eq!(get(addr, "/nope").0, 404);
        assert_eq!(get(addr, "/metrics/extra").0, 404);
        assert_eq!(get(addr, "/").0, 404);
        let post = raw(
            addr,
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
        );
        assert_eq!(post.0, 405);
        // Declared body over the limit: refused before it is read.
        let big = raw(
            addr,
            b"GET /graph HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(big.0, 413);
        // A long URI, within the head limit: 414 from us.
        let long = format!("/graph?{}", "a".repeat(4000));
        assert_eq!(get(addr, &long).0, 414);
        // A head past the limit: hyper refuses it (431) and closes.
        let huge = format!(
            "GET /graph HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\nConnection: close\r\n\r\n",
            "b".repeat(64 * 1024)
        );
        let (code, _) = raw(addr, huge.as_bytes());
        assert!(code == 431 || code == 0, "oversize head got {code}");
        // Garbage instead of HTTP.
        let (code, _) = raw(addr, b"\x16\x03\x01\x02\x00garbage\r\n\r\n");
        assert!(code == 400 || code == 0, "garbage got {code}");

        // Still serving, every endpoint.
        assert_eq!(get(addr, "/healthz").0, 200);
        let (c, graph) = get(addr, "/graph");
        assert_eq!(c, 200);
        assert!(graph.contains("GPU0 GPU-0000") && graph.contains("cores 50/100"), "{graph}");
        let (c, version) = get(addr, "/version");
        assert_eq!((c, version.trim()), (200, env!("CARGO_PKG_VERSION")));
        let (c, usage) = get(addr, "/usage");
        assert_eq!(c, 200);
        let u: serde_json::Value = serde_json::from_str(&usage).unwrap();
        assert_eq!(u["usage"]["uid-1"]["pod_name"], "trainer");
        assert_eq!(u["usage"]["uid-1"]["namespace"], "ml");
        assert_eq!(u["usage"]["uid-1"]["stat"]["main"]["dev"][0]["gpu"], 12.0);
        assert_eq!(u["usage"]["uid-1"]["stat"]["main"]["dev"][0]["pids"][0], 4001);
        assert_eq!(u["usage"]["uid-2"]["spec"]["infer"]["gpu"], 30.0);
        assert_eq!(u["usage"]["uid-2"]["spec"]["infer"]["mem"], 2048.0);
        let (c, m) = get(addr, "/metrics");
        assert_eq!(c, 200);
        assert!(m.contains("# TYPE container_gpu_utilization gauge"), "{m}");
        let (c, alias) = get(addr, "/metric");
        assert_eq!(c, 200);
        assert!(alias.contains("container_request_gpu_memory{"), "{alias}");
        // HEAD: headers only.
        let (c, body) = raw(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!((c, body.as_str()), (200, ""));
    })
    .await
    .unwrap();
    s.stop().await;
}

async fn client(path: &Path) -> GpuDisplayClient<tonic::transport::Channel> {
    let ch = device_plugin::connect_unix(path, Duration::from_secs(5))
        .await
        .unwrap();
    GpuDisplayClient::new(ch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_rejects_oversize_and_unknown_calls_and_keeps_serving() {
    let s = serve().await;
    let ch = device_plugin::connect_unix(&s.socket, Duration::from_secs(5))
        .await
        .unwrap();
    // A 64 KiB message where Empty is expected: refused before decoding.
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.unwrap();
    let big = vcuda_api::display::GraphResponse {
        graph: "x".repeat(64 * 1024),
    };
    let r: Result<tonic::Response<vcuda_api::display::GraphResponse>, _> = grpc
        .unary(
            tonic::Request::new(big),
            "/display.GPUDisplay/PrintGraph".parse().unwrap(),
            tonic_prost::ProstCodec::default(),
        )
        .await;
    let st = r.unwrap_err();
    assert!(
        matches!(
            st.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "oversize request: {st:?}"
    );
    // An unknown method.
    grpc.ready().await.unwrap();
    let r: Result<tonic::Response<vcuda_api::display::GraphResponse>, _> = grpc
        .unary(
            tonic::Request::new(()),
            "/display.GPUDisplay/PrintEverything".parse().unwrap(),
            tonic_prost::ProstCodec::default(),
        )
        .await;
    assert_eq!(r.unwrap_err().code(), tonic::Code::Unimplemented);

    // Same connection and a new one still work.
    let mut c = GpuDisplayClient::new(ch);
    let g = c.print_graph(()).await.unwrap().into_inner().graph;
    assert!(g.contains("GPU0"), "{g}");
    let mut c = client(&s.socket).await;
    let u = c.print_usages(()).await.unwrap().into_inner();
    assert_eq!(u.usage.len(), 2);
    assert_eq!(u.usage["uid-1"].project, "ml");
    assert_eq!(u.usage["uid-1"].namespace, "ml");
    assert_eq!(u.usage["uid-1"].pod_name, "trainer");
    assert_eq!(u.usage["uid-2"].pod_name, "server");
    assert_eq!(u.usage["uid-1"].stat["main"].dev[0].gpu, 12.0);
    assert_eq!(u.usage["uid-1"].stat["main"].dev[0].mem, 300.0);
    assert_eq!(u.usage["uid-1"].stat["main"].dev[0].card_idx, "0");
    assert_eq!(u.usage["uid-1"].spec["main"].gpu, 20.0);
    assert_eq!(
        c.version(()).await.unwrap().into_inner().version,
        env!("CARGO_PKG_VERSION")
    );
    // The socket is group-accessible only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&s.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_server_on_a_live_socket_is_refused_and_stale_one_replaced() {
    let s = serve().await;
    let other = Display::new(Arc::new(StaticSource::new(fixture())));
    let err = other
        .serve_grpc(&s.socket, 0o660, CancellationToken::new())
        .unwrap_err();
    assert!(
        matches!(err, gpu_display::Error::SocketInUse { .. }),
        "{err}"
    );
    s.stop().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpu-manager.sock");
    // A socket file nobody listens on (a killed manager) is replaced. Bound
    // by another process that exits: a listener of this process could live
    // on for a moment in a child that another test forks before its exec
    // (CI once saw SocketInUse here).
    let st = std::process::Command::new("python3")
        .args([
            "-c",
            "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])",
        ])
        .arg(&path)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(path.exists());
    let cancel = CancellationToken::new();
    let h = other.serve_grpc(&path, 0o660, cancel.clone()).unwrap();
    let mut c = client(&path).await;
    assert!(c.version(()).await.is_ok());
    cancel.cancel();
    h.await.unwrap();
}

fn vcudactl(socket: &Path, args: &[&str]) -> Output {
    let exe = target_dir().join("vcudactl");
    assert!(
        exe.is_file(),
        "{} missing: cargo build --workspace",
        exe.display()
    );
    Command::new(exe)
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vcudactl_usage_graph_version_top() {
    let s = serve().await;
    let sock = s.socket.clone();
    let addr = s.addr;
    tokio::task::spawn_blocking(move || {
        let out = vcudactl(&sock, &["usage"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let t = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("NAMESPACE"));
        // Sorted by namespace: ml before web. The pod by name; its UID
        // only with --wide.
        assert!(
            lines[1].starts_with("ml") && lines[1].contains("trainer") && lines[1].contains("main"),
            "{t}"
        );
        assert!(!t.contains("uid-1"), "{t}");
        assert!(
            lines[1].contains("12.0% / 20%")
                && lines[1].contains("300 / 1024 MiB")
                && lines[1].ends_with("4001"),
            "{t}"
        );
        assert!(
            lines[2].starts_with("web")
                && lines[2].contains("server")
                && lines[2].contains("infer"),
            "{t}"
        );
        assert!(
            lines[2].contains("0.0% / 30%") && lines[2].contains("0 / 2048 MiB"),
            "{t}"
        );
        let out = vcudactl(&sock, &["usage", "--wide"]);
        assert!(out.status.success());
        let t = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("POD UID"), "{t}");
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(cells[..4], ["ml", "trainer", "uid-1", "main"], "{t}");
        assert!(lines[1].ends_with("4001"), "{t}");

        let out = vcudactl(&sock, &["graph"]);
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            get(addr, "/graph").1
        );

        let out = vcudactl(&sock, &["version"]);
        let v = String::from_utf8(out.stdout).unwrap();
        assert!(
            v.contains(&format!("gpu-manager {}", env!("CARGO_PKG_VERSION"))),
            "{v}"
        );

        let out = vcudactl(&sock, &["top", "--interval", "0.2", "--iterations", "2"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let t = String::from_utf8(out.stdout).unwrap();
        assert_eq!(t.matches("vcudactl top:").count(), 2, "{t}");
        assert_eq!(t.matches(" server ").count(), 2, "{t}");
        assert_eq!(t.matches("GPU0 GPU-0000").count(), 2, "{t}");
    })
    .await
    .unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vcudactl_explains_missing_stale_and_old_servers() {
    let dir = tempfile::tempdir().unwrap();
    // No socket.
    let missing = dir.path().join("absent.sock");
    let out = vcudactl(&missing, &["usage"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no gpu-manager socket at") && err.contains("--socket"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "one clear line: {err}");

    // A socket file nobody listens on.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let err = String::from_utf8(vcudactl(&stale, &["graph"]).stderr).unwrap();
    assert!(err.contains("not listening"), "{err}");

    // A gRPC server without display.GPUDisplay: a manager too old (or not
    // a manager at all).
    let old = dir.path().join("old.sock");
    let l = tokio::net::UnixListener::bind(&old).unwrap();
    struct Nop;
    #[tonic::async_trait]
    impl vcuda_api::deviceplugin::v1beta1::registration_server::Registration for Nop {
        async fn register(
            &self,
            _: tonic::Request<vcuda_api::deviceplugin::v1beta1::RegisterRequest>,
        ) -> Result<tonic::Response<vcuda_api::deviceplugin::v1beta1::Empty>, tonic::Status>
        {
            Ok(tonic::Response::new(Default::default()))
        }
    }
    let cancel = CancellationToken::new();
    let srv = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                vcuda_api::deviceplugin::v1beta1::registration_server::RegistrationServer::new(Nop),
            )
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(l),
                cancel.clone().cancelled_owned(),
            ),
    );
    let o = old.clone();
    let out = tokio::task::spawn_blocking(move || vcudactl(&o, &["usage"]))
        .await
        .unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("too old") && err.contains("PrintUsages"),
        "{err}"
    );
    cancel.cancel();
    let _ = srv.await;
}

/// One address holding 16 idle connections to the query port gets its
/// next one closed at once; another address (the kubelet's probes,
/// Prometheus) is still answered (crates/node/gpu-display/src/http.rs,
/// `MAX_PER_PEER`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_every_connection_of_the_query_port() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = serve().await;
    let from = |ip: &str| {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        sock.connect(s.addr)
    };
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(from("127.0.0.3").await.unwrap());
    }
    // Past the cap: closed without an answer.
    let mut over = from("127.0.0.3").await.unwrap();
    let _ = over
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), over.read_to_end(&mut buf)).await;
    assert!(
        !String::from_utf8_lossy(&buf).contains("200 OK"),
        "answered past the cap: {}",
        String::from_utf8_lossy(&buf)
    );
    // Another address: answered while those are held.
    let mut probe = from("127.0.0.4").await.unwrap();
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), probe.read_to_end(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"));
    drop(held);
    // Once they are gone, the first address is served again.
    let t0 = std::time::Instant::now();
    let addr = s.addr;
    loop {
        let mut c = from("127.0.0.3").await.unwrap();
        let _ = c
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut buf)).await;
        if String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{addr} never served 127.0.0.3 again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.stop().await;
}

/// The probes have a listener of their own (`--health-port`): with every
/// connection slot of the query port held (16 addresses at their cap of
/// 16: pods of several tenants), the query port answers nobody new while
/// `/healthz` and `/readyz` still answer on the probe port, which serves
/// nothing else (crates/node/gpu-display/src/http.rs, `Endpoints`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probes_answer_while_the_query_port_is_full() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = serve().await;
    s.display.set_ready(true);
    let from = |ip: String, to: SocketAddr| async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        sock.connect(to).await.unwrap()
    };
    let mut held = Vec::new();
    for a in 0..16 {
        for _ in 0..16 {
            held.push(from(format!("127.0.1.{}", a + 10), s.addr).await);
        }
    }
    let ask = |mut c: tokio::net::TcpStream, path: &'static str| async move {
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let _ = c.write_all(req.as_bytes()).await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(3), c.read_to_end(&mut buf)).await;
        String::from_utf8_lossy(&buf).into_owned()
    };
    // The query port is full: a new address waits unanswered.
    let full = ask(from("127.0.1.99".into(), s.addr).await, "/healthz").await;
    assert!(
        full.is_empty(),
        "the query port answered past its 256 connections: {full}"
    );
    for (path, want) in [("/healthz", "ok"), ("/readyz", "ready")] {
        let r = ask(from("127.0.1.99".into(), s.health).await, path).await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.ends_with(&format!("{want}\n")),
            "{path}: {r}"
        );
    }
    for path in ["/usage", "/metrics", "/graph"] {
        let r = ask(from("127.0.1.99".into(), s.health).await, path).await;
        assert!(
            r.starts_with("HTTP/1.1 404") && r.contains("this is the probe port"),
            "{path} on the probe port: {r}"
        );
    }
    drop(held);
    s.stop().await;
}

/// The metrics have a listener of their own (`--metrics-port`), so the
/// query port, whose /usage and /graph name every tenant's pods and host
/// PIDs, can stay inside the pod: Prometheus gets the same exposition
/// there, and nothing else (crates/node/gpu-display/src/http.rs,
/// `Endpoints::Metrics`).
#[test]
fn the_metrics_port_serves_the_metrics_alone() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = rt.block_on(serve());
    s.display.set_ready(true);
    let (metrics, query) = (s.metrics, s.addr);
    let (code, on_metrics) = get(metrics, "/metrics");
    assert_eq!(code, 200, "{on_metrics}");
    let (_, on_query) = get(query, "/metrics");
    let names = |t: &str| -> std::collections::BTreeSet<String> {
        t.lines()
            .filter(|l| l.starts_with("# TYPE "))
            .map(str::to_string)
            .collect()
    };
    assert!(!names(&on_metrics).is_empty(), "{on_metrics}");
    assert_eq!(
        names(&on_metrics),
        names(&on_query),
        "one exposition on both"
    );
    assert!(
        on_metrics.contains("pod=\"trainer\""),
        "per-container series: {on_metrics}"
    );
    assert_eq!(get(metrics, "/metric").0, 200, "the original's alias");
    for path in ["/usage", "/graph", "/version", "/healthz", "/readyz"] {
        let (code, body) = get(metrics, path);
        assert!(
            code == 404 && body.contains("this is the metrics port"),
            "{path} on the metrics port: {code} {body}"
        );
        assert_eq!(get(query, path).0, 200, "{path} on the query port");
    }
    rt.block_on(s.stop());
}

/// A metrics port taken by another process fails the start with the
/// address and the flags to change, and leaves nothing listening.
#[tokio::test]
async fn a_taken_metrics_port_fails_the_start_by_name() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = taken.local_addr().unwrap();
    let query = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let display = Display::new(Arc::new(StaticSource::new(fixture())));
    let opts = DisplayOptions {
        socket: dir.path().join("gpu-manager.sock"),
        query_addr: query,
        metrics_addr: Some(at),
        ..Default::default()
    };
    let e = match display.start(&opts, None, CancellationToken::new()).await {
        Ok(_) => panic!("started on a taken metrics port {at}"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains(&format!("metrics port {at}")) && e.contains("--metrics-port"),
        "{e}"
    );
    // The query port it had bound first is free again.
    tokio::time::sleep(Duration::from_millis(100)).await;
    std::net::TcpListener::bind(query).expect("the query port was left bound");
}
