//! The real `gpu-manager` binary on the host (phases 1 and 2).

use std::fs;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use test_support::k8s::cluster::{Cluster, Work};
use test_support::k8s::util::{MANAGER_PORT, tail, wait};
use test_support::kv;
use test_support::{target_dir, workspace_root};

/// The real gpu-manager binary on the host, against the real kubelet.
pub struct HostManager {
    child: Option<Child>,
    log: PathBuf,
    args: Vec<String>,
    /// Run through this command (`nsenter` into another node's mount
    /// namespace); empty: directly.
    prefix: Vec<String>,
    port: u16,
}

/// Where a manager runs: its node, the simulated GPUs and state of `w`,
/// its query port, its node's containerd, and a command it runs under.
pub struct Site<'a> {
    pub node: &'a str,
    pub w: &'a Work,
    pub port: u16,
    pub containerd: PathBuf,
    pub prefix: Vec<String>,
}

impl HostManager {
    pub fn start(c: &Cluster, w: &Work) -> HostManager {
        HostManager::start_at(
            c,
            Site {
                node: &c.node,
                w,
                port: MANAGER_PORT,
                containerd: c.dir.join("containerd/containerd.sock"),
                prefix: Vec::new(),
            },
        )
    }

    pub fn start_at(c: &Cluster, site: Site) -> HostManager {
        let t = target_dir();
        let w = site.w;
        let args: Vec<String> = [
            "--share-mode",
            "--hostname-override",
            site.node,
            "--host-root",
            w.sim.to_str().unwrap(),
            "--volume-config",
            workspace_root()
                .join("config/volume.conf")
                .to_str()
                .unwrap(),
            "--interposer",
            t.join("libvcuda.so").to_str().unwrap(),
            "--kubeconfig",
            c.kubeconfig().to_str().unwrap(),
            "--vdriver-path",
            w.mgr.join("vdriver").to_str().unwrap(),
            "--virtual-manager-path",
            w.vm().to_str().unwrap(),
            "--checkpoint-path",
            w.mgr.join("checkpoint").to_str().unwrap(),
            "--display-socket",
            w.mgr.join("display.sock").to_str().unwrap(),
            "--query-port",
            &site.port.to_string(),
            // The node's containerd through CRI, with kubelet and the API
            // server, is what recovery asks.
            "--container-runtime",
            "containerd",
            "--container-runtime-endpoint",
            &format!("unix://{}", site.containerd.display()),
            "--xid-quiet-period",
            "5",
            "--allocation-check-period",
            "5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut m = HostManager {
            child: None,
            log: w.mgr.join("gpu-manager.log"),
            args,
            prefix: site.prefix,
            port: site.port,
        };
        m.spawn();
        m
    }

    pub fn spawn(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let bin = target_dir().join("gpu-manager");
        let mut cmd = match self.prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let child = cmd
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("gpu-manager (cargo build --workspace)");
        self.child = Some(child);
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn count(&self, needle: &str) -> usize {
        self.log_text().matches(needle).count()
    }

    pub fn ready(&self) -> bool {
        let addr: SocketAddr = ([127, 0, 0, 1], self.port).into();
        // A reset (a manager going down) is "not ready", not a failure.
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
            && test_support::process::try_http_get(addr, "/readyz").is_ok_and(|r| r.0 == 200)
    }

    pub fn wait_ready(&mut self, secs: u64) {
        wait("gpu-manager /readyz", secs, || {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                // Without the backtrace's frames: 40 of them hid the
                // error line itself.
                let log: String = self
                    .log_text()
                    .lines()
                    .filter(|l| !is_backtrace_frame(l))
                    .map(|l| format!("{l}\n"))
                    .collect();
                panic!("gpu-manager exited ({st}); log:\n{}", tail(&log, 40));
            }
            if self.ready() {
                Ok(())
            } else {
                Err(tail(&self.log_text(), 5))
            }
        });
    }

    /// kill -9 of the manager: its supervisor and the manager it runs (as a
    /// container's death would), back only once both are gone, so that no
    /// dying process still holds a port or socket the next start needs.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pids = test_support::process::tree(c.id());
            for &p in &pids {
                // SAFETY: our own child and its children.
                unsafe { libc::kill(p as i32, libc::SIGKILL) };
            }
            c.wait().unwrap();
            wait("the killed manager's processes gone", 30, || {
                let left: Vec<u32> = pids[1..]
                    .iter()
                    .copied()
                    .filter(|p| {
                        fs::read_to_string(format!("/proc/{p}/stat"))
                            .is_ok_and(|st| !st.contains(") Z "))
                    })
                    .collect();
                if left.is_empty() {
                    Ok(())
                } else {
                    Err(format!("{left:?}"))
                }
            });
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while c.try_wait().unwrap().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `took_us` of every "allocated" line so far.
    pub fn allocate_us(&self) -> Vec<u64> {
        self.allocate_field("took_us")
    }

    /// One microsecond field (`took_us`, `found_us`, `checkpoint_us`) of
    /// every "allocated" line so far, sorted.
    pub fn allocate_field(&self, field: &str) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .log_text()
            .lines()
            .filter(|l| l.contains(" allocated "))
            .filter_map(|l| kv(l).get(field).and_then(|x| x.parse().ok()))
            .collect();
        v.sort_unstable();
        v
    }
}

impl Drop for HostManager {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A line of a Rust backtrace's frames (`  12: name`, `      at file:line`).
fn is_backtrace_frame(line: &str) -> bool {
    let t = line.trim_start();
    t.starts_with("at ")
        || t.split_once(": ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}
