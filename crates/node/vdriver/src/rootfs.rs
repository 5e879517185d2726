//! Looking at a host root from outside it: symlinks resolved as if chrooted there
//! (an absolute target and `..` never leave the root), and PATH lookup without `which`.

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Linux's limit on symlinks followed in one lookup.
const MAX_LINKS: usize = 40;

/// The PATH searched for binaries inside the host root when none is given.
pub const DEFAULT_PATH: &[&str] = &[
    "/usr/local/nvidia/bin",
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// A file found inside the host root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The final path as seen from inside the root (absolute, no symlinks).
    pub in_root: PathBuf,
    /// The same file as the manager reaches it: `root` joined with `in_root`.
    pub host: PathBuf,
}

/// Resolves `path` (taken as inside `root`, absolute or not) following every symlink within
/// the root. Fails when a component is missing or links loop.
pub fn resolve_in_root(root: &Path, path: &Path) -> Result<Resolved> {
    let fail = |reason: String| Error::Resolve {
        root: root.to_owned(),
        path: path.to_owned(),
        reason,
    };
    // Components still to walk, in reverse so the next one is at the end.
    let mut pending: Vec<OsString> = Vec::new();
    push_components(&mut pending, path);
    let mut done: Vec<OsString> = Vec::new();
    let mut links = 0;
    while let Some(part) = pending.pop() {
        if part == ".." {
            done.pop(); // `..` at the root stays at the root, as in a chroot
            continue;
        }
        let candidate = join(root, &done).join(&part);
        let meta = fs::symlink_metadata(&candidate).map_err(|e| {
            fail(format!(
                "{}: {e}",
                join(Path::new("/"), &done).join(&part).display()
            ))
        })?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_LINKS {
                return Err(fail("too many levels of symbolic links".into()));
            }
            let target = fs::read_link(&candidate)
                .map_err(|e| fail(format!("{}: {e}", candidate.display())))?;
            if target.is_absolute() {
                done.clear(); // absolute targets are relative to the host root
            }
            push_components(&mut pending, &target);
        } else {
            done.push(part);
        }
    }
    Ok(Resolved {
        in_root: join(Path::new("/"), &done),
        host: join(root, &done),
    })
}

