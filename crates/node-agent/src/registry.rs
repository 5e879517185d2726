//! `vcuda.sock` in every shared container's vm directory: each interposer
//! process connects once and keeps the connection. The kernel reports the
//! peer's host PID (SO_PEERCRED), which goes into `pids.config`; the reply
//! carries the container's ledger descriptor (SCM_RIGHTS) and the process's
//! ledger slot. When the connection closes the process is gone: its PID
//! leaves `pids.config` and its ledger slot is cleared.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use container_ledger::Ledger;
use prost::Message;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use vcuda_api::vcuda::frame::{MAX_FRAME, PROTOCOL_VERSION};
use vcuda_api::vcuda::{RegisterRequest, RegisterResponse, register_response::Status};

// Locks here guard maps changed by single inserts and removes: a panic
// elsewhere cannot leave them half-changed, so a poisoned lock is taken over.

/// One container's registration endpoint.
struct Endpoint {
    cancel: CancellationToken,
    procs: Arc<Procs>,
}

/// Registered processes of one container.
struct Procs {
    dir: PathBuf,
    pod_uid: String,
    container: String,
    ledger: Option<(Ledger, File)>,
    /// host PID -> (connections, ledger slot)
    pids: Mutex<BTreeMap<i32, (u32, Option<usize>)>>,
}

impl Procs {
    fn write_pids(&self, pids: &BTreeMap<i32, (u32, Option<usize>)>) {
        let list: Vec<i32> = pids.keys().copied().collect();
        let path = self.dir.join(quota_config::PIDS_FILE);
        // Derived state (rebuilt from live registrations): no fsync.
        if let Err(e) = crate::vm::replace_file(&path, &quota_config::encode_pids(&list), 0o644) {
            tracing::error!(error = %e, "writing pids.config");
        }
    }

    fn add(&self, pid: i32, prefer: Option<usize>) -> Option<usize> {
        let mut pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        let e = pids.entry(pid).or_insert((0, None));
        e.0 += 1;
        if e.1.is_none()
            && let Some((l, _)) = &self.ledger
        {
            e.1 = l.claim_slot(pid, prefer);
        }
        let slot = e.1;
        self.write_pids(&pids);
        slot
    }

    fn drop_conn(&self, pid: i32) {
        let mut pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(e) = pids.get_mut(&pid) else { return };
        e.0 -= 1;
        if e.0 == 0 {
            let (_, slot) = pids.remove(&pid).unwrap();
            if let (Some(s), Some((l, _))) = (slot, &self.ledger) {
                let freed = l.clear_slot(s);
                tracing::debug!(pid, slot = s, freed, "ledger slot cleared");
            }
            self.write_pids(&pids);
        }
    }

    /// Removes PIDs whose process is gone (a backstop: closing the
    /// connection normally does it) and returns how many.
    fn prune(&self) -> usize {
        let mut pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        let dead: Vec<i32> = pids.keys().copied().filter(|&p| !alive(p)).collect();
        for p in &dead {
            if let Some((_, Some(s))) = pids.remove(p)
                && let Some((l, _)) = &self.ledger
            {
                l.clear_slot(s);
            }
        }
        if !dead.is_empty() {
            self.write_pids(&pids);
        }
        dead.len()
    }
}

/// Whether a host PID is alive (the manager runs in the host PID namespace).
pub fn alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks that the PID exists; it sends nothing.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// A container's counters kept by its interposers in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerCounters {
    pub throttled_ns: u64,
    pub refused_allocations: u64,
    /// The compute controller cannot attribute NVML samples to the
    /// container (`Ledger::compute_unattributed`, non-zero).
    pub compute_unattributed: bool,
}

#[derive(Clone, Default)]
pub struct Registry {
    endpoints: Arc<Mutex<HashMap<String, Endpoint>>>,
}

