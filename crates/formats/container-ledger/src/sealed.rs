//! The ledger as a sealed memfd: what a daemon hands to tenants.
//!
//! Why: a registering process gets a read-write descriptor of the ledger.
//! Of a plain file, that descriptor can `ftruncate` it (the daemon's next
//! read of its mapping dies with SIGBUS, again after every restart) or
//! `fallocate` it (a file on the host's disk that grows outside any
//! accounting). A memfd sealed against shrinking and growing, with the
//! seals themselves sealed, has its size fixed for life: no holder of any
//! descriptor can change it, so a mapping of it never faults. A tenant can
//! still write the words, which only confuses its own container's counters
//! (the quota is read from the read-only quota file, never from here).
//!
//! A memfd has no path: a restarted daemon finds the live one again in a
//! registered process of the container (`node-agent`'s `ledgers`), or
//! starts a fresh one that the re-registering processes fill back in.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::map::AsFdBorrowed;

use crate::layout::FILE_SIZE;
use crate::{Ledger, LedgerError, io};

/// The seals every ledger a daemon maps carries.
pub const REQUIRED_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Name prefix of ledger memfds (`/proc/<pid>/fd/<n>` reads
/// `/memfd:vcuda-ledger.<gpu> (deleted)`).
pub const MEMFD_PREFIX: &str = "vcuda-ledger";

impl Ledger {
    /// A fresh ledger in a sealed memfd named `vcuda-ledger.<gpu>`, with
    /// `quota` bytes. Returns the mapping and the descriptor to pass on.
    pub fn create_sealed(gpu: usize, quota: u64) -> Result<(Ledger, File), LedgerError> {
        let name = std::ffi::CString::new(format!("{MEMFD_PREFIX}.{gpu}")).unwrap();
        // SAFETY: a NUL-terminated name; flags are plain integers.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io("memfd_create ledger", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned to us and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(FILE_SIZE as u64)
            .map_err(|e| io("sizing ledger memfd", e))?;
        // SAFETY: F_ADD_SEALS on our live descriptor, an integer argument.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, REQUIRED_SEALS) } != 0 {
            return Err(io("sealing ledger memfd", std::io::Error::last_os_error()));
        }
        let l = Self::map_fresh(file.as_fd_borrowed())?;
        l.set_quota(quota);
        Ok((l, file))
    }

    /// Maps a ledger only if its size can never change: a memfd carrying
    /// [`REQUIRED_SEALS`], of the ledger's size, with a valid header. What
    /// a daemon maps when it takes back a ledger a tenant also holds.
    pub fn from_sealed_fd(fd: BorrowedFd<'_>) -> Result<Ledger, LedgerError> {
        let seals = seals(fd)?;
        if seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(LedgerError::Unsealed { seals });
        }
        Self::from_fd(fd)
    }
}

/// The seals on `fd` (`F_GET_SEALS`); a descriptor that cannot carry seals
/// (a plain file) reads as none.
pub fn seals(fd: BorrowedFd<'_>) -> Result<i32, LedgerError> {
    // SAFETY: F_GET_SEALS on a live borrowed descriptor; no memory passed.
    let s = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if s < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EINVAL) => Ok(0),
            _ => Err(io("F_GET_SEALS ledger", e)),
        };
    }
    Ok(s)
}

/// The memfd's identity, as `<ledger>.id` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemfdId {
    pub dev: u64,
    pub ino: u64,
}

