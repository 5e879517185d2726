//! A hostile process in a share container, as tests play it against a
//! real daemon (the manager, the DRA driver): what any program in the
//! container can do with its `vcuda.sock` and the ledger descriptor it is
//! handed. Each attack returns what it saw; the test asserts the daemon
//! outlived it.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use container_ledger::{Ledger, fdpass};
use prost::Message;
use vcuda_api::vcuda::{RegisterRequest, RegisterResponse};

/// The largest request a real interposer sends: ids at their maximal
/// lengths are the container's own, `program` at the 256 bytes accepted.
pub fn maximal_request(pod_uid: &str, container: &str) -> RegisterRequest {
    RegisterRequest {
        protocol_version: 1,
        pod_uid: pod_uid.into(),
        container_name: container.into(),
        bus_id: "0000:00:00.0".into(),
        local_pid: 1,
        program: "p".repeat(256),
        previous_slot: Some(0),
        previous_slots: Vec::new(),
        qos_pages: true,
        qos_flags: true,
    }
}

fn frame(req: &RegisterRequest) -> Vec<u8> {
    let body = req.encode_to_vec();
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(&body);
    f
}

/// Registers on `dir`'s socket: the kept connection, the reply and the
/// ledger descriptors it carried.
pub fn register(dir: &Path, req: &RegisterRequest) -> (UnixStream, RegisterResponse, Vec<OwnedFd>) {
    let s = UnixStream::connect(dir.join(quota_config::SOCKET_FILE)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    fdpass::send_frame(s.as_fd(), &req.encode_to_vec(), None).unwrap();
    let (body, fds) = fdpass::recv_frame_fds(s.as_fd(), 1 << 16).unwrap();
    (s, RegisterResponse::decode(body.as_slice()).unwrap(), fds)
}

/// What resizing the ledger descriptor did: `Err(errno)` per attempt.
#[derive(Debug)]
pub struct Resize {
    pub truncate: Result<(), i32>,
    pub grow: Result<(), i32>,
    pub fallocate: Result<(), i32>,
    pub len_after: u64,
}

/// Truncates, grows and fallocates the descriptor, as a tenant could.
pub fn resize(fd: &OwnedFd) -> Resize {
    let r = |rc: i32| {
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        }
    };
    let fd_ = fd.as_raw_fd();
    // SAFETY: syscalls on a descriptor we own; no memory passed.
    let truncate = r(unsafe { libc::ftruncate(fd_, 0) });
    // SAFETY: as above.
    let grow = r(unsafe { libc::ftruncate(fd_, 64 << 20) });
    // SAFETY: as above.
    let fallocate = r(unsafe { libc::fallocate(fd_, 0, 0, 64 << 20) });
    // SAFETY: `st` is a local the kernel fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::fstat(fd_, &mut st) };
    Resize {
        truncate,
        grow,
        fallocate,
        len_after: st.st_size as u64,
    }
}

/// Writes the ledger's quota word as a tenant would to lift its quota.
pub fn scribble(fd: &OwnedFd) {
    Ledger::from_fd(fd.as_fd()).unwrap().set_quota(u64::MAX);
}

/// Zeroes the ledger's use counters as a tenant would to allocate past its
/// quota: its processes' next allocations are checked against nothing
/// held, and only NVML's count (the escape guard's) still sees the memory.
pub fn zero_counters(fd: &OwnedFd) {
    let l = Ledger::from_fd(fd.as_fd()).unwrap();
    let held: Vec<_> = l.slots().collect();
    for s in held {
        l.release(s.index, s.used);
    }
}

/// Holds `procs` x 4 registrations with maximal requests, from forked
/// children (each a process of its own, as the daemon counts them), until
/// the returned guard drops. Returns once all answered.
pub fn hold_registrations(dir: &Path, req: &RegisterRequest, procs: usize) -> Children {
    let sock =
        std::ffi::CString::new(dir.join(quota_config::SOCKET_FILE).to_str().unwrap()).unwrap();
    let f = frame(req);
    let mut pipe = [0i32; 2];
    // SAFETY: pipe fills our two ints.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let mut pids = Vec::new();
    for _ in 0..procs {
        // SAFETY: the child only makes raw syscalls on memory prepared
        // before the fork (async-signal-safe), then blocks until killed.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: as above; `_exit` never returns.
            unsafe { child_registers(&sock, &f, pipe[1]) };
        }
        pids.push(pid);
    }
    // SAFETY: our copy of the write end.
    unsafe { libc::close(pipe[1]) };
    // SAFETY: the read end, ours alone from here.
    let mut r = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(pipe[0]) };
    let mut answered = vec![0u8; procs];
    r.read_exact(&mut answered).unwrap();
    Children { pids }
}

