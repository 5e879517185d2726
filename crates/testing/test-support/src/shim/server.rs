//! The manager's side of the registration protocol, minimal, for tests and
//! benchmarks (the real manager reuses `container-ledger` the same way):
//!
//! * bind `<dir>/vcuda.sock`, create the ledger (`<dir>/ledger` here; the
//!   real manager keeps it in the container's vm directory);
//! * per connection: read a `RegisterRequest`, take the peer's PID from
//!   SO_PEERCRED, claim a ledger slot (the previous one when the process
//!   re-registers), rewrite `pids.config`, reply `ACCEPTED` with the slot and
//!   the ledger descriptor (SCM_RIGHTS);
//! * on EOF: clear the slot (the process died or closed), rewrite pids.
//!
//! [`TestManager::start_gpus`] serves a container whose share spans several
//! GPUs: one ledger per GPU (`quota_config::ledger_file(i)`), registration
//! protocol 2 only (a version-1 client is refused as the real manager
//! refuses it), a slot in every ledger and all descriptors in record order.
//!
//! Used by cuda-shim's example `test_manager` (for tests/python), its
//! benches and the workspace tests.

use container_ledger::{Ledger, fdpass};
use qos_page::{QosPage, Tier};
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use vcuda_api::vcuda::{
    MemoryRequest, MemoryResponse, QosFlag, RegisterRequest, RegisterResponse, frame,
    memory_request, memory_response, register_response::Status,
};

/// What the server saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Registered {
        pid: i32,
        slot: usize,
        previous_slot: Option<u32>,
        program: String,
    },
    Closed {
        pid: i32,
        slot: usize,
        freed: u64,
    },
}

struct Shared {
    dir: PathBuf,
    /// One per GPU, in record order.
    ledgers: Vec<(Ledger, std::fs::File)>,
    /// host PID -> its slot in the first ledger
    live: Mutex<BTreeMap<i32, usize>>,
    conns: Mutex<Vec<UnixStream>>,
    events: Mutex<Vec<Event>>,
    stopping: AtomicBool,
    /// Reply REJECTED to everyone (tests of the refusal path).
    reject: AtomicBool,
    /// The protocol version replies say they are in; 0 echoes the request's
    /// (tests of a manager of another version).
    answer_version: AtomicU32,
    /// The container's compute tier and its GPU's QoS page.
    qos: Mutex<Option<Qos>>,
}

/// A tier and a GPU's QoS page with its latency flags (shared by the
/// managers of the GPU's shares).
#[derive(Clone)]
pub struct Qos {
    pub tier: Tier,
    pub page: QosPage,
    pub file: Arc<std::fs::File>,
    /// Slot -> that latency process's flag.
    pub flags: Arc<Mutex<BTreeMap<usize, Arc<std::fs::File>>>>,
}

impl Qos {
    /// A fresh page for one GPU; give each share's manager a copy with its tier.
    pub fn page() -> Qos {
        let (page, file) = QosPage::create_sealed(0).unwrap();
        Qos {
            tier: Tier::Plain,
            page,
            file: Arc::new(file),
            flags: Default::default(),
        }
    }

    pub fn with(&self, tier: Tier) -> Qos {
        Qos {
            tier,
            ..self.clone()
        }
    }
}

pub struct TestManager {
    shared: Arc<Shared>,
    listener_fd: i32,
    accept: Option<std::thread::JoinHandle<()>>,
}

/// Writes `<dir>/vcuda.config` for an enforced container.
pub fn write_config(dir: &Path, quota: u64, driver_version: (i32, i32), enable: bool) {
    let d = quota_config::ResourceData {
        pod_uid: "pod-uid-1".into(),
        container_name: "main".into(),
        bus_id: "0000:01:00.0".into(),
        gpu_memory: quota,
        utilization: 50,
        hard_limit: true,
        driver_version,
        enable,
        ..Default::default()
    };
    quota_config::write_atomic(
        &dir.join(quota_config::CONFIG_FILE),
        &d.to_bytes().unwrap(),
        0o644,
        quota_config::Durability::Derived,
    )
    .unwrap();
}

impl TestManager {
    /// Serves `<dir>/vcuda.sock` with a ledger of `quota` bytes
    /// (`<dir>/ledger`, kept if present: a restarted manager keeps state).
    pub fn start(dir: &Path, quota: u64) -> TestManager {
        Self::start_gpus(dir, &[quota])
    }

