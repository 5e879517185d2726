//! Running a saturating C workload under the interposer and measuring what
//! it achieved from the sim's timeline (the ground truth), for the
//! accuracy benchmarks. The program prints `pid=N start_ns=T` when it
//! starts launching, runs for the seconds it is given, then exits 0.

use super::simnode::{self, Container, ShimNode};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

pub struct Running {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    pub pid: i32,
    pub start: u64,
}

/// Starts `prog args` in `c`; returns once it printed `start_ns=`.
pub fn start(c: &Container, prog: &Path, args: &[&str]) -> Running {
    start_with(c, prog, args, &[])
}

/// [`start`] with extra environment variables (the sim's test knobs).
pub fn start_with(c: &Container, prog: &Path, args: &[&str], env: &[(&str, &str)]) -> Running {
    let mut child = c
        .command(prog)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        // The interposer's log level while looking into a figure (off unless set).
        .env(
            "LOGGER_LEVEL",
            std::env::var("VCUDA_ACCURACY_LOG").unwrap_or_default(),
        )
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "workload ended early"
        );
        if line.contains("start_ns=") {
            break;
        }
    }
    let get = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap()
            .parse()
            .unwrap()
    };
    Running {
        pid: get("pid") as i32,
        start: get("start_ns"),
        child,
        out,
    }
}

impl Running {
    /// Runs every thread of the workload at nice `nice` (negative:
    /// favoured; root's CAP_SYS_NICE). For tests that time the sim's device
    /// through a workload that must wake promptly to keep it fed: a busy
    /// host then moves the figure less. Threads created later inherit it.
    /// Says on stderr when it cannot (the run goes on at its nice).
    pub fn favour(&self, nice: i32) {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid));
        let mut refused = Vec::new();
        for tid in tasks.into_iter().flatten().flatten() {
            let Some(tid) = tid.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
                continue;
            };
            // SAFETY: setpriority on a thread id we just listed; no pointers.
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
                refused.push(format!("{tid}: {}", std::io::Error::last_os_error()));
            }
        }
        if !refused.is_empty() {
            eprintln!(
                "workload {}: nice {nice} refused ({}): it runs at its own",
                self.pid,
                refused.join(", ")
            );
        }
    }

    /// Reads the workload's output until a line has `key=N`; N.
    pub fn wait_for(&mut self, key: &str) -> u64 {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "workload ended before printing {key}="
            );
            if let Some(v) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{key}=")))
            {
                return v.parse().unwrap();
            }
        }
    }
}

/// Waits for the workload to exit successfully; its remaining output.
pub fn finish(mut r: Running) -> String {
    let mut s = String::new();
    r.out.read_to_string(&mut s).unwrap();
    assert!(r.child.wait().unwrap().success(), "workload failed: {s}");
    s
}

pub fn sleep_until(t: u64) {
    let now = simnode::now_ns();
    if t > now {
        std::thread::sleep(Duration::from_nanos(t - now));
    }
}

pub const fn s(x: f64) -> u64 {
    (x * 1e9) as u64
}

/// Achieved percent of each workload over the same `window_s` window after
/// `warmup_s`. Each runs `prog args`, where the argument `{secs}` becomes
/// the run's length (warm-up + window + 0.5 s).
pub fn measure(
    n: &ShimNode,
    c: &[&Container],
    prog: &Path,
    args: &[&str],
    (warmup_s, window_s): (f64, f64),
) -> Vec<f64> {
    let secs = format!("{}", warmup_s + window_s + 0.5);
    let args: Vec<&str> = args
        .iter()
        .map(|a| if *a == "{secs}" { secs.as_str() } else { *a })
        .collect();
    let runs: Vec<Running> = c.iter().map(|c| start(c, prog, &args)).collect();
    let from = runs.iter().map(|r| r.start).max().unwrap() + s(warmup_s);
    let to = from + s(window_s);
    sleep_until(to + 20_000_000);
    let got = runs.iter().map(|r| n.busy(&[r.pid], from, to)).collect();
    for r in runs {
        finish(r);
    }
    got
}
