//! The process table: one slot per process using the simulated driver, its
//! liveness (an OFD lock the kernel drops when the process dies) and the PIDs
//! it is known by.

use super::layout::{SLOT_FREE, SLOT_LIVE};
use super::{MAX_PROCS, SharedState, StateError};
use std::fs;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::*;

/// Inode number of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;

/// A process known to the simulated driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    pub slot: u32,
    pub generation: u32,
    /// PID in the initial (host) PID namespace; `None` when it cannot be
    /// resolved from here (the reader does not see the host's /proc).
    pub host_pid: Option<u32>,
    /// PID in the process's own namespace.
    pub ns_pid: u32,
    /// The PID the reader names it by (see [`pid`](Self::pid)).
    shown_pid: u32,
    /// Whether a process list shown to the reader includes it: the reader
    /// is in the initial namespace or in the process's own.
    pub listed: bool,
    pub used_bytes: u64,
    pub name: String,
}

impl ProcessInfo {
    /// The PID the real driver names the process by to this reader
    /// (measured on driver 580, `tests/gpu/probes/nvml_pidns.py`): its PID
    /// in the reader's namespace when they share one, else its host PID.
    pub fn pid(&self) -> u32 {
        self.shown_pid
    }
}

/// The calling process's registration: index into the process table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    pub slot: u32,
    pub generation: u32,
}

impl Attached {
    pub(super) fn owner(self) -> u64 {
        self.slot as u64 | (self.generation as u64) << 16
    }
}

impl SharedState {
    fn lock_byte(&self, slot: usize, cmd: libc::c_int, kind: libc::c_short) -> libc::flock {
        // SAFETY: flock is plain integers: all-zero is a valid value.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = kind;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = slot as libc::off_t;
        fl.l_len = 1;
        // SAFETY: valid fd and flock struct.
        let rc = unsafe { libc::fcntl(self.lock.as_raw_fd(), cmd, &mut fl) };
        if rc != 0 {
            fl.l_type = -1;
        }
        fl
    }

    fn try_lock_slot(&self, slot: usize) -> bool {
        self.lock_byte(slot, libc::F_OFD_SETLK, libc::F_WRLCK as libc::c_short)
            .l_type
            != -1
    }

    fn unlock_slot(&self, slot: usize) {
        self.lock_byte(slot, libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_short);
    }

    /// Gives back what a dead process held. Call with the slot's lock held.
    fn reclaim(&self, i: usize) {
        let s = self.slot(i);
        for g in 0..self.gpu_count() {
            let held = s.used[g].swap(0, AcqRel);
            if held > 0 {
                self.device(g).used.fetch_sub(held, AcqRel);
                self.give_in_gi(i, g, held);
            }
        }
        self.clear_mig_use(i);
        s.active.store(0, Release);
        s.host_pid.store(0, Release);
        s.state.store(SLOT_FREE, Release);
    }

    /// Reclaims the slots of processes that died.
    pub fn reap_dead(&self) {
        let own = self.own_slot.load(Acquire);
        for i in 0..MAX_PROCS {
            if i as i64 == own || self.slot(i).state.load(Acquire) != SLOT_LIVE {
                continue;
            }
            if self.try_lock_slot(i) {
                if self.slot(i).state.load(Acquire) == SLOT_LIVE {
                    self.reclaim(i);
                }
                self.unlock_slot(i);
            }
        }
    }

    /// Registers the calling process. Call once per process; the slot is held
    /// until the process exits.
    pub fn attach(&self) -> Result<Attached, StateError> {
        let own = self.own_slot.load(Acquire);
        if own >= 0 {
            let generation = self.slot(own as usize).generation.load(Acquire);
            return Ok(Attached {
                slot: own as u32,
                generation,
            });
        }
        let (ns_pid, pidns) = own_pid_and_ns();
        for i in 0..MAX_PROCS {
            if !self.try_lock_slot(i) {
                continue;
            }
            let s = self.slot(i);
            if s.state.load(Acquire) == SLOT_LIVE {
                self.reclaim(i);
            }
            let generation = s.generation.fetch_add(1, AcqRel).wrapping_add(1) & 0xffff;
            s.ns_pid.store(ns_pid as i32, Release);
            s.pidns_ino.store(pidns, Release);
            let host = if pidns == INIT_PID_NS_INO { ns_pid } else { 0 };
            s.host_pid.store(host as i32, Release);
            let comm = own_comm();
            for (k, word) in s.comm.iter().enumerate() {
                let mut b = [0u8; 8];
                for (j, byte) in b.iter_mut().enumerate() {
                    *byte = comm.get(k * 8 + j).copied().unwrap_or(0);
                }
                word.store(u64::from_ne_bytes(b), Release);
            }
            s.active.store(0, Release);
            self.clear_mig_use(i);
            s.state.store(SLOT_LIVE, Release);
            self.own_slot.store(i as i64, Release);
            return Ok(Attached {
                slot: i as u32,
                generation: generation & 0xffff,
            });
        }
        Err(StateError::TooManyProcesses)
    }

