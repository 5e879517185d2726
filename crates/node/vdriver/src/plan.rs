//! What a volume directory should contain, decided without touching the filesystem.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::ldcache::LibClass;

/// A driver library found on the host (already resolved, inspected and not blacklisted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundLib {
    pub class: LibClass,
    /// Where the manager reads it (host root joined with its real in-root path).
    pub source: PathBuf,
    /// Its real file name, e.g. `libcuda.so.550.54.15`.
    pub file_name: String,
    pub soname: Option<String>,
}

/// A driver program found on the host root's PATH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundBin {
    /// The name asked for (what containers run), e.g. `nvidia-smi`.
    pub name: String,
    pub source: PathBuf,
}

/// Where a regular file's content comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A host driver file.
    Host(PathBuf),
    /// The interposer library.
    Interposer(PathBuf),
    /// Another file of the same volume (relative path), hard-linked so that one library
    /// loaded under two names is one object for the dynamic linker.
    Sibling(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    File(Source),
    /// A relative symlink to a file in the same directory.
    Symlink(String),
}

/// A volume's desired content: paths relative to the volume directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumePlan {
    pub entries: BTreeMap<PathBuf, Entry>,
}

/// The directories every volume has, whether or not anything lands in them.
pub const DIRS: [&str; 3] = ["bin", "lib", "lib64"];

/// Names the interposer takes in a shared volume's `lib64/`.
pub const INTERPOSED: [&str; 4] = [
    "libcuda.so.1",
    "libcuda.so",
    "libnvidia-ml.so.1",
    "libnvidia-ml.so",
];

/// `libcuda.so.1` -> `libcuda.so`; None when the name has no `.so` version to drop.
pub fn unversioned(soname: &str) -> Option<&str> {
    let trimmed = soname.trim_end_matches(|c: char| c.is_ascii_digit() || c == '.');
    // trim also ate the "." before the version; put the name back to `*.so`.
    let base = soname.get(..trimmed.len())?;
    (base.ends_with(".so") && base != soname).then_some(base)
}

/// Plans one volume. `interposer` is Some only for the shared (`nvidia`) volume.
pub fn plan_volume(bins: &[FoundBin], libs: &[FoundLib], interposer: Option<&Path>) -> VolumePlan {
    let mut entries: BTreeMap<PathBuf, Entry> = BTreeMap::new();
    for b in bins {
        entries
            .entry(Path::new("bin").join(&b.name))
            .or_insert_with(|| Entry::File(Source::Host(b.source.clone())));
    }
    // Real files first, so a symlink never hides a file of the same name.
    for l in libs {
        let dst = Path::new(l.class.dir()).join(&l.file_name);
        if let Some(Entry::File(Source::Host(other))) = entries.get(&dst) {
            tracing::warn!(kept = %other.display(), skipped = %l.source.display(), "two driver libraries with one name");
            continue;
        }
        entries.insert(dst, Entry::File(Source::Host(l.source.clone())));
    }
    // Then the links ldconfig would make inside the container: soname, unversioned
    // `.so` (many programs dlopen `libcuda.so`), and GLVND's indirect GLX vendor.
    for l in libs {
        let Some(soname) = l.soname.as_deref() else {
            continue;
        };
        let mut names = vec![soname.to_owned()];
        names.extend(unversioned(soname).map(str::to_owned));
        if let Some(rest) = soname.strip_prefix("libGLX_nvidia") {
            names.push(format!("libGLX_indirect{rest}"));
        }
        for name in names.into_iter().filter(|n| *n != l.file_name) {
            entries
                .entry(Path::new(l.class.dir()).join(name))
                .or_insert_with(|| Entry::Symlink(l.file_name.clone()));
        }
    }
    if let Some(interposer) = interposer {
        let first = Path::new("lib64").join(INTERPOSED[0]);
        entries.insert(
            first.clone(),
            Entry::File(Source::Interposer(interposer.to_owned())),
        );
        for name in &INTERPOSED[1..] {
            entries.insert(
                Path::new("lib64").join(name),
                Entry::File(Source::Sibling(first.clone())),
            );
        }
        // There is no 32-bit interposer: a 32-bit program must not find the real driver
        // under its soname and escape the quota. The versioned files stay (unused).
        for name in INTERPOSED {
            entries.remove(&Path::new("lib").join(name));
        }
    }
    VolumePlan { entries }
}

