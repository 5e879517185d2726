//! Finding a container's ledger again, or starting a fresh one.
//!
//! A ledger is a sealed memfd (`container_ledger::Ledger::create_sealed`):
//! it has no path, and lives as long as someone holds it. The daemon holds
//! it while it serves the container; every registered interposer holds it
//! too (it keeps the descriptor it was passed). So a daemon that restarted
//! — its child after a crash, a new pod after an upgrade — takes the live
//! ledger back from a registered process of that container: `pids.config`
//! names them (written by the daemon; the vm directory is read-only to the
//! container) and `<ledger>.id` the memfd's inode, which a tenant cannot
//! choose. Only a memfd with that inode, sealed against resizing, is
//! mapped. When no process holds it any more there is nothing to keep: a
//! fresh ledger starts at zero, and a process that re-registers puts what
//! it holds back into its slot (the interposer reconciles its slot with a
//! new ledger).
//!
//! Ledgers of a release before this one were files in the vm directory,
//! resizable by any process holding their descriptor; such a file is
//! removed (its holders keep their mapping and move to the memfd when they
//! re-register).

use std::path::{Path, PathBuf};

use container_ledger::{Ledger, MemfdId};
use quota_config::{PIDS_FILE, ledger_file};

use crate::vm::{LedgerFile, VmError, replace_file};

/// The id record of GPU `gpu`'s ledger in a vm directory.
pub fn id_file(dir: &Path, gpu: usize) -> PathBuf {
    dir.join(quota_config::ledger_id_file(gpu))
}

/// GPU `gpu`'s ledger for the container in `dir`, with `quota` bytes: the
/// live one when this process or a registered process of the container
/// holds it, else a fresh one (its id recorded).
pub fn open(dir: &Path, gpu: usize, quota: u64) -> Result<LedgerFile, VmError> {
    let legacy = dir.join(ledger_file(gpu));
    if std::fs::symlink_metadata(&legacy).is_ok() {
        std::fs::remove_file(&legacy).map_err(|source| VmError::Io {
            path: legacy.display().to_string(),
            source,
        })?;
    }
    let idf = id_file(dir, gpu);
    let recorded = std::fs::read_to_string(&idf)
        .ok()
        .and_then(|s| MemfdId::parse(&s));
    if let Some(id) = recorded
        && let Some((l, f)) = find_live(dir, gpu, id)
    {
        l.set_quota(quota);
        return Ok((l, f));
    }
    let (l, f) = Ledger::create_sealed(gpu, quota).map_err(|source| VmError::Ledger {
        path: format!("memfd for {}", legacy.display()),
        source,
    })?;
    let id = MemfdId::of(&f).map_err(|source| VmError::Io {
        path: "fstat ledger memfd".into(),
        source,
    })?;
    replace_file(&idf, id.render().as_bytes(), 0o644)?;
    Ok((l, f))
}

/// The memfd `id`, found among this process's descriptors or a registered
/// process's of the container (`pids.config`).
fn find_live(dir: &Path, gpu: usize, id: MemfdId) -> Option<LedgerFile> {
    let mut pids = vec![std::process::id() as i32];
    if let Ok(b) = std::fs::read(dir.join(PIDS_FILE))
        && let Ok(p) = quota_config::decode_pids(&b)
    {
        pids.extend(p.into_iter().filter(|&p| p > 0));
    }
    let found = container_ledger::find_live(gpu, id, pids);
    if found.is_some() {
        tracing::info!(gpu, dir = %dir.display(), "took the live ledger back");
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_open_in_the_same_process_finds_the_same_ledger() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(PIDS_FILE), b"").unwrap();
        let (a, fa) = open(d.path(), 0, 1 << 30).unwrap();
        a.claim_slot(4242, None).unwrap();
        let (b, fb) = open(d.path(), 0, 2 << 30).unwrap();
        assert_eq!(
            MemfdId::of(&fa).unwrap(),
            MemfdId::of(&fb).unwrap(),
            "the live memfd, not a fresh one"
        );
        assert_eq!(b.slots().count(), 1);
        assert_eq!(a.quota(), 2 << 30, "the quota is set on the live one");
        drop((a, fa, b, fb));
        // Nobody holds it any more: a fresh one, zeroed.
        let (c, _) = open(d.path(), 0, 1 << 30).unwrap();
        assert_eq!(c.slots().count(), 0);
    }

    #[test]
    fn a_legacy_ledger_file_is_removed() {
        let d = tempfile::tempdir().unwrap();
        let legacy = d.path().join(ledger_file(0));
        let _ = Ledger::create(&legacy, 1 << 20).unwrap();
        open(d.path(), 0, 1 << 20).unwrap();
        assert!(!legacy.exists());
        assert!(id_file(d.path(), 0).exists());
    }
}
