//! A daemon's live ledger, as a test reads it: ledgers are sealed memfds
//! with no path (`node-agent`'s `ledgers`), found by the inode the vm
//! directory's `<ledger>.id` records, in whichever process holds them.

use std::path::Path;

use container_ledger::{Ledger, MemfdId};

/// GPU `gpu`'s live ledger of the container whose vm directory is `dir`.
/// Panics naming what was missing.
pub fn live(dir: &Path, gpu: usize) -> Ledger {
    try_live(dir, gpu).unwrap_or_else(|| {
        panic!(
            "no live ledger {gpu} for {}: is the daemon serving it?",
            dir.display()
        )
    })
}

/// [`live`], `None` when the record or the memfd is missing.
pub fn try_live(dir: &Path, gpu: usize) -> Option<Ledger> {
    let idf = dir.join(quota_config::ledger_id_file(gpu));
    let id = MemfdId::parse(&std::fs::read_to_string(idf).ok()?)?;
    container_ledger::find_live(gpu, id, container_ledger::proc_pids()).map(|(l, _)| l)
}

/// Whether the container keeps a ledger for GPU `gpu` (its id record).
pub fn recorded(dir: &Path, gpu: usize) -> bool {
    dir.join(quota_config::ledger_id_file(gpu)).is_file()
}
