//! The one "write a temp file, rename it over the target" of the workspace
//! ([`write_atomic`]): readers see the old file or the new one, never half
//! of one. Whether the new content must also survive a crash is the
//! caller's explicit choice ([`Durability`]).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::IoError;

/// Whether a replaced file must survive a crash of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Rebuilt from a durable record after a crash (vm directories, the
    /// successor note): no fsync, so a write on a hot path costs no disk
    /// flush. A crash may leave the old content (or, on some file systems,
    /// an empty file) under the name.
    Derived,
    /// The record itself (checkpoints, CDI specs): the temp file is
    /// fsynced before the rename and the directory after it, so once this
    /// returns Ok the new content survives a crash.
    Durable,
}

/// Names temp files apart within a process; the pid apart between them.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// How many temp names to try before giving up: a name is only taken when
/// a writer in another pid namespace has the same pid and counter, or a
/// crashed one left its temp file behind.
const ATTEMPTS: u32 = 16;

/// Replaces `path` with `bytes`, mode `mode` (whatever the umask): writes
/// `.<name>.tmp.<pid>.<n>` beside it (created exclusively, so two writers
/// never share one) and renames it over `path`, fsyncing as `durability`
/// says. On failure the previous file is intact and the temp file removed;
/// the error names `path`. An error from the directory fsync of
/// [`Durability::Durable`] comes after the rename: the new content is in
/// place but may not survive a crash.
pub fn write_atomic(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    durability: Durability,
) -> Result<(), IoError> {
    let err = |source| IoError {
        path: path.display().to_string(),
        source,
    };
    let name = path.file_name().ok_or_else(|| {
        err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a file name",
        ))
    })?;
    let (tmp, mut file) = create_temp(path, &name.to_string_lossy(), mode).map_err(err)?;
    let result = (|| {
        // The umask may have narrowed the mode.
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.write_all(bytes)?;
        if durability == Durability::Durable {
            file.sync_all()?;
        }
        drop(file);
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(err(e));
    }
    if durability == Durability::Durable {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err)?;
    }
    Ok(())
}

/// A new temp file beside `path`, created by this call (never one another
/// writer holds or a crashed one left).
fn create_temp(path: &Path, name: &str, mode: u32) -> std::io::Result<(PathBuf, fs::File)> {
    let pid = std::process::id();
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_file_name(format!(".{name}.tmp.{pid}.{n}"));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("ATTEMPTS > 0"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const BOTH: [Durability; 2] = [Durability::Derived, Durability::Durable];

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn replaces_content_and_leaves_no_temp_file() {
        for d in BOTH {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("f");
            write_atomic(&p, b"first", 0o644, d).unwrap();
            assert_eq!(fs::read(&p).unwrap(), b"first");
            write_atomic(&p, b"second, longer", 0o644, d).unwrap();
            assert_eq!(fs::read(&p).unwrap(), b"second, longer");
            write_atomic(&p, b"", 0o644, d).unwrap();
            assert_eq!(fs::read(&p).unwrap(), b"");
            assert_eq!(names(dir.path()), ["f"], "{d:?}");
        }
    }

    #[test]
    fn replacement_is_a_new_inode() {
        // A reader holding the old file keeps reading the old content.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write_atomic(&p, b"old", 0o644, Durability::Derived).unwrap();
        let held = fs::File::open(&p).unwrap();
        write_atomic(&p, b"new", 0o644, Durability::Derived).unwrap();
        let mut s = String::new();
        std::io::Read::read_to_string(&mut &held, &mut s).unwrap();
        assert_eq!(s, "old");
        assert_eq!(fs::read(&p).unwrap(), b"new");
    }

    #[test]
    fn sets_the_mode_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        for (mode, d) in [
            (0o600, Durability::Durable),
            (0o666, Durability::Derived),
            (0o644, Durability::Durable),
        ] {
            write_atomic(&p, b"x", mode, d).unwrap();
            assert_eq!(fs::metadata(&p).unwrap().mode() & 0o777, mode);
        }
    }

    #[test]
    fn missing_parent_fails_naming_the_path() {
        for d in BOTH {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("missing/f");
            let e = write_atomic(&p, b"x", 0o644, d).unwrap_err();
            assert_eq!(e.path, p.display().to_string());
            assert!(e.to_string().contains("missing/f"), "{e}");
            assert_eq!(e.source.kind(), std::io::ErrorKind::NotFound);
            assert!(names(dir.path()).is_empty());
        }
    }

    #[test]
    fn directory_target_fails_and_leaves_no_temp_file() {
        for d in BOTH {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("d");
            fs::create_dir(&p).unwrap();
            let e = write_atomic(&p, b"x", 0o644, d).unwrap_err();
            assert!(e.to_string().starts_with(&p.display().to_string()), "{e}");
            assert_eq!(names(dir.path()), ["d"], "{d:?}");
            assert!(p.is_dir());
        }
    }

    #[test]
    fn temp_names_taken_by_others_are_skipped_and_left_alone() {
        // Another writer (same pid in another pid namespace) or a crashed
        // one holds the next temp names: the write takes a free one.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write_atomic(&p, b"old", 0o644, Durability::Durable).unwrap();
        let (pid, n) = (std::process::id(), COUNTER.load(Ordering::Relaxed));
        let theirs: Vec<PathBuf> = (n..n + u64::from(ATTEMPTS) / 2)
            .map(|k| dir.path().join(format!(".f.tmp.{pid}.{k}")))
            .collect();
        for t in &theirs {
            fs::write(t, b"theirs").unwrap();
        }
        write_atomic(&p, b"new", 0o644, Durability::Durable).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"new");
        for t in &theirs {
            assert_eq!(fs::read(t).unwrap(), b"theirs");
        }
        assert_eq!(names(dir.path()).len(), 1 + theirs.len());
    }

    #[test]
    fn no_file_name_is_refused() {
        let e = write_atomic(Path::new("/"), b"x", 0o644, Durability::Derived).unwrap_err();
        assert_eq!(e.path, "/");
        assert_eq!(e.source.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn concurrent_writers_never_share_a_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::thread::scope(|s| {
            for t in 0..8u8 {
                let p = &p;
                s.spawn(move || {
                    let body = vec![t; 4096];
                    for _ in 0..50 {
                        write_atomic(p, &body, 0o644, Durability::Derived).unwrap();
                        let got = fs::read(p).unwrap();
                        assert_eq!(got.len(), 4096);
                        assert!(got.iter().all(|&b| b == got[0]), "a mixed file");
                    }
                });
            }
        });
        assert_eq!(names(dir.path()), ["f"]);
    }
}
