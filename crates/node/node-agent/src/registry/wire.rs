//! The connection side of `vcuda.sock`: a registration's frames, its
//! checks and answer, and the held connection's memory requests.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use qos_page::Tier;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;
use vcuda_api::vcuda::frame::{PROTOCOL_VERSION, PROTOCOL_VERSION_MULTI_GPU};
use vcuda_api::vcuda::{
    MemoryRequest, MemoryResponse, QosFlag, RegisterRequest, RegisterResponse, memory_request,
    register_response::Status,
};

use super::budget::{self, Allowance, MAX_REQUEST};
use super::{Procs, Registry};

async fn read_request(stream: &mut UnixStream) -> std::io::Result<RegisterRequest> {
    let body = read_frame(stream).await?;
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
    ledgers: &[&File],
) -> std::io::Result<()> {
    send_body(stream, &resp.encode_to_vec(), ledgers).await
}

/// One frame with `files` attached (SCM_RIGHTS). A full socket buffer
/// parks the frame where it stopped and goes on from there.
async fn send_body(stream: &UnixStream, body: &[u8], files: &[&File]) -> std::io::Result<()> {
    let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
    let mut out = container_ledger::fdpass::Outgoing::new(body, &fds);
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || out.send(stream.as_fd())) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// Why a client speaking `version` cannot register for a container with
/// `gpus` ledgers, if it cannot.
fn version_problem(version: u32, gpus: usize) -> Option<String> {
    match version {
        PROTOCOL_VERSION if gpus > 1 => Some(format!(
            "this container's share spans {gpus} GPUs; this interposer enforces one \
             (registration protocol {PROTOCOL_VERSION}): use an interposer that speaks \
             protocol {PROTOCOL_VERSION_MULTI_GPU}"
        )),
        PROTOCOL_VERSION | PROTOCOL_VERSION_MULTI_GPU => None,
        v => Some(format!(
            "protocol version {v} is not supported; the manager speaks \
             {PROTOCOL_VERSION} and {PROTOCOL_VERSION_MULTI_GPU}"
        )),
    }
}

pub(super) async fn handle(
    mut stream: UnixStream,
    procs: &Arc<Procs>,
    reg: &Registry,
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
    // Only what the answer and the logs need outlives the request.
    let (counted, r) = answer(&stream, procs, pid, req).await;
    if !counted {
        return r;
    }
    if r.is_ok() {
        hold(&mut stream, procs, reg, pid, cancel).await;
    }
    if !cancel.is_cancelled() {
        procs.drop_conn(pid);
        if let Allowance::Log { dropped } = procs.logs.take() {
            tracing::info!(pid, container = %procs.container, dropped, "interposer disconnected");
        }
    }
    r
}