    /// Serves a container with one ledger per GPU, `quotas[i]` bytes in
    /// `<dir>/ledger_file(i)` (kept if present).
    pub fn start_gpus(dir: &Path, quotas: &[u64]) -> TestManager {
        let sock = dir.join(quota_config::SOCKET_FILE);
        let _ = std::fs::remove_file(&sock);
        let ledgers = quotas
            .iter()
            .enumerate()
            .map(|(i, &q)| Ledger::create(&dir.join(quota_config::ledger_file(i)), q).unwrap())
            .collect();
        let listener = UnixListener::bind(&sock).unwrap();
        let listener_fd = listener.as_raw_fd();
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            ledgers,
            live: Mutex::new(BTreeMap::new()),
            conns: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
            reject: AtomicBool::new(false),
            answer_version: AtomicU32::new(0),
            qos: Mutex::new(None),
        });
        let s2 = Arc::clone(&shared);
        let accept = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s2.stopping.load(Ordering::Acquire) {
                    break;
                }
                let Ok(conn) = conn else { break };
                if let Ok(c) = conn.try_clone() {
                    s2.conns.lock().unwrap().push(c);
                }
                let s3 = Arc::clone(&s2);
                std::thread::spawn(move || serve(&s3, conn));
            }
        });
        TestManager {
            shared,
            listener_fd,
            accept: Some(accept),
        }
    }

    /// The first GPU's ledger (a one-GPU container's only one).
    pub fn ledger(&self) -> &Ledger {
        self.ledger_at(0)
    }

    /// The ledger of the GPU at `position` in record order.
    pub fn ledger_at(&self, position: usize) -> &Ledger {
        &self.shared.ledgers[position].0
    }

    pub fn events(&self) -> Vec<Event> {
        self.shared.events.lock().unwrap().clone()
    }

    /// Host PIDs with an open registration.
    pub fn live(&self) -> BTreeMap<i32, usize> {
        self.shared.live.lock().unwrap().clone()
    }

    pub fn set_reject(&self, on: bool) {
        self.shared.reject.store(on, Ordering::Release);
    }

    /// From now on, registrations get this tier and the page (latency: a
    /// slot in it, released when the process's connection closes).
    pub fn set_qos(&self, qos: Qos) {
        *self.shared.qos.lock().unwrap() = Some(qos);
    }

    /// Replies say they are in protocol `version` (0: the request's), as a
    /// manager of another release would answer.
    pub fn set_answer_version(&self, version: u32) {
        self.shared.answer_version.store(version, Ordering::Release);
    }

    /// Waits until `pred` holds on the events (or panics after `secs`).
    pub fn wait_for(&self, secs: u64, what: &str, pred: impl Fn(&[Event]) -> bool) {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            if pred(&self.events()) {
                return;
            }
            assert!(
                std::time::Instant::now() < end,
                "timed out waiting for {what}; events: {:?}",
                self.events()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Stops like a crashing manager: connections drop, slots are kept.
    pub fn crash(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        // SAFETY: shutdown on the listener fd this manager owns and has not closed.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        for c in self.shared.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(self.shared.dir.join(quota_config::SOCKET_FILE));
    }
}

impl Drop for TestManager {
    fn drop(&mut self) {
        self.halt();
    }
}

fn peer_pid(s: &UnixStream) -> i32 {
    // SAFETY: ucred is plain integers: all-zero is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills at most `len` bytes of our local ucred.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "SO_PEERCRED");
    cred.pid
}

fn write_pids(sh: &Shared) {
    let pids: Vec<i32> = sh.live.lock().unwrap().keys().copied().collect();
    let _ = quota_config::write_atomic(
        &sh.dir.join(quota_config::PIDS_FILE),
        &quota_config::encode_pids(&pids),
        0o644,
        quota_config::Durability::Derived,
    );
}

fn serve(sh: &Shared, mut conn: UnixStream) {
    let pid = peer_pid(&conn);
    let Ok(req) = frame::read::<RegisterRequest>(&mut conn) else {
        return;
    };
    let n = sh.ledgers.len();
    let refusal = if sh.reject.load(Ordering::Acquire) {
        Some("test manager rejects everyone".to_string())
    } else if req.protocol_version == frame::PROTOCOL_VERSION && n > 1 {
        Some(format!(
            "this container's share spans {n} GPUs; this interposer enforces one"
        ))
    } else {
        None
    };
    if let Some(message) = refusal {
        let resp = RegisterResponse {
            status: Status::Rejected as i32,
            message,
            host_pid: pid,
            ..Default::default()
        };
        let _ = frame::write(&mut conn, &resp);
        return;
    }
    let v2 = req.protocol_version == frame::PROTOCOL_VERSION_MULTI_GPU;
    let prefer: Vec<usize> = if v2 {
        req.previous_slots.iter().map(|&s| s as usize).collect()
    } else {
        req.previous_slot.map(|s| s as usize).into_iter().collect()
    };
    let mut slots = Vec::with_capacity(n);
    for (i, (l, _)) in sh.ledgers.iter().enumerate() {
        let Some(s) = l.claim_slot(pid, prefer.get(i).copied()) else {
            return;
        };
        slots.push(s);
    }
    let slot = slots[0];
    sh.live.lock().unwrap().insert(pid, slot);
    sh.events.lock().unwrap().push(Event::Registered {
        pid,
        slot,
        previous_slot: req.previous_slot,
        program: req.program.clone(),
    });
    let qos = sh
        .qos
        .lock()
        .unwrap()
        .clone()
        .filter(|_| n == 1 && req.qos_flags);
    let holder = qos
        .as_ref()
        .filter(|q| q.tier == Tier::Latency)
        .and_then(|q| q.page.claim(pid));
    let flag = qos.as_ref().zip(holder).map(|(q, h)| {
        let f = Arc::new(qos_page::make_flag(0, h.slot).unwrap());
        q.flags.lock().unwrap().insert(h.slot, f.clone());
        f
    });
    let resp = RegisterResponse {
        status: Status::Accepted as i32,
        message: String::new(),
        host_pid: pid,
        qos_tier: qos.as_ref().map_or(0, |q| q.tier.wire()),
        qos_page: qos.is_some(),
        qos_slot: holder.map(|h| h.slot as u32),
        ledger_slot: Some(slot as u32),
        ledger_slots: if v2 {
            slots.iter().map(|&s| s as u32).collect()
        } else {
            Vec::new()
        },
        protocol_version: match sh.answer_version.load(Ordering::Acquire) {
            0 => req.protocol_version,
            v => v,
        },
        ..Default::default()
    };
    let body = prost::Message::encode_to_vec(&resp);
    let mut fds: Vec<_> = sh.ledgers.iter().map(|(_, f)| f.as_fd()).collect();
    match (&qos, &flag) {
        (_, Some(f)) => fds.push(f.as_fd()),
        (Some(q), None) if q.tier != Tier::Latency => fds.push(q.file.as_fd()),
        _ => {}
    }
    if fdpass::send_frame_fds(conn.as_fd(), &body, &fds).is_err() {
        return;
    }
    // After the reply: the fsyncs of pids.config need not delay cuInit
    // (the interposer counts its own PID in anyway).
    write_pids(sh);
    // The connection lives as long as the process: it asks for the latency
    // flags (answered), nothing else is (memory requests are not served).
    while let Ok(req) = frame::read::<MemoryRequest>(&mut conn) {
        if req.kind == memory_request::Kind::QosFlags as i32
            && let Some(q) = &qos
        {
            answer_flags(&conn, q);
        }
    }
    if let (Some(q), Some(h)) = (&qos, holder) {
        q.flags.lock().unwrap().remove(&h.slot);
        q.page.release(h);
    }
    if sh.stopping.load(Ordering::Acquire) {
        return;
    }
    let freed = sh
        .ledgers
        .iter()
        .zip(&slots)
        .map(|((l, _), &s)| l.clear_slot(s))
        .sum();
    sh.live.lock().unwrap().remove(&pid);
    write_pids(sh);
    sh.events
        .lock()
        .unwrap()
        .push(Event::Closed { pid, slot, freed });
}

/// The sealed latency flags of `q`'s page, on one frame.
fn answer_flags(conn: &UnixStream, q: &Qos) {
    let flags: Vec<(usize, Arc<std::fs::File>)> = q
        .flags
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, f)| qos_page::Flag::is_sealed(&***f))
        .map(|(&s, f)| (s, f.clone()))
        .collect();
    let resp = MemoryResponse {
        status: memory_response::Status::Granted as i32,
        qos: true,
        qos_flags: flags
            .iter()
            .map(|(s, _)| QosFlag {
                page: 0,
                slot: *s as u32,
            })
            .collect(),
        ..Default::default()
    };
    let body = prost::Message::encode_to_vec(&resp);
    let fds: Vec<_> = flags.iter().map(|(_, f)| f.as_fd()).collect();
    let _ = fdpass::send_frame_fds(conn.as_fd(), &body, &fds);
}
