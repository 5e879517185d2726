//! The read-only view: quota and use read through a PROT_READ mapping, for
//! processes that must not register.

use std::fs::OpenOptions;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::layout::FILE_SIZE;
use crate::{Ledger, LedgerError, io};

impl Ledger {
    /// The quota and the container's use, read from the ledger file
    /// without a writable mapping or a slot: for processes that must not
    /// register (NVML-only tools in the container). Needs read permission.
    pub fn peek(path: &Path) -> Result<(u64, u64), LedgerError> {
        let l = Self::map_read_only(path)?;
        Ok((l.quota(), l.used()))
    }

    /// The local PIDs the container's processes wrote into their slots
    /// ([`Ledger::set_local_pid`]), read as [`peek`](Self::peek) reads.
    pub fn peek_local_pids(path: &Path) -> Result<Vec<i32>, LedgerError> {
        let l = Self::map_read_only(path)?;
        Ok(l.slots().map(|s| s.local_pid).filter(|&p| p > 0).collect())
    }

    /// A PROT_READ mapping of the file, header checked. Private: only
    /// loads may touch it (a store would fault).
    fn map_read_only(path: &Path) -> Result<Ledger, LedgerError> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io(path.display().to_string(), e))?;
        Self::check_prefix(file.as_fd())?;
        let len = file
            .metadata()
            .map_err(|e| io(path.display().to_string(), e))?
            .len();
        if len != FILE_SIZE as u64 {
            return Err(LedgerError::Size { len });
        }
        // SAFETY: a fresh mapping (NULL hint, no MAP_FIXED) replaces nothing;
        // the file's length was checked to be FILE_SIZE just above.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_SIZE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io("mmap ledger", std::io::Error::last_os_error()));
        }
        // Read-only: only the readers below touch it (atomic loads, never a
        // store, which would fault on PROT_READ); Drop unmaps.
        let l = Ledger { base: p.cast() };
        l.check_header()?;
        Ok(l)
    }
}
