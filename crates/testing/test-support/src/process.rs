//! Processes and sockets: a process's command line, what a program
//! printed as `key=value` words, one HTTP GET.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One HTTP/1.1 GET with `Connection: close`: the status code (0 when the
/// answer has none) and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    try_http_get(addr, path).unwrap()
}

/// [`http_get`], its I/O errors returned: for polls, where a server not up
/// yet (or one going down) is no failure.
pub fn try_http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let code = raw.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    Ok((code, body))
}

/// The command line of process `pid`, read back from /proc.
pub fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// The `key=value` words a program printed (tests/c/*.c print their
/// figures so).
pub fn kv(text: &str) -> std::collections::HashMap<String, String> {
    text.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `pid` and its descendants (from `/proc/<pid>/task/*/children`), parents
/// first: a supervised daemon is a supervisor and its child.
pub fn tree(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        let tasks = std::fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten();
        for t in tasks.flatten() {
            let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            out.extend(
                kids.split_whitespace()
                    .filter_map(|k| k.parse::<u32>().ok()),
            );
        }
        i += 1;
    }
    out
}

/// utime + stime of `pid`, in clock ticks (0 once it is gone).
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's closing parenthesis: state is field 3, utime
    // and stime fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    rest.split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse::<u64>().ok())
        .sum()
}

/// The CPU a process tree (a supervised daemon) used from one moment on.
pub struct CpuSample {
    pids: Vec<u32>,
    ticks: u64,
    at: std::time::Instant,
}

impl CpuSample {
    pub fn take(root: u32) -> CpuSample {
        let pids = tree(root);
        CpuSample {
            ticks: pids.iter().map(|&p| cpu_ticks(p)).sum(),
            pids,
            at: std::time::Instant::now(),
        }
    }

    /// Percent of one core the same processes used since [`Self::take`],
    /// and whether the tree changed meanwhile (a restarted child: the
    /// figure is then not comparable).
    pub fn percent_since(&self, root: u32) -> (f64, bool) {
        let ticks: u64 = self.pids.iter().map(|&p| cpu_ticks(p)).sum();
        // SAFETY: sysconf reads a constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let pct =
            ticks.saturating_sub(self.ticks) as f64 / hz / self.at.elapsed().as_secs_f64() * 100.0;
        (pct, tree(root) != self.pids)
    }
}

/// The host's CPU time from a point on, and the share of it some processes
/// took: what a figure that a busy host moves was measured beside.
pub struct HostCpu {
    host: (u64, u64),
    pids: Vec<(u32, u64)>,
}

impl HostCpu {
    /// From now, for `pids` (still running at [`HostCpu::since`]).
    pub fn now(pids: &[u32]) -> HostCpu {
        HostCpu {
            host: host_ticks(),
            pids: pids.iter().map(|&p| (p, cpu_ticks(p))).collect(),
        }
    }

    /// "busy B of N cores, P of them the workloads" since [`HostCpu::now`].
    pub fn since(&self) -> String {
        let (busy, total) = host_ticks();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let span = total.saturating_sub(self.host.1).max(1) as f64;
        let share = |t: u64| t as f64 / span * cores;
        let ours: u64 = self
            .pids
            .iter()
            .map(|&(p, t0)| cpu_ticks(p).saturating_sub(t0))
            .sum();
        format!(
            "the host was busy {:.2} of {cores} cores, {:.2} of them the workloads",
            share(busy.saturating_sub(self.host.0)),
            share(ours)
        )
    }
}

/// /proc/stat's first line: (busy, all) in ticks, across CPUs.
fn host_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let all: u64 = f.iter().take(8).sum();
    // idle and iowait
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    (all.saturating_sub(idle), all)
}

/// `hold_memory MIB`: allocates, prints what it sees, holds until stdin
/// says so. Returns the child and its first line.
pub fn hold(cmd: &mut std::process::Command, mib: u64) -> (std::process::Child, String) {
    let mut c = cmd
        .arg(mib.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(c.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    (c, line)
}

/// `key=value` of hold_memory's line.
pub fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

pub fn release(mut c: std::process::Child) -> String {
    let _ = std::io::Write::write_all(c.stdin.as_mut().unwrap(), b"\n");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut c.stdout.take().unwrap(), &mut out).unwrap();
    assert!(c.wait().unwrap().success(), "{out}");
    out
}