/// The NVIDIA driver version, from the versioned `libcuda.so.<version>` file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion {
    pub major: u32,
    pub minor: u32,
    /// The third part of versions like `550.54.15`.
    pub patch: Option<u32>,
}

impl DriverVersion {
    /// Parses `libcuda.so.550.54.15` (or `418.67`); None when there is no such version.
    pub fn from_file_name(file_name: &str) -> Option<DriverVersion> {
        let v = file_name.strip_prefix("libcuda.so.")?;
        let parts: Vec<u32> = v
            .split('.')
            .map(|p| p.parse().ok())
            .collect::<Option<_>>()?;
        match parts[..] {
            [major, minor] => Some(DriverVersion {
                major,
                minor,
                patch: None,
            }),
            [major, minor, patch] => Some(DriverVersion {
                major,
                minor,
                patch: Some(patch),
            }),
            _ => None,
        }
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if let Some(p) = self.patch {
            write!(f, ".{p:02}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lib(class: LibClass, file: &str, soname: Option<&str>) -> FoundLib {
        FoundLib {
            class,
            source: PathBuf::from("/host/usr/lib").join(file),
            file_name: file.into(),
            soname: soname.map(Into::into),
        }
    }

    fn driver() -> Vec<FoundLib> {
        vec![
            lib(
                LibClass::Lib64,
                "libcuda.so.550.54.15",
                Some("libcuda.so.1"),
            ),
            lib(
                LibClass::Lib64,
                "libnvidia-ml.so.550.54.15",
                Some("libnvidia-ml.so.1"),
            ),
            lib(
                LibClass::Lib64,
                "libGLX_nvidia.so.550.54.15",
                Some("libGLX_nvidia.so.0"),
            ),
            lib(LibClass::Lib64, "libnvidia-glcore.so.550.54.15", None),
            lib(
                LibClass::Lib32,
                "libcuda.so.550.54.15",
                Some("libcuda.so.1"),
            ),
        ]
    }

    fn get<'a>(p: &'a VolumePlan, path: &str) -> Option<&'a Entry> {
        p.entries.get(Path::new(path))
    }

    fn link(t: &str) -> Entry {
        Entry::Symlink(t.into())
    }

    #[test]
    fn unversioned_names() {
        assert_eq!(unversioned("libcuda.so.1"), Some("libcuda.so"));
        assert_eq!(unversioned("libGLESv2.so.2"), Some("libGLESv2.so"));
        assert_eq!(unversioned("libGLX_nvidia.so.0"), Some("libGLX_nvidia.so"));
        assert_eq!(unversioned("libcuda.so"), None);
        assert_eq!(unversioned("libx264"), None);
    }

    #[test]
    fn origin_plan() {
        let bins = [FoundBin {
            name: "nvidia-smi".into(),
            source: "/host/usr/bin/nvidia-smi".into(),
        }];
        let p = plan_volume(&bins, &driver(), None);
        assert_eq!(
            get(&p, "bin/nvidia-smi"),
            Some(&Entry::File(Source::Host(
                "/host/usr/bin/nvidia-smi".into()
            )))
        );
        assert_eq!(
            get(&p, "lib64/libcuda.so.550.54.15"),
            Some(&Entry::File(Source::Host(
                "/host/usr/lib/libcuda.so.550.54.15".into()
            )))
        );
        assert_eq!(
            get(&p, "lib64/libcuda.so.1"),
            Some(&link("libcuda.so.550.54.15"))
        );
        assert_eq!(
            get(&p, "lib64/libcuda.so"),
            Some(&link("libcuda.so.550.54.15"))
        );
        assert_eq!(
            get(&p, "lib64/libnvidia-ml.so.1"),
            Some(&link("libnvidia-ml.so.550.54.15"))
        );
        assert_eq!(
            get(&p, "lib64/libGLX_indirect.so.0"),
            Some(&link("libGLX_nvidia.so.550.54.15"))
        );
        assert_eq!(
            get(&p, "lib/libcuda.so.1"),
            Some(&link("libcuda.so.550.54.15"))
        );
        // No soname: only the file.
        assert_eq!(
            p.entries
                .keys()
                .filter(|k| k.to_string_lossy().contains("glcore"))
                .count(),
            1
        );
        assert_eq!(p.entries.len(), 15);
    }

