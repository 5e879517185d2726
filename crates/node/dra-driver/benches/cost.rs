//! What the DRA driver costs a node: RSS and CPU of `vcuda-dra-driver` as
//! the DaemonSet runs it (the supervisor and its driver child), on a
//! simulated four-GPU node with the API server emulator and the emulated
//! kubelet, first idle (registered, its slice published, no claim) for
//! `VCUDA_COST_SECS` (default 60), then with 40 share claims prepared
//! (10 cores and 256 MiB each, the emulated scheduler's first fit puts ten
//! on each GPU) and one registered process per claim, for as long again.
//!
//! CPU is the utime+stime delta of both processes (/proc/<pid>/stat) over
//! the wall time, as a percentage of one core; RSS is each process's VmRSS
//! at the end of the phase. Prints figures, asserts nothing about them.
//!
//! `cargo build --workspace` first (gpu-sim, the interposer), then
//! `cargo bench -p dra-driver --bench cost` (`VCUDA_COST_SECS=5` to try it).
//!
//! Each registered process is this binary again (`VCUDA_COST_HOLD` set):
//! it registers on the claim's `vcuda.sock` once, says so on stdout and
//! waits, its connection held, until it is killed.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use test_support::dra::until;
use test_support::dra_binary::{self, Sup, children, log, prepare_share, share_env};
use test_support::hostile::{maximal_request, register, rss_kib};
use test_support::process::CpuSample;

const BIN: &str = env!("CARGO_BIN_EXE_vcuda-dra-driver");
const CLAIMS: usize = 40;

fn main() {
    if let Some(dir) = std::env::var_os("VCUDA_COST_HOLD") {
        hold(Path::new(&dir));
    }
    let secs: u64 = std::env::var("VCUDA_COST_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run(secs));
}

async fn run(secs: u64) {
    let (server, dirs) = dra_binary::node("sim-4gpu-pcie.toml").await;
    let sup = dra_binary::driver(Path::new(BIN), &dirs, &[]);
    let kubelet = dra_kubelet_emulator::plugin::wait_and_register(
        &dirs.p("plugins_registry"),
        Duration::from_secs(60),
        false,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log(&dirs)));
    until(20, "the slice published", || {
        server.list(apiserver_emulator::Kind::ResourceSlice).len() == 1
    })
    .await;

    let idle = measure(&sup, secs).await;
    println!("DRA driver idle {secs} s: {idle}");

    let mut holders = Holders(Vec::new());
    for i in 0..CLAIMS {
        let name = format!("share-{i:02}");
        let (_, cdi) = prepare_share(&kubelet, &server, &name, 10, "256Mi").await;
        let env = share_env(&dirs, &cdi);
        let dir = &env.iter().find(|(k, _)| k == "VCUDA_CONFIG_DIR").unwrap().1;
        holders.0.push(spawn_holder(Path::new(dir)));
    }
    let ck = dra_driver::checkpoint::Store::new(&dirs.p("state"))
        .load(test_support::dra::NODE)
        .unwrap();
    assert_eq!(ck.claims.len(), CLAIMS, "claims in the checkpoint");

    let busy = measure(&sup, secs).await;
    println!("DRA driver {CLAIMS} shares registered {secs} s: {busy}");
    drop(holders);
}

/// One phase's figures.
struct Cost {
    rss_sup: u64,
    rss_driver: u64,
    cpu_pct: f64,
    replaced: bool,
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RSS supervisor {} KiB + driver {} KiB, CPU {:.2} % of a core",
            self.rss_sup, self.rss_driver, self.cpu_pct
        )?;
        if self.replaced {
            write!(
                f,
                " (the driver was replaced meanwhile: CPU not comparable)"
            )?;
        }
        Ok(())
    }
}

/// The supervisor and its driver over `secs` seconds.
async fn measure(sup: &Sup, secs: u64) -> Cost {
    let sup_pid = sup.0.id();
    let driver = one_child(sup_pid);
    let sample = CpuSample::take(sup_pid);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (cpu_pct, replaced) = sample.percent_since(sup_pid);
    Cost {
        rss_sup: rss_kib(sup_pid as i32),
        rss_driver: rss_kib(driver as i32),
        cpu_pct,
        replaced,
    }
}

fn one_child(sup: u32) -> u32 {
    let c = children(sup);
    assert_eq!(c.len(), 1, "one driver under the supervisor: {c:?}");
    c[0]
}

/// Registered processes, killed and reaped on drop.
struct Holders(Vec<Child>);

impl Drop for Holders {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// This binary as a process of the claim whose quota directory is `dir`,
/// once it has registered.
fn spawn_holder(dir: &Path) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .env("VCUDA_COST_HOLD", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(c.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "registered", "holder for {}", dir.display());
    c
}

/// In a holder: registers once on `dir`'s socket and keeps the connection
/// until killed (or its parent dies).
fn hold(dir: &Path) -> ! {
    // SAFETY: asks the kernel to kill this process with its parent.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let quota_config::Quota::Single(q) = quota_config::read_quota(dir).unwrap() else {
        panic!("a one-GPU claim");
    };
    let mut req = maximal_request(&q.pod_uid, &q.container_name);
    req.local_pid = std::process::id() as _;
    req.program = "cost-bench".into();
    let (_conn, resp, _fds) = register(dir, &req);
    assert_eq!(resp.status, 1, "accepted: {resp:?}");
    let mut out = std::io::stdout();
    writeln!(out, "registered").unwrap();
    out.flush().unwrap();
    loop {
        std::thread::park();
    }
}
