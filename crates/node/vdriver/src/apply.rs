//! Making a volume directory match its plan without disturbing running containers:
//! nothing is ever truncated or written in place. New content is prepared under a
//! temporary name and renamed over the old one, so a process that has the old file
//! mapped keeps the old inode intact; stale names are unlinked.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, io_err};
use crate::plan::{DIRS, Entry, Source, VolumePlan};

/// Prefix of in-flight temporary names; leftovers from a crash are removed as stale.
const TMP_PREFIX: &str = ".vdriver-tmp.";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Linked,
    Copied,
    Symlinked,
    Unchanged,
}

#[derive(Debug, Default)]
pub(crate) struct Applied {
    pub linked: usize,
    pub copied: usize,
    pub symlinked: usize,
    pub unchanged: usize,
    pub removed: Vec<PathBuf>,
}

impl Applied {
    fn count(&mut self, o: Outcome) {
        match o {
            Outcome::Linked => self.linked += 1,
            Outcome::Copied => self.copied += 1,
            Outcome::Symlinked => self.symlinked += 1,
            Outcome::Unchanged => self.unchanged += 1,
        }
    }
}

pub(crate) fn apply(vol_dir: &Path, plan: &VolumePlan) -> Result<Applied> {
    let mut done = Applied::default();
    for d in std::iter::once(vol_dir.to_path_buf()).chain(DIRS.iter().map(|d| vol_dir.join(d))) {
        fs::create_dir_all(&d).map_err(io_err("create directory", &d))?;
    }
    // Siblings link to files placed in the first pass; symlinks last so they never dangle.
    let files = plan.entries.iter().filter_map(|(p, e)| match e {
        Entry::File(s) => Some((p, s)),
        Entry::Symlink(_) => None,
    });
    let (siblings, direct): (Vec<_>, Vec<_>) =
        files.partition(|(_, s)| matches!(s, Source::Sibling(_)));
    for (rel, src) in direct.into_iter().chain(siblings) {
        let src = match src {
            Source::Host(p) | Source::Interposer(p) => p.clone(),
            Source::Sibling(p) => vol_dir.join(p),
        };
        done.count(install_file(&src, &vol_dir.join(rel))?);
    }
    for (rel, e) in &plan.entries {
        if let Entry::Symlink(target) = e {
            done.count(install_symlink(target, &vol_dir.join(rel))?);
        }
    }
    done.removed = remove_stale(vol_dir, plan)?;
    for d in DIRS {
        sync_dir(&vol_dir.join(d))?;
    }
    Ok(done)
}

fn tmp_name(dst: &Path) -> PathBuf {
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    dst.with_file_name(format!("{TMP_PREFIX}{}.{name}", std::process::id()))
}

/// Same content already in place: the same inode (hard link), or a copy we made earlier
/// (same size, mtime and permission bits).
fn up_to_date(src: &fs::Metadata, dst: &fs::Metadata) -> bool {
    dst.is_file()
        && ((src.dev() == dst.dev() && src.ino() == dst.ino())
            || (src.len() == dst.len()
                && src.mtime() == dst.mtime()
                && src.mtime_nsec() == dst.mtime_nsec()
                && src.mode() & 0o777 == dst.mode() & 0o777))
}

fn install_file(src: &Path, dst: &Path) -> Result<Outcome> {
    let src_meta = fs::metadata(src).map_err(io_err("read", src))?;
    match fs::symlink_metadata(dst) {
        Ok(m) if up_to_date(&src_meta, &m) => return Ok(Outcome::Unchanged),
        Ok(m) if m.is_dir() => return Err(not_a_file(dst)),
        _ => {}
    }
    let tmp = tmp_name(dst);
    let _ = fs::remove_file(&tmp);
    // A hard link costs nothing and shares the page cache with the host; it fails across
    // filesystems (and bind mounts), where a copy keeping mode and mtime does instead.
    let outcome = match fs::hard_link(src, &tmp) {
        Ok(()) => Outcome::Linked,
        Err(e) => {
            tracing::debug!(src = %src.display(), error = %e, "hard link failed, copying");
            copy(src, &tmp, &src_meta).map_err(|e| {
                let _ = fs::remove_file(&tmp);
                Error::Io {
                    op: "copy into",
                    path: dst.to_owned(),
                    source: e,
                }
            })?;
            Outcome::Copied
        }
    };
    replace_with(&tmp, dst)?;
    Ok(outcome)
}

/// Renames `tmp` over `dst`; removes `tmp` if that fails.
fn replace_with(tmp: &Path, dst: &Path) -> Result<()> {
    fs::rename(tmp, dst).map_err(|e| {
        let _ = fs::remove_file(tmp);
        Error::Io {
            op: "replace",
            path: dst.to_owned(),
            source: e,
        }
    })
}