    #[test]
    fn shared_plan_puts_the_interposer_under_the_driver_names() {
        let p = plan_volume(&[], &driver(), Some(Path::new("/opt/vcuda/libvcuda.so")));
        assert_eq!(
            get(&p, "lib64/libcuda.so.1"),
            Some(&Entry::File(Source::Interposer(
                "/opt/vcuda/libvcuda.so".into()
            )))
        );
        for name in ["libcuda.so", "libnvidia-ml.so", "libnvidia-ml.so.1"] {
            assert_eq!(
                get(&p, &format!("lib64/{name}")),
                Some(&Entry::File(Source::Sibling("lib64/libcuda.so.1".into()))),
                "{name}"
            );
        }
        // The real driver stays beside it for the interposer to load.
        assert!(matches!(
            get(&p, "lib64/libcuda.so.550.54.15"),
            Some(Entry::File(Source::Host(_)))
        ));
        assert!(matches!(
            get(&p, "lib64/libnvidia-ml.so.550.54.15"),
            Some(Entry::File(Source::Host(_)))
        ));
        // 32-bit: no soname links to the real driver.
        assert_eq!(get(&p, "lib/libcuda.so.1"), None);
        assert_eq!(get(&p, "lib/libcuda.so"), None);
        assert!(get(&p, "lib/libcuda.so.550.54.15").is_some());
    }

    #[test]
    fn files_win_over_links_and_first_file_wins() {
        let libs = vec![
            lib(LibClass::Lib64, "libGL.so.1.7.0", Some("libGL.so.1")),
            lib(LibClass::Lib64, "libGL.so.1", Some("libGL.so.1")),
            FoundLib {
                source: "/elsewhere/libGL.so.1".into(),
                ..lib(LibClass::Lib64, "libGL.so.1", Some("libGL.so.1"))
            },
        ];
        let p = plan_volume(&[], &libs, None);
        assert_eq!(
            get(&p, "lib64/libGL.so.1"),
            Some(&Entry::File(Source::Host(
                "/host/usr/lib/libGL.so.1".into()
            )))
        );
        assert_eq!(get(&p, "lib64/libGL.so"), Some(&link("libGL.so.1.7.0")));
    }

    #[test]
    fn driver_versions() {
        let v = DriverVersion::from_file_name("libcuda.so.550.54.15").unwrap();
        assert_eq!((v.major, v.minor, v.patch), (550, 54, Some(15)));
        assert_eq!(v.to_string(), "550.54.15");
        let v = DriverVersion::from_file_name("libcuda.so.418.67").unwrap();
        assert_eq!((v.major, v.minor, v.patch), (418, 67, None));
        assert_eq!(
            DriverVersion::from_file_name("libcuda.so.535.104.05")
                .unwrap()
                .to_string(),
            "535.104.05"
        );
        assert_eq!(DriverVersion::from_file_name("libcuda.so.1"), None);
        assert_eq!(DriverVersion::from_file_name("libcuda.so"), None);
        assert_eq!(DriverVersion::from_file_name("libcuda.so.1.2.3.4"), None);
        assert_eq!(DriverVersion::from_file_name("libcuda.so.550.x"), None);
    }
}