/// In a fork child: four connections, each sends `f` and reads its
/// answer; one byte on `done`; then sleep until killed.
unsafe fn child_registers(sock: &std::ffi::CStr, f: &[u8], done: i32) -> ! {
    // SAFETY: raw syscalls on locals and on memory that was prepared
    // before the fork.
    unsafe {
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as u16;
        for (i, b) in sock.to_bytes().iter().enumerate() {
            addr.sun_path[i] = *b as libc::c_char;
        }
        for _ in 0..4 {
            let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            let len = std::mem::size_of::<libc::sockaddr_un>() as u32;
            if libc::connect(s, (&raw const addr).cast(), len) == 0 {
                libc::write(s, f.as_ptr().cast(), f.len());
                let mut buf = [0u8; 512];
                libc::read(s, buf.as_mut_ptr().cast(), buf.len());
            }
        }
        libc::write(done, b"x".as_ptr().cast(), 1);
        loop {
            libc::pause();
        }
    }
}

/// Forked children, killed and reaped on drop.
pub struct Children {
    pids: Vec<i32>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for &p in &self.pids {
            // SAFETY: our own children.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        for &p in &self.pids {
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(p, std::ptr::null_mut(), 0) };
        }
    }
}

/// Garbage on `dir`'s socket: `n` each of an oversized length, random
/// bytes, a frame cut short and left open (slow), a valid request followed
/// by a stream of bytes. Returns the slow connections (hold them to keep
/// the daemon waiting).
pub fn garbage(dir: &Path, req: &RegisterRequest, n: usize) -> Vec<UnixStream> {
    let path = dir.join(quota_config::SOCKET_FILE);
    let mut slow = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..n {
        if let Ok(mut s) = UnixStream::connect(&path) {
            let _ = s.write_all(&(1u32 << 30).to_be_bytes());
        }
        if let Ok(mut s) = UnixStream::connect(&path) {
            let junk: Vec<u8> = (0..512)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let _ = s.write_all(&junk);
        }
        if let Ok(mut s) = UnixStream::connect(&path) {
            let f = frame(req);
            let _ = s.write_all(&f[..f.len() / 2]);
            slow.push(s);
        }
    }
    if let Ok(mut s) = UnixStream::connect(&path) {
        let _ = s.write_all(&frame(req));
        let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
        let chunk = [0u8; 4096];
        for _ in 0..64 {
            if s.write_all(&chunk).is_err() {
                break;
            }
        }
    }
    slow
}

/// VmRSS of `pid`, KiB.
pub fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The children of `pid` (a supervisor's: the serving daemon).
pub fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// `client args…` as a process of the container admitted with `env`: its
/// quota directory bind-mounted read-only at `/etc/vcuda` in a mount
/// namespace of its own (as the container runtime mounts it; /etc on a
/// tmpfs with the loader's cache, so nothing reaches the host's /etc),
/// the rest of `env`, then `extra` over it.
pub fn in_share(
    client: &Path,
    env: &[(String, String)],
    sim_root: &Path,
    extra: &[(&str, &str)],
) -> Command {
    let dir = env
        .iter()
        .find(|(k, _)| k == "VCUDA_CONFIG_DIR")
        .map(|(_, v)| v.clone())
        .unwrap();
    let script = format!(
        "set -e; c=$(mktemp -d); cp /etc/ld.so.cache $c/ 2>/dev/null || true; \
         mount -t tmpfs tmpfs /etc; cp $c/ld.so.cache /etc/ 2>/dev/null || true; rm -rf $c; \
         mkdir /etc/vcuda; mount --bind {dir} /etc/vcuda; mount -o remount,bind,ro /etc/vcuda; \
         exec \"$@\""
    );
    let mut c = Command::new("unshare");
    c.args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
        "sh",
    ])
    .arg(client)
    .envs(env.iter().filter(|(k, _)| k != "VCUDA_CONFIG_DIR").cloned())
    .envs(extra.iter().map(|&(k, v)| (k, v)))
    .env("GPU_SIM_ROOT", sim_root)
    .env_remove("LOGGER_LEVEL");
    c
}

