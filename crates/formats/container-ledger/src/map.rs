//! The mapping itself: creating or opening the ledger file, mapping it
//! read-write, writing and checking the header, the atomic words at an
//! offset, unmapping on drop; and duplicating the descriptor to pass on.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::AtomicU64;

use crate::layout::*;
use crate::{Ledger, LedgerError, io};

impl Ledger {
    /// Creates the ledger at `path` (mode 0600) with `quota` bytes, or opens
    /// the existing one (a restarted manager keeps the live state) and sets
    /// its quota. Returns the mapping and the open file, whose descriptor is
    /// what the manager passes to registering processes.
    pub fn create(path: &Path, quota: u64) -> Result<(Ledger, File), LedgerError> {
        let what = || path.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io(what(), e))?;
        let len = file.metadata().map_err(|e| io(what(), e))?.len();
        let fresh = len == 0;
        if fresh {
            file.set_len(FILE_SIZE as u64).map_err(|e| io(what(), e))?;
        }
        let ledger = if fresh {
            Self::map_fresh(file.as_fd_borrowed())?
        } else {
            Self::from_fd(file.as_fd_borrowed()).map_err(|e| match e {
                LedgerError::Io { source, .. } => io(what(), source),
                other => other,
            })?
        };
        ledger.set_quota(quota);
        Ok((ledger, file))
    }

    /// Opens an existing ledger file read-write (manager inspection,
    /// recovery after a restart).
    pub fn open(path: &Path) -> Result<(Ledger, File), LedgerError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io(path.display().to_string(), e))?;
        let l = Self::from_fd(file.as_fd_borrowed())?;
        Ok((l, file))
    }

    /// Maps the ledger behind `fd` (read-write) and checks its header. The
    /// descriptor may be closed afterwards.
    pub fn from_fd(fd: BorrowedFd<'_>) -> Result<Ledger, LedgerError> {
        // SAFETY: `libc::stat` is plain integers, for which all-zero is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is a live borrowed descriptor; `st` is a local to fill.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io("fstat ledger", std::io::Error::last_os_error()));
        }
        Self::check_prefix(fd)?;
        if st.st_size as u64 != FILE_SIZE as u64 {
            return Err(LedgerError::Size {
                len: st.st_size as u64,
            });
        }
        let l = Self::map(fd)?;
        l.check_header()?;
        Ok(l)
    }

    /// Magic and version from the file's first bytes, before its size is
    /// looked at: a later layout may well have another size, and must be
    /// named by its version ("layout version 2, this build reads 1"), not
    /// reported as a file of the wrong length. Shorter files pass here.
    pub(crate) fn check_prefix(fd: BorrowedFd<'_>) -> Result<(), LedgerError> {
        let mut head = [0u8; OFF_VERSION + 4];
        // SAFETY: reads at most `head.len()` bytes into our local buffer
        // from the live descriptor; the file offset is not moved.
        let n = unsafe { libc::pread(fd.as_raw_fd(), head.as_mut_ptr().cast(), head.len(), 0) };
        if n < head.len() as isize {
            return Ok(());
        }
        if head[OFF_MAGIC..OFF_MAGIC + 8] != MAGIC {
            return Err(LedgerError::Magic);
        }
        let version = u32::from_ne_bytes(head[OFF_VERSION..].try_into().unwrap());
        if version != VERSION {
            return Err(LedgerError::Version { found: version });
        }
        Ok(())
    }

    /// Maps a just-sized, zeroed FILE_SIZE-byte file and writes its header.
    pub(crate) fn map_fresh(fd: BorrowedFd<'_>) -> Result<Ledger, LedgerError> {
        let l = Self::map(fd)?;
        l.init_header();
        Ok(l)
    }

    /// Callers make sure the file is FILE_SIZE bytes (set or checked) first.
    fn map(fd: BorrowedFd<'_>) -> Result<Ledger, LedgerError> {
        // SAFETY: a fresh mapping (NULL hint, no MAP_FIXED) replaces nothing;
        // `fd` is a live descriptor of a FILE_SIZE-byte file (every caller
        // sets or checks the length first), so all FILE_SIZE bytes are backed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io("mmap ledger", std::io::Error::last_os_error()));
        }
        Ok(Ledger { base: p.cast() })
    }

    fn init_header(&self) {
        // SAFETY: only on a freshly created file, before the Ledger is shared:
        // no other reference into the mapping exists yet. All offsets are
        // constants inside the header (< HEADER_SIZE <= FILE_SIZE); the u32
        // fields are 4-byte aligned offsets from a page-aligned base.
        unsafe {
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), self.base.add(OFF_MAGIC), 8);
            (self.base.add(OFF_VERSION) as *mut u32).write(VERSION);
            (self.base.add(OFF_HEADER_SIZE) as *mut u32).write(HEADER_SIZE as u32);
            (self.base.add(OFF_SLOTS) as *mut u32).write(SLOTS as u32);
            (self.base.add(OFF_SLOT_SIZE) as *mut u32).write(SLOT_SIZE as u32);
        }
    }

    pub(crate) fn check_header(&self) -> Result<(), LedgerError> {
        // SAFETY: `off` is one of the header's constant, 4-aligned u32 offsets
        // (< HEADER_SIZE) in our live FILE_SIZE-byte mapping of a page-aligned
        // base. Header fields are written once at creation, before sharing.
        let u32_at = |off: usize| unsafe { (self.base.add(off) as *const u32).read() };
        // SAFETY: bytes 0..8 of our live mapping, borrowed only for the
        // comparison below while `self` keeps the mapping alive.
        let magic = unsafe { std::slice::from_raw_parts(self.base.add(OFF_MAGIC), 8) };
        if magic != MAGIC {
            return Err(LedgerError::Magic);
        }
        let version = u32_at(OFF_VERSION);
        if version != VERSION {
            return Err(LedgerError::Version { found: version });
        }
        let (header, slots, slot_size) = (
            u32_at(OFF_HEADER_SIZE),
            u32_at(OFF_SLOTS),
            u32_at(OFF_SLOT_SIZE),
        );
        if (header as usize, slots as usize, slot_size as usize) != (HEADER_SIZE, SLOTS, SLOT_SIZE)
        {
            return Err(LedgerError::Geometry {
                header,
                slots,
                slot_size,
            });
        }
        Ok(())
    }

    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= FILE_SIZE && off.is_multiple_of(8));
        // SAFETY: `off` is a constant or slot offset, 8-aligned and within the
        // FILE_SIZE bytes mapped (asserted above; slot_off checks the slot
        // index), and the base is page-aligned, so this is an aligned u64 in
        // the mapping, which lives as long as `&self`. AtomicU64 has u64's
        // layout, and every process touches these words only atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: `base` is our FILE_SIZE-byte mapping, unmapped once, here;
        // `&mut self` means no reference into it is still alive.
        unsafe { libc::munmap(self.base.cast(), FILE_SIZE) };
    }
}

/// `File::as_fd` spelled so the borrow is obvious at call sites.
pub(crate) trait AsFdBorrowed {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_>;
}

impl AsFdBorrowed for File {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.as_fd()
    }
}

/// Duplicates `fd` with close-on-exec (for passing the ledger on).
pub fn dup_cloexec(fd: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a live borrowed descriptor; no memory passed.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `n` is the new descriptor fcntl just returned; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}