    /// Whether the process registered as `a` is still alive (its slot not
    /// reclaimed nor reused): what shared files named after it hang on.
    pub fn is_live(&self, a: Attached) -> bool {
        if a.slot as usize >= MAX_PROCS {
            return false;
        }
        self.reap_dead();
        let s = self.slot(a.slot as usize);
        s.state.load(Acquire) == SLOT_LIVE && s.generation.load(Acquire) & 0xffff == a.generation
    }

    /// Marks that the process has a context on `gpu` (it then shows in
    /// process lists even before it allocates).
    pub fn set_active(&self, me: Attached, gpu: usize) {
        self.slot(me.slot as usize)
            .active
            .fetch_or(1 << gpu, AcqRel);
    }

    /// What a process list shown to this reader holds (NVML's running
    /// process lists): [`processes`](Self::processes) less those a reader
    /// inside a PID namespace is not shown, the other namespaces'.
    pub fn listed_processes(&self, gpu: usize) -> Vec<ProcessInfo> {
        let mut all = self.processes(gpu);
        all.retain(|p| p.listed);
        all
    }

    /// Processes with a context or memory on `gpu`, dead ones reclaimed first.
    pub fn processes(&self, gpu: usize) -> Vec<ProcessInfo> {
        self.reap_dead();
        let my_ns = own_pid_and_ns().1;
        let mut out = Vec::new();
        for i in 0..MAX_PROCS {
            let s = self.slot(i);
            if s.state.load(Acquire) != SLOT_LIVE {
                continue;
            }
            let used = s.used[gpu].load(Acquire);
            if used == 0 && s.active.load(Acquire) & (1 << gpu) == 0 {
                continue;
            }
            let ns_pid = s.ns_pid.load(Acquire) as u32;
            let ns = s.pidns_ino.load(Acquire);
            let same_ns = ns == my_ns;
            let mut host = s.host_pid.load(Acquire);
            if host == 0
                && !same_ns
                && my_ns == INIT_PID_NS_INO
                && let Some(p) = host_pid_of(ns, ns_pid)
            {
                host = p as i32;
                // Only the initial namespace's view is a host PID.
                s.host_pid.store(host, Release);
            }
            // The driver names a process of the reader's namespace by its
            // PID there, everyone else by host PID.
            let shown = if same_ns { ns_pid as i32 } else { host };
            if shown <= 0 {
                // Another namespace's process whose host PID this reader
                // cannot see (a reader inside a container, before any
                // reader on the host cached it). The real driver names it
                // by host PID in utilization samples (never in process
                // lists); the sim cannot, so it is left out.
                continue;
            }
            let mut name = Vec::with_capacity(32);
            for w in &s.comm {
                name.extend_from_slice(&w.load(Acquire).to_ne_bytes());
            }
            let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            out.push(ProcessInfo {
                slot: i as u32,
                generation: s.generation.load(Acquire) & 0xffff,
                host_pid: (host > 0).then_some(host as u32),
                ns_pid,
                shown_pid: shown as u32,
                listed: same_ns || my_ns == INIT_PID_NS_INO,
                used_bytes: used,
                name: String::from_utf8_lossy(&name[..end]).into_owned(),
            });
        }
        out
    }
}

/// This process's PID in its own namespace and that namespace's inode.
fn own_pid_and_ns() -> (u32, u64) {
    let pid = std::process::id();
    let ino = fs::metadata("/proc/self/ns/pid")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(INIT_PID_NS_INO);
    (pid, ino)
}

fn own_comm() -> Vec<u8> {
    fs::read("/proc/self/comm")
        .map(|mut b| {
            while b.last() == Some(&b'\n') {
                b.pop();
            }
            b.truncate(32);
            b
        })
        .unwrap_or_default()
}

/// Host PID of the process that is `ns_pid` in PID namespace `ns`, found by
/// scanning /proc as the reader sees it: each process's `ns/pid` inode and the
/// last entry of `NSpid` in its status.
fn host_pid_of(ns: u64, ns_pid: u32) -> Option<u32> {
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(m) = fs::metadata(format!("/proc/{pid}/ns/pid")) else {
            continue;
        };
        if std::os::unix::fs::MetadataExt::ino(&m) != ns {
            continue;
        }
        let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let last = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|s| s.parse::<u32>().ok());
        if last == Some(ns_pid) {
            return Some(pid);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use crate::state::SharedState;
    use crate::state::tests::installed;

    #[test]
    fn other_handle_sees_live_process_and_reclaims_closed_one() {
        let (_d, root) = installed();
        let a = SharedState::open(&root).unwrap();
        let me = a.attach().unwrap();
        a.try_alloc(me, 0, 1000).unwrap();
        let b = SharedState::open(&root).unwrap();
        assert_eq!(b.memory_used(0), 1000, "a's lock keeps its slot alive");
        assert!(b.is_live(me));
        drop(a); // closes the lock fd: like the process dying
        assert_eq!(b.memory_used(0), 0, "reclaimed");
        assert!(b.processes(0).is_empty());
        assert!(!b.is_live(me), "its shared files may go");
    }
}
