//! A tensor-parallel (TP = 2) serving workload, `tests/c/tp_serve.c`: two
//! ranks of one container, rank `r` on CUDA device `r`, that size a KV
//! cache from `cuMemGetInfo`, exchange buffers over CUDA IPC and POSIX-fd
//! VMM handles, capture graphs for four batch sizes and serve requests in
//! replays. The same run and the same checks serve every path a container
//! gets its share by: the interposer's own test manager
//! (`tests/shim_tp_serving.rs`), the device plugins through the emulated
//! kubelet (`tests/manager_shares.rs`) and the DRA driver
//! (`crates/node/dra-driver/tests/sim_shares.rs`).

use gpu_sim_core::SharedState;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

const MIB: u64 = 1 << 20;
/// The caching allocator's expandable-segment step (tp_serve.c SEGMENT).
pub const SEGMENT: u64 = 20 * MIB;
/// CUDA_ERROR_OUT_OF_MEMORY.
const OOM: u64 = 2;

/// What the ranks are told: the fraction of each GPU's memory the server
/// may use (vLLM's `gpu_memory_utilization`), the weights, how long to
/// serve.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub util_percent: u32,
    pub weights_mib: u64,
    pub seconds: f64,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            util_percent: 90,
            weights_mib: 256,
            seconds: 7.0,
        }
    }
}

struct RankProc {
    child: Child,
    out: BufReader<ChildStdout>,
    text: String,
}

impl RankProc {
    /// Reads lines until one starts with `key=`; panics (with everything
    /// the rank said) when it ends first.
    fn read_until(&mut self, key: &str) {
        let want = format!("{key}=");
        while !self.text.lines().any(|l| l.starts_with(&want)) {
            let mut line = String::new();
            if self.out.read_line(&mut line).unwrap() == 0 {
                let mut err = String::new();
                if let Some(e) = self.child.stderr.as_mut() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!(
                    "the rank ended before {key}:\n{}\nstderr:\n{err}",
                    self.text
                );
            }
            self.text.push_str(&line);
        }
    }
}

/// How long the ranks may take from start to `ok=1`: a hang (a rank
/// waiting on the other forever) then ends in a panic with what each rank
/// said, not in a test that never returns. A run takes under 30 s on a
/// loaded 2-core machine.
const RANKS_DEADLINE: Duration = Duration::from_secs(300);

/// Both ranks, running.
pub struct TpServe {
    ranks: Vec<RankProc>,
    /// Dropped with the ranks' handle, which ends the watchdog's wait;
    /// past [`RANKS_DEADLINE`] it kills them instead.
    _watchdog: std::sync::mpsc::Sender<()>,
}

/// Kills `pids` unless the returned sender is dropped within
/// [`RANKS_DEADLINE`]: their pipes close, and the reader's panic shows
/// what they printed.
fn watchdog(pids: Vec<u32>) -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if rx.recv_timeout(RANKS_DEADLINE) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            eprintln!("tp_serve: the ranks did not finish in {RANKS_DEADLINE:?}; killing them");
            for p in pids {
                // SAFETY: a plain kill(2); the ranks are not reaped before
                // the sender is dropped.
                unsafe { libc::kill(p as i32, libc::SIGKILL) };
            }
        }
    });
    tx
}

/// What a rank printed: `key=value` lines.
pub type Report = HashMap<String, String>;

impl TpServe {
    /// Starts rank 0 and rank 1 of `prog` (tp_serve compiled for the node),
    /// each from `command(prog)` (the container's environment), meeting at
    /// `sock`.
    pub fn start(
        prog: &Path,
        command: impl Fn(&Path) -> Command,
        sock: &Path,
        w: Workload,
    ) -> TpServe {
        let _ = std::fs::remove_file(sock);
        let ranks = (0..2)
            .map(|rank| {
                let mut child = command(prog)
                    .arg(rank.to_string())
                    .arg(sock)
                    .arg(w.util_percent.to_string())
                    .arg(w.weights_mib.to_string())
                    .arg(w.seconds.to_string())
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap_or_else(|e| panic!("{}: {e}", prog.display()));
                let out = BufReader::new(child.stdout.take().unwrap());
                RankProc {
                    child,
                    out,
                    text: String::new(),
                }
            })
            .collect::<Vec<RankProc>>();
        let _watchdog = watchdog(ranks.iter().map(|r| r.child.id()).collect());
        TpServe { ranks, _watchdog }
    }

    /// Waits until both ranks serve; their pids and serving start
    /// (CLOCK_MONOTONIC ns, the sim's clock).
    pub fn serving(&mut self) -> [(i32, u64); 2] {
        let mut out = [(0, 0); 2];
        for (i, r) in self.ranks.iter_mut().enumerate() {
            r.read_until("serve_start_ns");
            let k = crate::kv(&r.text);
            out[i] = (num(&k, "pid") as i32, num(&k, "serve_start_ns"));
        }
        out
    }