impl Registry {
    /// Serves `<dir>/vcuda.sock` for the container until [`Registry::stop`].
    /// PIDs already in `pids.config` that are still alive are kept (a
    /// restarted manager); the ledger is never truncated.
    pub fn serve(
        &self,
        id: &str,
        dir: &Path,
        pod_uid: &str,
        container: &str,
        ledger: Option<(Ledger, File)>,
    ) -> std::io::Result<()> {
        self.stop(id);
        let sock = dir.join(quota_config::SOCKET_FILE);
        let _ = std::fs::remove_file(&sock);
        let listener = UnixListener::bind(&sock)?;
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666))?;
        let old: BTreeMap<i32, (u32, Option<usize>)> =
            std::fs::read(dir.join(quota_config::PIDS_FILE))
                .ok()
                .and_then(|b| quota_config::decode_pids(&b).ok())
                .unwrap_or_default()
                .into_iter()
                .filter(|&p| alive(p))
                // No connection yet: the process reconnects on its own (or is pruned).
                .map(|p| (p, (0, None)))
                .collect();
        let procs = Arc::new(Procs {
            dir: dir.to_path_buf(),
            pod_uid: pod_uid.to_string(),
            container: container.to_string(),
            ledger,
            pids: Mutex::new(old),
        });
        procs.prune();
        let cancel = CancellationToken::new();
        let (c, p) = (cancel.clone(), procs.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    _ = c.cancelled() => return,
                    a = listener.accept() => a,
                };
                match conn {
                    Ok((stream, _)) => {
                        let (p, c) = (p.clone(), c.clone());
                        tokio::spawn(async move {
                            if let Err(e) = handle(stream, &p, &c).await {
                                tracing::warn!(container = %p.container, error = %e, "registration connection");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept on vcuda.sock");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.to_string(), Endpoint { cancel, procs });
        Ok(())
    }

    pub fn stop(&self, id: &str) {
        if let Some(e) = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id)
        {
            e.cancel.cancel();
            let _ = std::fs::remove_file(e.procs.dir.join(quota_config::SOCKET_FILE));
        }
    }

    /// Registered host PIDs of a container.
    pub fn pids(&self, id: &str) -> Vec<i32> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .map(|e| {
                e.procs
                    .pids
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .keys()
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The container's ledger counters: (ns its launches slept for compute
    /// tokens, allocations refused for its memory quota). `None` when the
    /// container is not served or keeps no ledger.
    pub fn ledger_counters(&self, id: &str) -> Option<LedgerCounters> {
        let eps = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (l, _) = eps.get(id)?.procs.ledger.as_ref()?;
        Some(LedgerCounters {
            throttled_ns: l.throttled_ns(),
            refused_allocations: l.refused_allocations(),
            compute_unattributed: l.compute_unattributed() != 0,
        })
    }

    pub fn prune(&self) -> usize {
        let eps: Vec<Arc<Procs>> = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|e| e.procs.clone())
            .collect();
        eps.iter().map(|p| p.prune()).sum()
    }
}

async fn read_request(stream: &mut UnixStream) -> std::io::Result<RegisterRequest> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds {MAX_FRAME}"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    RegisterRequest::decode(body.as_slice()).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad RegisterRequest: {e}"),
        )
    })
}

async fn send(
    stream: &UnixStream,
    resp: &RegisterResponse,
    ledger: Option<&File>,
) -> std::io::Result<()> {
    let body = resp.encode_to_vec();
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || {
            container_ledger::fdpass::send_frame(stream.as_fd(), &body, ledger.map(|f| f.as_fd()))
        }) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

async fn handle(
    mut stream: UnixStream,
    procs: &Procs,
    cancel: &CancellationToken,
) -> std::io::Result<()> {
    let cred = stream.peer_cred()?;
    let Some(pid) = cred.pid().filter(|&p| p > 0) else {
        return Err(std::io::Error::other("peer has no PID (SO_PEERCRED)"));
    };
    let req = tokio::time::timeout(Duration::from_secs(5), read_request(&mut stream))
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no RegisterRequest within 5 s",
            )
        })??;
    let reject = |message: String| RegisterResponse {
        status: Status::Rejected as i32,
        message,
        host_pid: pid,
        ledger_slot: None,
    };
    if req.protocol_version != PROTOCOL_VERSION {
        let m = format!(
            "protocol version {} is not supported; the manager speaks {PROTOCOL_VERSION}",
            req.protocol_version
        );
        send(&stream, &reject(m), None).await?;
        return Ok(());
    }
    if req.pod_uid != procs.pod_uid || req.container_name != procs.container {
        let m = format!(
            "this socket serves pod {} container {}, not pod {} container {}",
            procs.pod_uid, procs.container, req.pod_uid, req.container_name
        );
        tracing::warn!(pid, "{m}");
        send(&stream, &reject(m), None).await?;
        return Ok(());
    }
    let slot = procs.add(pid, req.previous_slot.map(|s| s as usize));
    tracing::info!(
        pid, local_pid = req.local_pid, program = %req.program,
        pod = %procs.pod_uid, container = %procs.container, slot = ?slot,
        "interposer registered"
    );
    let resp = RegisterResponse {
        status: Status::Accepted as i32,
        message: String::new(),
        host_pid: pid,
        ledger_slot: slot.map(|s| s as u32),
    };
    let ledger = slot.and(procs.ledger.as_ref()).map(|(_, f)| f);
    let r = send(&stream, &resp, ledger).await;
    if r.is_ok() {
        // The process holds the connection for its life; EOF means it is gone.
        let mut buf = [0u8; 256];
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                n = stream.read(&mut buf) => match n {
                    Ok(0) | Err(_) => break,
                    Ok(_) => continue,
                },
            }
        }
    }
    if !cancel.is_cancelled() {
        procs.drop_conn(pid);
        tracing::info!(pid, container = %procs.container, "interposer disconnected");
    }
    r
}
