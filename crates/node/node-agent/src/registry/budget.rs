//! What one container may cost the daemon through its registration socket.
//!
//! Any process in a share can connect to its `vcuda.sock` as often as it
//! likes and send whatever it likes. The daemon serves every container on
//! the node, so each container's use is bounded here: a request near the
//! size a real one needs, its fields checked, connections per container
//! and per process capped, the request dropped once answered, log lines
//! rationed and tenant strings escaped. A container past its budget is
//! refused; what it costs the daemon stays bounded.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use vcuda_api::vcuda::RegisterRequest;

/// Largest request body accepted. A real one is under 400 bytes: ids of at
/// most 63, a bus id, `program` (the interposer sends at most
/// [`MAX_PROGRAM`] bytes) and a slot per GPU.
pub const MAX_REQUEST: usize = 2048;
/// Longest `program` accepted (argv[0], for logs).
pub const MAX_PROGRAM: usize = 256;
/// Open connections per container, registered or not: one per ledger slot.
pub const MAX_CONNS: usize = container_ledger::SLOTS;
/// Registrations one process may hold at once: one, and a few more for a
/// reconnect racing the old connection's close.
pub const MAX_CONNS_PER_PID: u32 = 4;

/// Why a request is refused before anything is claimed for it.
pub fn check_request(req: &RegisterRequest, gpus: usize) -> Result<(), String> {
    let long = |what: &str, len: usize, max: usize| {
        (len > max).then(|| format!("{what} is {len} bytes, at most {max} are accepted"))
    };
    if let Some(m) = long("pod_uid", req.pod_uid.len(), 47)
        .or_else(|| long("container_name", req.container_name.len(), 63))
        .or_else(|| long("bus_id", req.bus_id.len(), 32))
        .or_else(|| long("program", req.program.len(), MAX_PROGRAM))
    {
        return Err(m);
    }
    if req.previous_slots.len() > gpus.max(1) {
        return Err(format!(
            "previous_slots names {} slots; this container has {gpus} ledger(s)",
            req.previous_slots.len()
        ));
    }
    Ok(())
}

/// A tenant-chosen string fit for one log field: control characters
/// escaped, at most 64 characters.
pub fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(64).flat_map(char::escape_debug).collect();
    if s.chars().nth(64).is_some() {
        out.push('…');
    }
    out
}

/// Log lines one container may cause: [`LogBudget::LINES`] per
/// [`LogBudget::WINDOW`], then one line saying how many were dropped.
pub struct LogBudget {
    state: Mutex<(Instant, u32, u64)>,
}

impl Default for LogBudget {
    fn default() -> Self {
        LogBudget {
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }
}

/// What the caller may log now.
#[derive(Debug, PartialEq, Eq)]
pub enum Allowance {
    /// Log the line; `dropped` lines were suppressed before it.
    Log {
        dropped: u64,
    },
    Drop,
}

impl LogBudget {
    pub const LINES: u32 = 20;
    pub const WINDOW: Duration = Duration::from_secs(10);

    pub fn take(&self) -> Allowance {
        self.take_at(Instant::now())
    }

    fn take_at(&self, now: Instant) -> Allowance {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now.duration_since(s.0) >= Self::WINDOW {
            let dropped = s.2;
            *s = (now, 1, 0);
            return Allowance::Log { dropped };
        }
        if s.1 < Self::LINES {
            s.1 += 1;
            return Allowance::Log { dropped: 0 };
        }
        s.2 += 1;
        Allowance::Drop
    }
}

/// Raises this process's open-file limit to its hard limit: every
/// registered interposer holds a connection for its life, so a node of
/// many shares needs more than the usual 1024.
pub fn raise_open_files() -> std::io::Result<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills our local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if r.rlim_cur < r.rlim_max {
        r.rlim_cur = r.rlim_max;
        // SAFETY: setrlimit reads our local struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(r.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> RegisterRequest {
        RegisterRequest {
            protocol_version: 1,
            pod_uid: "8d4c2f0e-7a43-4c55-9e39-1f0f3a6b2c11".into(),
            container_name: "main".into(),
            bus_id: "0000:3B:00.0".into(),
            local_pid: 7,
            program: "/usr/bin/python3".into(),
            previous_slot: Some(3),
            previous_slots: Vec::new(),
            qos_pages: true,
            qos_flags: true,
        }
    }

    #[test]
    fn a_real_request_passes_and_oversized_fields_are_named() {
        check_request(&req(), 1).unwrap();
        let mut r = req();
        r.program = "x".repeat(MAX_PROGRAM + 1);
        let e = check_request(&r, 1).unwrap_err();
        assert!(e.contains("program is 257 bytes"), "{e}");
        let mut r = req();
        r.previous_slots = vec![1; 5];
        let e = check_request(&r, 2).unwrap_err();
        assert!(
            e.contains("previous_slots names 5 slots; this container has 2"),
            "{e}"
        );
        let mut r = req();
        r.container_name = "c".repeat(64);
        assert!(check_request(&r, 1).unwrap_err().contains("container_name"));
    }

    #[test]
    fn a_maximal_real_request_fits_the_frame_limit() {
        use prost::Message;
        let mut r = req();
        r.pod_uid = "u".repeat(47);
        r.container_name = "c".repeat(63);
        r.bus_id = "b".repeat(32);
        r.program = "p".repeat(MAX_PROGRAM);
        r.protocol_version = 2;
        r.previous_slots = vec![u32::MAX; 64];
        check_request(&r, 64).unwrap();
        assert!(r.encoded_len() <= MAX_REQUEST, "{}", r.encoded_len());
    }

    #[test]
    fn tenant_strings_are_escaped_and_cut() {
        assert_eq!(printable("a\nb\u{1b}[31m"), "a\\nb\\u{1b}[31m");
        let p = printable(&"y".repeat(100));
        assert_eq!(p.chars().count(), 65);
        assert!(p.ends_with('…'));
    }

    #[test]
    fn the_log_budget_drops_then_reports_what_it_dropped() {
        let b = LogBudget::default();
        let t0 = b.state.lock().unwrap().0;
        for _ in 0..LogBudget::LINES {
            assert_eq!(b.take_at(t0), Allowance::Log { dropped: 0 });
        }
        assert_eq!(b.take_at(t0), Allowance::Drop);
        assert_eq!(b.take_at(t0), Allowance::Drop);
        assert_eq!(
            b.take_at(t0 + LogBudget::WINDOW),
            Allowance::Log { dropped: 2 }
        );
    }
}