    /// Waits until both ranks have served and hold everything (paused).
    pub fn paused(&mut self) -> [Report; 2] {
        for r in &mut self.ranks {
            r.read_until("paused");
        }
        [
            crate::kv(&self.ranks[0].text),
            crate::kv(&self.ranks[1].text),
        ]
    }

    /// Lets both ranks tear down and exit; panics unless both succeed.
    pub fn finish(mut self) {
        for mut r in std::mem::take(&mut self.ranks) {
            let mut stdin = r.child.stdin.take().unwrap();
            let _ = stdin.write_all(b"go\n");
            drop(stdin);
            let mut rest = String::new();
            r.out.read_to_string(&mut rest).unwrap();
            r.text.push_str(&rest);
            let mut err = String::new();
            r.child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            let st = r.child.wait().unwrap();
            assert!(
                st.success() && r.text.contains("ok=1"),
                "a rank failed ({st}):\n{}\nstderr:\n{err}",
                r.text
            );
        }
    }
}

impl Drop for TpServe {
    /// Ranks a panicking test leaves are killed (then the watchdog's
    /// sender is dropped and it stands down).
    fn drop(&mut self) {
        for r in &mut self.ranks {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

/// A numeric value of a rank's report; panics naming the key.
pub fn num(k: &Report, key: &str) -> u64 {
    k.get(key)
        .unwrap_or_else(|| panic!("no {key} in {k:?}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key}={}: {e}", k[key]))
}

fn signed(k: &Report, key: &str) -> i64 {
    k.get(key)
        .unwrap_or_else(|| panic!("no {key} in {k:?}"))
        .parse()
        .unwrap()
}

/// The memory rules a rank's report must show, with `quota` its GPU's
/// memory quota (the share's part of that GPU):
///
/// - the view is the GPU's quota, and the KV cache is sized from it as
///   vLLM sizes it (requested = quota x utilization, less what the
///   process holds after profiling), in whole 20 MiB handles;
/// - opening the peer's IPC buffer and importing its VMM handle charge
///   the opener nothing (they are the exporter's, on the exporter's GPU);
/// - every KV handle is charged, exactly;
/// - one allocation past the quota, by `cuMemCreate` and `cuMemAlloc`, is
///   `CUDA_ERROR_OUT_OF_MEMORY` at the call, changes nothing, and the
///   server goes on (graphs captured, requests served);
/// - NVML inside the share shows the same GPU at the same quota and used
///   figure, and its per-process numbers add up to it.
///
/// Returns what the container holds on the rank's GPU (the ledger's used).
pub fn check_rank(rank: usize, k: &Report, quota: u64, w: Workload) -> u64 {
    let why = format!("rank {rank} (quota {} MiB): {k:?}", quota / MIB);
    assert_eq!(num(k, "total"), quota, "the GPU's quota is the view. {why}");
    let requested = quota / 100 * u64::from(w.util_percent);
    assert_eq!(num(k, "requested"), requested, "{why}");
    assert_eq!(signed(k, "ipc_charged"), 0, "IPC-opened memory. {why}");
    assert_eq!(
        signed(k, "nccl_charged"),
        0,
        "an imported VMM handle. {why}"
    );
    let profiled = num(k, "profiled_free");
    let target = requested - (quota - profiled);
    assert_eq!(num(k, "kv_target"), target, "{why}");
    let kv = target / SEGMENT * SEGMENT;
    assert_eq!(num(k, "kv_err"), 0, "{why}");
    assert_eq!(num(k, "kv_bytes"), kv, "{why}");
    assert!(kv > 0, "no room for a KV cache. {why}");
    let after_kv = num(k, "kv_free");
    assert_eq!(
        after_kv,
        profiled - kv,
        "each KV handle charged once. {why}"
    );
    assert_eq!(num(k, "over_create"), OOM, "{why}");
    assert_eq!(num(k, "over_alloc"), OOM, "{why}");
    assert_eq!(
        num(k, "refused_free"),
        after_kv,
        "a refusal holds nothing. {why}"
    );
    assert_eq!(num(k, "graphs"), 4, "{why}");
    assert!(num(k, "served") > 0, "{why}");
    let used = quota - num(k, "end_free");
    assert_eq!(num(k, "nvml_total"), quota, "NVML's total. {why}");
    assert_eq!(num(k, "nvml_used"), used, "NVML's used. {why}");
    assert_eq!(
        num(k, "nvml_procs_sum"),
        used,
        "NVML's per-process numbers add up to the used figure. {why}"
    );
    used
}

/// Percent of `[from, to)` that `pid` kept the node's `gpu` busy, from
/// the sim's timeline (ground truth, not NVML's samples).
pub fn busy(state: &SharedState, gpu: usize, pid: i32, from: u64, to: u64) -> f64 {
    state
        .process_utilization(gpu, from, to)
        .into_iter()
        .filter(|(p, _)| p.host_pid.unwrap_or(p.ns_pid) as i32 == pid || p.ns_pid as i32 == pid)
        .map(|(_, pct)| pct)
        .sum()
}

/// What each tenant kept each of the two GPUs busy, in percent.
#[derive(Debug)]
pub struct Shares {
    /// The TP ranks: rank r on `gpus[r]`.
    pub server: [f64; 2],
    /// The second tenant's load on `gpus[0]` and `gpus[1]`.
    pub load: [f64; 2],
}

/// Runs `load` (tests/c/multi_gpu.c `compute SECONDS`, in the second
/// tenant's container with both GPUs visible) while the ranks serve, and
/// measures both tenants on the node's `gpus` over 3 s after 2 s of
/// warm-up (the controllers settle in ~2 s). The load must run at least
/// 5.5 s and the ranks serve at least 1.5 s longer; read while every
/// process lives (the sim forgets exited ones).
pub fn beside(
    tp: &mut TpServe,
    state: &SharedState,
    gpus: [usize; 2],
    mut load: Command,
) -> Shares {
    let serving = tp.serving();
    let mut other = load
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(other.stdout.take().unwrap());
    let mut text = String::new();
    while !text.contains("start_ns=") {
        let mut line = String::new();
        assert_ne!(
            out.read_line(&mut line).unwrap(),
            0,
            "the load ended: {text}"
        );
        text.push_str(&line);
    }
    let head = crate::kv(&text);
    let pid = num(&head, "pid") as i32;
    let from = num(&head, "start_ns").max(serving[0].1).max(serving[1].1) + 2_000_000_000;
    let to = from + 3_000_000_000;
    let now = crate::shim::simnode::now_ns();
    if to + 20_000_000 > now {
        std::thread::sleep(Duration::from_nanos(to + 20_000_000 - now));
    }
    let shares = Shares {
        server: [0, 1].map(|r| busy(state, gpus[r], serving[r].0, from, to)),
        load: [0, 1].map(|r| busy(state, gpus[r], pid, from, to)),
    };
    out.read_to_string(&mut text).unwrap();
    let mut err = String::new();
    other
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        other.wait().unwrap().success(),
        "the load failed:\n{text}\n{err}"
    );
    for d in 0..2 {
        assert_eq!(
            crate::kv(&text)
                .get(&format!("d{d}_launch_err"))
                .map(String::as_str),
            Some("0"),
            "the load's launches on device {d}:\n{text}\n{err}"
        );
    }
    eprintln!("busy per GPU {gpus:?}: {shares:?}");
    shares
}

/// One tenant of the two GPUs: how its programs run, its share of each.
pub struct Tenant<'a> {
    /// `program` in the container (its environment; both GPUs visible,
    /// in the order of `mem`).
    pub command: &'a dyn Fn(&Path) -> Command,
    /// Memory quota on CUDA device 0 and 1 of the container.
    pub mem: [u64; 2],
    /// Hard compute quota on device 0 and 1, in percent.
    pub cores: [f64; 2],
    /// What the container's ledger for device `i`'s GPU holds now.
    pub ledger_used: &'a dyn Fn(usize) -> u64,
}

/// The programs, compiled against the node: tests/c/tp_serve.c and
/// tests/c/multi_gpu.c.
pub struct Programs {
    pub tp: PathBuf,
    pub load: PathBuf,
    /// Where the ranks meet.
    pub sock: PathBuf,
}

/// The whole workload: `server`'s two ranks serve while `other` saturates
/// both GPUs (node GPUs `gpus`, in CUDA device order); then, while the
/// ranks hold everything, each rank's memory rules ([`check_rank`]) and
/// ledger, and `other` filling each GPU to its own quota (`ctx`: what a
/// context holds); then each tenant held to its compute quota on each GPU
/// (sim timeline), and every ledger empty once the processes are gone.
pub fn serve_beside(
    state: &SharedState,
    gpus: [usize; 2],
    p: &Programs,
    server: &Tenant,
    other: &Tenant,
    w: Workload,
    ctx: u64,
) -> Shares {
    let mut tp = TpServe::start(&p.tp, server.command, &p.sock, w);
    let mut load = (other.command)(&p.load);
    load.args(["compute", "6"]);
    let shares = beside(&mut tp, state, gpus, load);
    let reports = tp.paused();
    for (rank, k) in reports.iter().enumerate() {
        let used = check_rank(rank, k, server.mem[rank], w);
        assert_eq!(
            (server.ledger_used)(rank),
            used,
            "GPU {}'s ledger holds what rank {rank} sees held",
            gpus[rank]
        );
    }
    other_fills_its_quota(other, p, gpus, ctx);
    tp.finish();
    held_to_cores(&shares, server, other, gpus);
    for (t, name) in [(server, "server"), (other, "other tenant")] {
        for (i, gpu) in gpus.iter().enumerate() {
            let start = std::time::Instant::now();
            while (t.ledger_used)(i) != 0 {
                assert!(
                    start.elapsed().as_secs() < 10,
                    "the {name}'s ledger for GPU {gpu} once its processes are gone: {}",
                    (t.ledger_used)(i)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    shares
}

/// The ledgers of the share in the vm directory `dir` (its
/// `vcuda-gpus.config` and its live ledgers, in record order), in
/// the order of `uuids` (the container's CUDA devices).
pub fn ledgers_by_device(dir: &Path, uuids: &[String]) -> Vec<container_ledger::Ledger> {
    let quota_config::Quota::Multi(q) = quota_config::read_quota(dir).unwrap() else {
        panic!("{}: not a share on several GPUs", dir.display());
    };
    uuids
        .iter()
        .map(|u| {
            let i = q
                .gpus
                .iter()
                .position(|g| &g.uuid == u)
                .unwrap_or_else(|| panic!("{u} is none of {:?}", q.gpus));
            crate::ledger::live(dir, i)
        })
        .collect()
}

/// `other` fills each GPU to its own quota (`ctx`: a context's bytes)
/// while the server holds everything.
fn other_fills_its_quota(other: &Tenant, p: &Programs, gpus: [usize; 2], ctx: u64) {
    let o = (other.command)(&p.load)
        .args(["alloc", "64"])
        .output()
        .unwrap();
    let k = crate::kv(&String::from_utf8_lossy(&o.stdout));
    let why = format!("{k:?}\n{}", String::from_utf8_lossy(&o.stderr));
    for (d, gpu) in gpus.iter().enumerate() {
        let quota = other.mem[d];
        assert_eq!(num(&k, &format!("d{d}_total")), quota, "{why}");
        assert_eq!(
            num(&k, &format!("d{d}_filled")),
            (quota - ctx) / (64 * MIB) * (64 * MIB),
            "the other tenant fills GPU {gpu} to its own quota. {why}"
        );
        assert_eq!(num(&k, &format!("d{d}_err")), OOM, "{why}");
    }
}

/// Each tenant within its hard compute quota on each GPU, and near it.
/// The load saturates; the server has one replay in flight a rank and
/// meets the other rank between replays, so a host that runs it late
/// costs it device time: a replay that arrives while the load holds the
/// GPU waits for the load's timeslice to end. A hard 50 % server held
/// 48.5-50.1 % on an idle 2-core host and 39.3 % in one CI run with the
/// binary's other tests beside it.
fn held_to_cores(shares: &Shares, server: &Tenant, other: &Tenant, gpus: [usize; 2]) {
    for (g, gpu) in gpus.iter().enumerate() {
        let (s, l) = (shares.server[g], shares.load[g]);
        let (sq, lq) = (server.cores[g], other.cores[g]);
        assert!(
            (sq - 15.0..=sq + 4.0).contains(&s),
            "the server on GPU {gpu}: {s:.1}% under a hard {sq}%"
        );
        assert!(
            (lq - 10.0..=lq + 4.0).contains(&l),
            "the other tenant on GPU {gpu}: {l:.1}% under a hard {lq}%"
        );
    }
}

/// A tenant whose share splits evenly over the two GPUs (what the device
/// plugins and a DRA claim of `count: 2` give): `mem` and `cores` on each,
/// its ledgers in CUDA device order.
pub struct EvenTenant<'a> {
    pub command: &'a dyn Fn(&Path) -> Command,
    pub mem: u64,
    pub cores: f64,
    pub ledgers: &'a [container_ledger::Ledger],
}

/// [`serve_beside`] for two [`EvenTenant`]s, with the default workload and
/// each GPU's context size from the node.
pub fn serve_beside_even(
    state: &SharedState,
    gpus: [usize; 2],
    p: &Programs,
    server: EvenTenant,
    other: EvenTenant,
) -> Shares {
    let ctx = state.node().gpus[gpus[0]].context_overhead_bytes() + 8 * MIB;
    let (sl, ol) = (server.ledgers, other.ledgers);
    serve_beside(
        state,
        gpus,
        p,
        &Tenant {
            command: server.command,
            mem: [server.mem; 2],
            cores: [server.cores; 2],
            ledger_used: &|i| sl[i].used(),
        },
        &Tenant {
            command: other.command,
            mem: [other.mem; 2],
            cores: [other.cores; 2],
            ledger_used: &|i| ol[i].used(),
        },
        Workload::default(),
        ctx,
    )
}