/// Checks the request and answers it. `true` when the process was counted
/// (its connection is dropped when it ends), with how sending went.
async fn answer(
    stream: &UnixStream,
    procs: &Procs,
    pid: i32,
    req: RegisterRequest,
) -> (bool, std::io::Result<()>) {
    let reject = |message: String| RegisterResponse {
        status: Status::Rejected as i32,
        message,
        host_pid: pid,
        ledger_slot: None,
        ledger_slots: Vec::new(),
        protocol_version: req.protocol_version,
        ..Default::default()
    };
    let refused = version_problem(req.protocol_version, procs.ledgers.len())
        .or_else(|| budget::check_request(&req, procs.ledgers.len()).err())
        .or_else(|| {
            (req.pod_uid != procs.pod_uid || req.container_name != procs.container).then(|| {
                format!(
                    "this socket serves pod {} container {}, not pod {} container {}",
                    procs.pod_uid,
                    procs.container,
                    budget::printable(&req.pod_uid),
                    budget::printable(&req.container_name)
                )
            })
        });
    if let Some(m) = refused {
        if let Allowance::Log { dropped } = procs.logs.take() {
            tracing::warn!(pid, container = %procs.container, dropped, "registration refused: {m}");
        }
        return (false, send(stream, &reject(m), &[]).await);
    }
    let prefer: Vec<usize> = if req.protocol_version == PROTOCOL_VERSION {
        req.previous_slot.map(|s| s as usize).into_iter().collect()
    } else {
        req.previous_slots.iter().map(|&s| s as usize).collect()
    };
    let slots = match procs.add(pid, &prefer) {
        Ok(s) => s,
        Err(m) => {
            if let Allowance::Log { dropped } = procs.logs.take() {
                tracing::warn!(pid, container = %procs.container, dropped, "registration refused: {m}");
            }
            return (false, send(stream, &reject(m), &[]).await);
        }
    };
    if let Allowance::Log { dropped } = procs.logs.take() {
        tracing::info!(
            pid, local_pid = req.local_pid, program = %budget::printable(&req.program),
            pod = %procs.pod_uid, container = %procs.container, slots = ?slots, dropped,
            "interposer registered"
        );
    }
    let slots = slots.unwrap_or_default();
    // Pages only to a client that reads layout 2 and flags (one from
    // before mapped the page writable: it runs plain), several only to one
    // that reads them. A latency process gets its flags in the pages'
    // place; one without a slot runs plain.
    let qos = procs
        .qos
        .as_ref()
        .filter(|q| !slots.is_empty() && req.qos_flags && (q.pages.len() == 1 || req.qos_pages));
    let holders = qos.and_then(|_| procs.qos_slots(pid)).unwrap_or_default();
    let qos = qos.filter(|q| q.tier != Tier::Latency || !holders.is_empty());
    let qos_slots: Vec<u32> = holders.iter().map(|h| h.slot as u32).collect();
    // One page in the fields every interposer with tiers reads; several in
    // protocol 2's, which those from before them ignore (running plain).
    let pages = qos.map_or(0, |q| q.pages.len());
    let resp = RegisterResponse {
        status: Status::Accepted as i32,
        message: String::new(),
        protocol_version: req.protocol_version,
        host_pid: pid,
        qos_tier: qos.map_or(0, |q| q.tier.wire()),
        qos_page: pages == 1,
        qos_slot: qos_slots.first().copied().filter(|_| pages == 1),
        qos_pages: if pages > 1 { pages as u32 } else { 0 },
        qos_slots: if pages > 1 { qos_slots } else { Vec::new() },
        memory_limit: procs.memory.borrow_limit().unwrap_or(0),
        reclaim: procs.memory.gpus.len() == 1 && !slots.is_empty(),
        ledger_slot: slots.first().map(|&s| s as u32),
        ledger_slots: if req.protocol_version == PROTOCOL_VERSION {
            Vec::new()
        } else {
            slots.iter().map(|&s| s as u32).collect()
        },
    };
    drop(req);
    let qos_files: Vec<Arc<File>> = match qos {
        Some(q) if q.tier == Tier::Latency => q
            .pages
            .iter()
            .zip(&holders)
            .filter_map(|(d, h)| d.flag(h.slot))
            .collect(),
        Some(q) => q.pages.iter().map(|d| d.file.clone()).collect(),
        None => Vec::new(),
    };
    let files: Vec<&File> = procs
        .ledgers
        .iter()
        .map(|(_, f)| f)
        .take(slots.len())
        .chain(qos_files.iter().map(|f| &**f))
        .collect();
    (true, send(stream, &resp, &files).await)
}

/// A batch process's `QOS_FLAGS`: the sealed latency flags of each of its
/// share's pages, the descriptors on the frame (at most the
/// [`MAX_FDS`](container_ledger::fdpass::MAX_FDS) one message carries).
fn qos_flags(procs: &Procs) -> (MemoryResponse, Vec<Arc<File>>) {
    use container_ledger::fdpass::MAX_FDS;
    let mut flags = Vec::new();
    let mut files = Vec::new();
    for (i, d) in procs.qos.iter().flat_map(|q| q.pages.iter()).enumerate() {
        for (slot, f) in d.sealed_flags() {
            if files.len() == MAX_FDS {
                break;
            }
            flags.push(QosFlag {
                page: i as u32,
                slot: slot as u32,
            });
            files.push(f);
        }
    }
    let resp = MemoryResponse {
        status: vcuda_api::vcuda::memory_response::Status::Granted as i32,
        qos: true,
        qos_flags: flags,
        ..Default::default()
    };
    (resp, files)
}