/// `shim_client … hold MIB` spawned from `cmd`, once it holds its memory.
pub fn holding_mib(mut cmd: Command, mib: u32) -> std::process::Child {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut p = cmd
        .args(["hold", &mib.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(p.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("holding"), "{line}");
    p
}

/// Runs `shim_client quota 64` in the share ([`in_share`]).
pub fn quota_run(
    client: &Path,
    env: &[(String, String)],
    sim_root: &Path,
    extra: &[(&str, &str)],
) -> String {
    let out = in_share(client, env, sim_root, extra)
        .args(["quota", "64"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "shim_client quota: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// A directory whose `libcuda.so.1` is the real driver that sits beside
/// the interposer in the share's `LD_LIBRARY_PATH` (the mirror's
/// `libcuda.so.<version>`): what a program that bypasses the interposer
/// loads. Put it first in `LD_LIBRARY_PATH`.
pub fn real_driver_dir(env: &[(String, String)], out: &Path) -> std::path::PathBuf {
    let lib = env
        .iter()
        .find(|(k, _)| k == "LD_LIBRARY_PATH")
        .map(|(_, v)| v.split(':').next().unwrap_or("").to_string())
        .unwrap();
    let real = std::fs::read_dir(&lib)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.starts_with("libcuda.so.") && n.matches('.').count() >= 3
        })
        .unwrap_or_else(|| panic!("no libcuda.so.<version> in {lib}"));
    let dir = out.join("bypass");
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("libcuda.so.1");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&real, &link).unwrap();
    dir
}

/// `shim_client quota 64`'s output shows `quota` bytes and a refusal
/// (CUDA_ERROR_OUT_OF_MEMORY) once they are allocated.
pub fn assert_held(out: &str, quota: u64, who: &str) {
    let r = crate::kv(out);
    let get = |k: &str| r[k].parse::<u64>().unwrap();
    assert_eq!(
        get("start_total"),
        quota,
        "{who}: cuMemGetInfo total: {out}"
    );
    assert_eq!(get("last"), 2, "{who}: refused past the quota: {out}");
    assert!(get("allocated") * 64 * (1 << 20) <= quota, "{who}: {out}");
}

/// A batch process's `QOS_FLAGS` on its registration connection `conn`:
/// the latency flags (page, slot) and their descriptors.
pub fn qos_flags(conn: &UnixStream) -> (Vec<(u32, u32)>, Vec<OwnedFd>) {
    use vcuda_api::vcuda::{MemoryRequest, MemoryResponse, memory_request};
    let mut c = conn.try_clone().unwrap();
    let req = MemoryRequest {
        kind: memory_request::Kind::QosFlags as i32,
        bytes: 0,
    };
    vcuda_api::vcuda::frame::write(&mut c, &req).unwrap();
    let (body, fds) = container_ledger::fdpass::recv_frame_fds(c.as_fd(), 65536).unwrap();
    let r = MemoryResponse::decode(body.as_slice()).unwrap();
    assert!(r.qos, "not an answer to QOS_FLAGS: {r:?}");
    (r.qos_flags.iter().map(|f| (f.page, f.slot)).collect(), fds)
}

/// [`qos_flags`] mapped read-only, by page (`pages` of them).
pub fn qos_flag_views(conn: &UnixStream, pages: usize) -> Vec<Vec<qos_page::FlagView>> {
    let (flags, fds) = qos_flags(conn);
    let mut by = vec![Vec::new(); pages];
    for ((page, _), fd) in flags.iter().zip(&fds) {
        by[*page as usize].push(qos_page::FlagView::open(fd.as_fd()).unwrap());
    }
    by
}