impl MemfdId {
    pub fn of(f: &std::fs::File) -> std::io::Result<MemfdId> {
        let m = f.metadata()?;
        Ok(MemfdId {
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    pub fn render(&self) -> String {
        format!("memfd {} {}\n", self.dev, self.ino)
    }

    pub fn parse(s: &str) -> Option<MemfdId> {
        let mut w = s.split_ascii_whitespace();
        let (Some("memfd"), Some(dev), Some(ino), None) = (w.next(), w.next(), w.next(), w.next())
        else {
            return None;
        };
        Some(MemfdId {
            dev: dev.parse().ok()?,
            ino: ino.parse().ok()?,
        })
    }
}

/// A descriptor path (`/proc/<pid>/fd/<n>`) among those of `pids` that
/// holds GPU `gpu`'s ledger memfd: named `vcuda-ledger.<gpu>` and that
/// inode, `id` (a tenant can name a memfd alike, not choose its inode;
/// with hostPID, other containers' ledgers carry the same name). Every
/// path in the order found: the first may be gone by the time it is
/// opened.
pub fn memfd_paths(
    gpu: usize,
    id: MemfdId,
    pids: impl IntoIterator<Item = i32>,
) -> impl Iterator<Item = PathBuf> {
    let want = format!("/memfd:{MEMFD_PREFIX}.{gpu} ");
    pids.into_iter()
        .filter_map(|pid| std::fs::read_dir(format!("/proc/{pid}/fd")).ok())
        .flat_map(|fds| fds.flatten().map(|e| e.path()))
        .filter(move |p| {
            std::fs::read_link(p).is_ok_and(|t| t.to_string_lossy().starts_with(&want))
                && std::fs::metadata(p).is_ok_and(|m| (m.dev(), m.ino()) == (id.dev, id.ino))
        })
}

/// Every PID `/proc` lists (this PID namespace's processes).
pub fn proc_pids() -> impl Iterator<Item = i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
}

/// The ledger memfd `id` of GPU `gpu`, found among the descriptors of
/// `pids` ([`memfd_paths`]), mapped once checked sealed
/// ([`Ledger::from_sealed_fd`]). Only that inode is taken: one a tenant
/// made (even named alike, even sealed) is not.
pub fn find_live(
    gpu: usize,
    id: MemfdId,
    pids: impl IntoIterator<Item = i32>,
) -> Option<(Ledger, File)> {
    memfd_paths(gpu, id, pids).find_map(|p| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .ok()?;
        let l = Ledger::from_sealed_fd(f.as_fd()).ok()?;
        Some((l, f))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_reject_garbage() {
        let id = MemfdId { dev: 5, ino: 77 };
        assert_eq!(MemfdId::parse(&id.render()), Some(id));
        for bad in ["", "memfd 1", "memfd a 2", "file 1 2", "memfd 1 2 3"] {
            assert_eq!(MemfdId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_sealed_ledger_cannot_be_resized_by_any_holder() {
        let (l, f) = Ledger::create_sealed(0, 1 << 20).unwrap();
        let fd = f.as_raw_fd();
        let err = |r: i32| (r != 0).then(std::io::Error::last_os_error);
        // SAFETY: plain syscalls on our live descriptor.
        let shrink = err(unsafe { libc::ftruncate(fd, 0) });
        assert_eq!(shrink.unwrap().raw_os_error(), Some(libc::EPERM));
        // SAFETY: as above.
        let grow = err(unsafe { libc::ftruncate(fd, 64 << 20) });
        assert_eq!(grow.unwrap().raw_os_error(), Some(libc::EPERM));
        // SAFETY: as above.
        let alloc = err(unsafe { libc::fallocate(fd, 0, 0, 64 << 20) });
        assert_eq!(alloc.unwrap().raw_os_error(), Some(libc::EPERM));
        // SAFETY: as above: no more seals (a write seal would stop the daemon's writes).
        let more = err(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE) });
        assert_eq!(more.unwrap().raw_os_error(), Some(libc::EPERM));
        assert_eq!(f.metadata().unwrap().len(), FILE_SIZE as u64);
        assert_eq!(l.quota(), 1 << 20);
        Ledger::from_sealed_fd(f.as_fd()).unwrap();
    }

    #[test]
    fn an_unsealed_ledger_is_not_mapped_by_the_daemon() {
        let d = tempfile::tempdir().unwrap();
        let (_l, f) = Ledger::create(&d.path().join("ledger"), 1).unwrap();
        let e = Ledger::from_sealed_fd(f.as_fd()).unwrap_err();
        assert!(matches!(e, LedgerError::Unsealed { seals: 0 }), "{e}");
        assert!(e.to_string().contains("not sealed against resizing"), "{e}");
    }

    #[test]
    fn find_live_takes_only_the_recorded_inode() {
        let (_a, fa) = Ledger::create_sealed(3, 1).unwrap();
        let (_b, fb) = Ledger::create_sealed(3, 1).unwrap();
        let me = [std::process::id() as i32];
        let ida = MemfdId::of(&fa).unwrap();
        let (_, got) = find_live(3, ida, me).unwrap();
        assert_eq!(MemfdId::of(&got).unwrap(), ida);
        let idb = MemfdId::of(&fb).unwrap();
        assert_eq!(MemfdId::of(&find_live(3, idb, me).unwrap().1).unwrap(), idb);
        assert!(find_live(4, ida, me).is_none(), "another GPU's name");
        assert!(
            find_live(
                3,
                MemfdId {
                    dev: ida.dev,
                    ino: 1
                },
                me
            )
            .is_none()
        );
    }
}