fn copy(src: &Path, tmp: &Path, meta: &fs::Metadata) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut from = fs::File::open(src)?;
    let mut to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(tmp)?;
    io::copy(&mut from, &mut to)?;
    to.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o777))?;
    // Keeping the source's mtime is what lets the next run see the copy is current.
    to.set_modified(meta.modified()?)?;
    to.sync_all()
}

fn install_symlink(target: &str, dst: &Path) -> Result<Outcome> {
    match fs::symlink_metadata(dst) {
        Ok(m)
            if m.file_type().is_symlink()
                && fs::read_link(dst).is_ok_and(|t| t == Path::new(target)) =>
        {
            return Ok(Outcome::Unchanged);
        }
        Ok(m) if m.is_dir() => return Err(not_a_file(dst)),
        _ => {}
    }
    let tmp = tmp_name(dst);
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).map_err(io_err("create symlink", &tmp))?;
    replace_with(&tmp, dst)?;
    Ok(Outcome::Symlinked)
}

fn not_a_file(dst: &Path) -> Error {
    Error::Io {
        op: "replace",
        path: dst.to_owned(),
        source: io::Error::other("a directory is in the way; remove it by hand"),
    }
}

/// Unlinks files and symlinks in bin/, lib/, lib64/ that the plan does not name (an older
/// driver's libraries, crash leftovers). Directories are never touched: only files this
/// mirror could have made are removed.
fn remove_stale(vol_dir: &Path, plan: &VolumePlan) -> Result<Vec<PathBuf>> {
    let wanted: BTreeSet<&Path> = plan.entries.keys().map(PathBuf::as_path).collect();
    let mut removed = Vec::new();
    for d in DIRS {
        let dir = vol_dir.join(d);
        for entry in fs::read_dir(&dir).map_err(io_err("list", &dir))? {
            let entry = entry.map_err(io_err("list", &dir))?;
            let rel = Path::new(d).join(entry.file_name());
            let ty = entry.file_type().map_err(io_err("stat", entry.path()))?;
            if wanted.contains(rel.as_path()) {
                continue;
            }
            if ty.is_dir() {
                tracing::warn!(path = %entry.path().display(), "unexpected directory in the vdriver tree, left alone");
                continue;
            }
            fs::remove_file(entry.path()).map_err(io_err("remove stale", entry.path()))?;
            removed.push(rel);
        }
    }
    Ok(removed)
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err("sync", dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn replaces_by_rename_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::write(&src, "v1").unwrap();
        let vol = dir.path().join("vol");
        let plan = VolumePlan {
            entries: BTreeMap::from([
                (
                    "lib64/libx.so.1.0".into(),
                    Entry::File(Source::Host(src.clone())),
                ),
                (
                    "lib64/libx.so.1".into(),
                    Entry::Symlink("libx.so.1.0".into()),
                ),
                (
                    "lib64/libx.so".into(),
                    Entry::File(Source::Sibling("lib64/libx.so.1.0".into())),
                ),
            ]),
        };
        let first = apply(&vol, &plan).unwrap();
        assert_eq!((first.linked, first.symlinked, first.unchanged), (2, 1, 0));
        let ino = fs::metadata(vol.join("lib64/libx.so.1.0")).unwrap().ino();
        assert_eq!(ino, fs::metadata(&src).unwrap().ino());
        assert_eq!(ino, fs::metadata(vol.join("lib64/libx.so")).unwrap().ino());

        let again = apply(&vol, &plan).unwrap();
        assert_eq!((again.linked, again.symlinked, again.unchanged), (0, 0, 3));

        // New source content (a new inode, as package managers write it): replaced by rename.
        fs::remove_file(&src).unwrap();
        fs::write(&src, "v2").unwrap();
        fs::write(vol.join("lib64/.vdriver-tmp.1.crashed"), "").unwrap();
        let third = apply(&vol, &plan).unwrap();
        assert_eq!(third.linked, 2);
        assert_eq!(
            third.removed,
            [PathBuf::from("lib64/.vdriver-tmp.1.crashed")]
        );
        assert_eq!(
            fs::read_to_string(vol.join("lib64/libx.so.1")).unwrap(),
            "v2"
        );
    }

    #[test]
    fn copy_keeps_mode_and_mtime() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::write(&src, "content").unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o751)).unwrap();
        let dst = dir.path().join("dst");
        copy(&src, &dst, &fs::metadata(&src).unwrap()).unwrap();
        let (s, d) = (fs::metadata(&src).unwrap(), fs::metadata(&dst).unwrap());
        assert_eq!(d.mode() & 0o777, 0o751);
        assert!(up_to_date(&s, &d));
        assert_ne!(s.ino(), d.ino());
        assert_eq!(fs::read_to_string(&dst).unwrap(), "content");
    }
}