/// Holds a registered connection until the process is gone (EOF) or the
/// endpoint stops, answering its memory requests ([`memory`]). A frame
/// over [`MAX_REQUEST`] bytes or one that fails to read ends the
/// connection; one that does not decode is refused by name.
async fn hold(
    stream: &mut UnixStream,
    procs: &Arc<Procs>,
    reg: &Registry,
    pid: i32,
    cancel: &CancellationToken,
) {
    loop {
        let body = tokio::select! {
            _ = cancel.cancelled() => return,
            b = read_frame(stream) => b,
        };
        let body = match body {
            Ok(b) => b,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof
                    && let Allowance::Log { dropped } = procs.logs.take()
                {
                    tracing::warn!(pid, container = %procs.container, dropped,
                        "registered client: {e}: connection closed");
                }
                return;
            }
        };
        let resp = match MemoryRequest::decode(body.as_slice()) {
            Ok(req) if req.kind == memory_request::Kind::QosFlags as i32 => {
                let (resp, files) = qos_flags(procs);
                let files: Vec<&File> = files.iter().map(|f| &**f).collect();
                let body = resp.encode_to_vec();
                if send_body(stream, &body, &files).await.is_err() {
                    return;
                }
                continue;
            }
            Ok(req) => {
                let answer = reg.lending.answer(procs, pid, &req, || reg.shares());
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = answer => r,
                }
            }
            Err(e) => MemoryResponse {
                status: vcuda_api::vcuda::memory_response::Status::Refused as i32,
                message: format!("bad MemoryRequest: {e}"),
                ..Default::default()
            },
        };
        if send_memory(stream, &resp).await.is_err() {
            return;
        }
    }
}

async fn read_frame(stream: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_REQUEST {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes; at most {MAX_REQUEST} are accepted"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Ok(body)
}

async fn send_memory(stream: &mut UnixStream, resp: &MemoryResponse) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    stream
        .write_all(&vcuda_api::vcuda::frame::encode(resp)?)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;

    /// A frame larger than the socket's buffer stops mid-way: the rest must
    /// follow from where it stopped (before, the whole frame was sent again,
    /// and the reader found a second header inside the first body).
    #[tokio::test]
    async fn a_frame_past_a_full_socket_buffer_arrives_whole() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let small: libc::c_int = 4096;
        // SAFETY: a valid socket and an int-sized option value.
        let rc = unsafe {
            libc::setsockopt(
                a.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&small as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "SO_SNDBUF: {}", std::io::Error::last_os_error());
        a.set_nonblocking(true).unwrap();
        let a = UnixStream::from_std(a).unwrap();
        let body: Vec<u8> = (0..600_000u32).map(|i| (i % 251) as u8).collect();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"flag").unwrap();
        let reader = std::thread::spawn(move || {
            // Late, so the writer meets a full buffer first.
            std::thread::sleep(Duration::from_millis(100));
            container_ledger::fdpass::recv_frame_fds(b.as_fd(), 1 << 20).unwrap()
        });
        send_body(&a, &body, &[&file]).await.unwrap();
        let (got, fds) = tokio::task::spawn_blocking(move || reader.join().unwrap())
            .await
            .unwrap();
        assert_eq!(got.len(), body.len());
        assert!(got == body, "the frame's body arrived changed");
        assert_eq!(fds.len(), 1, "the descriptor rides on the frame once");
        let mut f = File::from(fds.into_iter().next().unwrap());
        f.rewind().unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "flag");
    }
}