fn push_components(pending: &mut Vec<OsString>, path: &Path) {
    let parts: Vec<OsString> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(p) => Some(p.to_owned()),
            Component::ParentDir => Some("..".into()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    pending.extend(parts.into_iter().rev());
}

fn join(base: &Path, parts: &[OsString]) -> PathBuf {
    let mut p = base.to_path_buf();
    p.extend(parts);
    p
}

/// Finds `name` on `path_dirs` (paths inside `root`), first hit wins, as `which` would:
/// a regular file with an execute bit. Missing is `None`, not an error.
pub fn which_in_root(root: &Path, path_dirs: &[PathBuf], name: &str) -> Option<Resolved> {
    path_dirs.iter().find_map(|dir| {
        let found = resolve_in_root(root, &dir.join(name)).ok()?;
        let meta = fs::metadata(&found.host).ok()?;
        (meta.is_file() && meta.permissions().mode() & 0o111 != 0).then_some(found)
    })
}

/// A read-only private mapping of a whole file, so ELF headers of 100+ MiB driver
/// libraries are read without copying them into memory.
pub(crate) struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapped {
    pub(crate) fn open(path: &Path) -> std::io::Result<Mapped> {
        use std::os::fd::AsRawFd;
        let file = fs::File::open(path)?;
        let len = usize::try_from(file.metadata()?.len())
            .map_err(|_| std::io::Error::other("file too large"))?;
        if len == 0 {
            return Ok(Mapped {
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        // SAFETY: a fresh read-only private mapping of an open file; the fd may be closed
        // afterwards. Driver files are replaced by rename, never truncated in place, so the
        // mapping stays backed while we read it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapped { ptr, len })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr/len describe a live PROT_READ mapping owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: unmapping the mapping this value owns, exactly once.
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn absolute_and_dotdot_links_stay_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("usr/lib/nvidia")).unwrap();
        fs::create_dir_all(root.join("etc/alternatives")).unwrap();
        fs::write(root.join("usr/lib/nvidia/libcuda.so.550.54.15"), "inside").unwrap();
        // Absolute link chain through /etc/alternatives, as Debian packages it.
        symlink(
            "/etc/alternatives/libcuda.so.1",
            root.join("usr/lib/libcuda.so.1"),
        )
        .unwrap();
        symlink(
            "/usr/lib/nvidia/libcuda.so.550.54.15",
            root.join("etc/alternatives/libcuda.so.1"),
        )
        .unwrap();
        let r = resolve_in_root(root, Path::new("/usr/lib/libcuda.so.1")).unwrap();
        assert_eq!(r.in_root, Path::new("/usr/lib/nvidia/libcuda.so.550.54.15"));
        assert_eq!(r.host, root.join("usr/lib/nvidia/libcuda.so.550.54.15"));

        // `..` past the root stays at the root: this names <root>/etc/passwd, which does
        // not exist, never the manager's own /etc/passwd.
        symlink("../../../../../../etc/passwd", root.join("usr/lib/escape")).unwrap();
        assert!(resolve_in_root(root, Path::new("/usr/lib/escape")).is_err());
        symlink("/etc/passwd", root.join("usr/lib/escape-abs")).unwrap();
        assert!(resolve_in_root(root, Path::new("/usr/lib/escape-abs")).is_err());
        fs::write(root.join("etc/passwd"), "root's own").unwrap();
        let r = resolve_in_root(root, Path::new("usr/lib/escape")).unwrap();
        assert_eq!(r.host, root.join("etc/passwd"));
        let r = resolve_in_root(root, Path::new("/usr/lib/escape-abs")).unwrap();
        assert_eq!(fs::read_to_string(r.host).unwrap(), "root's own");
    }

    #[test]
    fn loops_are_an_error() {
        let dir = tempfile::tempdir().unwrap();
        symlink("b", dir.path().join("a")).unwrap();
        symlink("/a", dir.path().join("b")).unwrap();
        let err = resolve_in_root(dir.path(), Path::new("/a")).unwrap_err();
        assert!(err.to_string().contains("too many levels"), "{err}");
    }

    #[test]
    fn which_finds_executables_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in ["usr/bin", "usr/local/bin", "opt/nv"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        fs::write(root.join("usr/bin/nvidia-smi"), "").unwrap();
        fs::set_permissions(
            root.join("usr/bin/nvidia-smi"),
            fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        fs::write(root.join("usr/local/bin/nvidia-smi"), "").unwrap(); // not executable
        fs::write(root.join("opt/nv/real"), "").unwrap();
        fs::set_permissions(root.join("opt/nv/real"), fs::Permissions::from_mode(0o755)).unwrap();
        symlink("/opt/nv/real", root.join("usr/local/bin/nvidia-debugdump")).unwrap();
        let path: Vec<PathBuf> = ["/usr/local/bin", "/usr/bin"]
            .iter()
            .map(PathBuf::from)
            .collect();

        let smi = which_in_root(root, &path, "nvidia-smi").unwrap();
        assert_eq!(smi.in_root, Path::new("/usr/bin/nvidia-smi"));
        let dd = which_in_root(root, &path, "nvidia-debugdump").unwrap();
        assert_eq!(dd.in_root, Path::new("/opt/nv/real"));
        assert!(which_in_root(root, &path, "nvidia-persistenced").is_none());
    }

    #[test]
    fn maps_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        fs::write(&p, b"hello").unwrap();
        assert_eq!(Mapped::open(&p).unwrap().bytes(), b"hello");
        fs::write(&p, b"").unwrap();
        assert_eq!(Mapped::open(&p).unwrap().bytes(), b"");
    }
}
