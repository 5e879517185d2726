//! Mirrors the host's NVIDIA user-space driver into the vdriver tree:
//! `<vdriver>/origin` (untouched, for whole-GPU pods) and `<vdriver>/nvidia` (with
//! `libcuda` / `libnvidia-ml` replaced by the interposer, for shared pods), each with
//! `bin/`, `lib/`, `lib64/`, to be mounted read-only at `/usr/local/nvidia`.
//!
//! Pure parts: [`config`], [`ldcache`], [`elf`], [`plan`]. I/O: [`rootfs`] (reading the
//! host root) and the mirror itself ([`mirror`] / [`Mirror`]).

mod apply;
pub mod config;
pub mod elf;
mod error;
pub mod ldcache;
pub mod plan;
pub mod rootfs;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use config::{ORIGIN_VOLUME, SHARED_VOLUME, Volume, VolumeConfig};
pub use error::{Error, Result};
pub use ldcache::LibClass;
pub use plan::DriverVersion;

use elf::ElfInfo;
use ldcache::CacheEntry;
use plan::{FoundBin, FoundLib};
use rootfs::{Mapped, resolve_in_root, which_in_root};

/// Where glibc keeps the cache, inside the host root.
pub const LD_CACHE: &str = "/etc/ld.so.cache";

/// What one run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorReport {
    pub driver_version: DriverVersion,
    pub volumes: Vec<VolumeReport>,
}

impl MirrorReport {
    pub fn volume(&self, name: &str) -> Option<&VolumeReport> {
        self.volumes.iter().find(|v| v.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeReport {
    pub name: String,
    /// `<vdriver>/<name>`: the directory to mount at `/usr/local/nvidia`.
    pub path: PathBuf,
    /// Mount mode from the config (`ro`).
    pub mode: String,
    /// Whether the interposer replaced libcuda / libnvidia-ml here.
    pub shared: bool,
    /// Everything the volume now holds, relative to `path` (`lib64/libcuda.so.1`, ...).
    pub files: Vec<PathBuf>,
    /// Regular files hard-linked / copied / left as they were; symlinks (re)made.
    pub linked: usize,
    pub copied: usize,
    pub unchanged: usize,
    pub symlinked: usize,
    /// Stale names unlinked (an older driver's files).
    pub removed: Vec<PathBuf>,
}

/// Mirrors the driver found under `host_root` into `vdriver_dir/<volume name>` for every
/// volume of `config`. The volume named `nvidia` gets `interposer` in place of libcuda and
/// libnvidia-ml when one is given. Safe to re-run at any time, also while containers use
/// the tree. Uses `/etc/ld.so.cache` and [`rootfs::DEFAULT_PATH`] inside the host root;
/// see [`Mirror`] to change them.
pub fn mirror(
    host_root: &Path,
    config: &VolumeConfig,
    vdriver_dir: &Path,
    interposer: Option<&Path>,
) -> Result<MirrorReport> {
    Mirror::new(host_root, config, vdriver_dir)
        .interposer(interposer)
        .run()
}

/// [`mirror`] with every knob.
#[derive(Debug, Clone)]
pub struct Mirror<'a> {
    host_root: &'a Path,
    config: &'a VolumeConfig,
    vdriver_dir: &'a Path,
    interposer: Option<&'a Path>,
    ld_cache: PathBuf,
    path_dirs: Vec<PathBuf>,
}

impl<'a> Mirror<'a> {
    pub fn new(host_root: &'a Path, config: &'a VolumeConfig, vdriver_dir: &'a Path) -> Self {
        Mirror {
            host_root,
            config,
            vdriver_dir,
            interposer: None,
            ld_cache: PathBuf::from(LD_CACHE),
            path_dirs: rootfs::DEFAULT_PATH.iter().map(PathBuf::from).collect(),
        }
    }

    /// The interposer library for the shared (`nvidia`) volume.
    pub fn interposer(mut self, interposer: Option<&'a Path>) -> Self {
        self.interposer = interposer;
        self
    }

    /// The ld.so.cache to read, as a path inside the host root.
    pub fn ld_cache(mut self, in_root: impl Into<PathBuf>) -> Self {
        self.ld_cache = in_root.into();
        self
    }

    /// The PATH directories (inside the host root) searched for binaries.
    pub fn path_dirs(mut self, dirs: Vec<PathBuf>) -> Self {
        self.path_dirs = dirs;
        self
    }

    pub fn run(&self) -> Result<MirrorReport> {
        let cache_path = self
            .host_root
            .join(self.ld_cache.strip_prefix("/").unwrap_or(&self.ld_cache));
        let cache = read_cache(self.host_root, &self.ld_cache, &cache_path)?;
        let interposer = self.interposer.map(check_interposer).transpose()?;

        let mut host = HostLibs::new(self.host_root);
        let mut plans = Vec::new();
        let mut version = None;
        for vol in &self.config.volume {
            let libs = host.libraries(&cache, &vol.components.libraries)?;
            let bins = self.binaries(&vol.components.binaries);
            if version.is_none() {
                version = driver_version(&libs)?;
            }
            let shared = vol.name == SHARED_VOLUME && interposer.is_some();
            if vol.name == SHARED_VOLUME && interposer.is_none() {
                tracing::warn!(
                    "no interposer given: the shared volume gets the real driver and quotas are not enforced"
                );
            }
            let plan = plan::plan_volume(&bins, &libs, if shared { interposer } else { None });
            plans.push((vol, shared, plan));
        }
        // Find the driver before touching the tree: an empty mirror is worse than none.
        let driver_version = match version {
            Some(v) => v,
            None => {
                // The config may not list libcuda; look for it on its own.
                let libs = host.libraries(&cache, &["libcuda.so".to_owned()])?;
                driver_version(&libs)?.ok_or(Error::DriverNotFound { cache: cache_path })?
            }
        };

        let mut volumes = Vec::new();
        for (vol, shared, plan) in plans {
            let path = self.vdriver_dir.join(&vol.name);
            let done = apply::apply(&path, &plan)?;
            tracing::info!(
                volume = %vol.name, path = %path.display(), shared,
                files = plan.entries.len(), linked = done.linked, copied = done.copied,
                unchanged = done.unchanged, removed = done.removed.len(),
                "mirrored driver volume"
            );
            volumes.push(VolumeReport {
                name: vol.name.clone(),
                path,
                mode: vol.mode.clone(),
                shared,
                files: plan.entries.into_keys().collect(),
                linked: done.linked,
                copied: done.copied,
                unchanged: done.unchanged,
                symlinked: done.symlinked,
                removed: done.removed,
            });
        }
        tracing::info!(version = %driver_version, "driver mirrored");
        Ok(MirrorReport {
            driver_version,
            volumes,
        })
    }

    fn binaries(&self, names: &[String]) -> Vec<FoundBin> {
        names
            .iter()
            .filter_map(|name| {
                let found = which_in_root(self.host_root, &self.path_dirs, name);
                if found.is_none() {
                    tracing::debug!(binary = %name, "not on the host's PATH, skipped");
                }
                found.map(|r| FoundBin {
                    name: name.clone(),
                    source: r.host,
                })
            })
            .collect()
    }
}

fn read_cache(root: &Path, in_root: &Path, shown: &Path) -> Result<Vec<CacheEntry>> {
    let resolved = resolve_in_root(root, in_root).map_err(|e| Error::LdCacheRead {
        path: shown.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, e.to_string()),
    })?;
    let data = std::fs::read(&resolved.host).map_err(|source| Error::LdCacheRead {
        path: shown.to_owned(),
        source,
    })?;
    ldcache::parse(&data).map_err(|e| Error::LdCacheFormat {
        path: shown.to_owned(),
        reason: e.to_string(),
    })
}

fn check_interposer(path: &Path) -> Result<&Path> {
    let fail = |reason: String| Error::Interposer {
        path: path.to_owned(),
        reason,
    };
    let map = Mapped::open(path).map_err(|e| fail(e.to_string()))?;
    let info = elf::inspect(map.bytes()).map_err(fail)?;
    if !info.is_64 {
        return Err(fail("it is not a 64-bit library".into()));
    }
    Ok(path)
}

/// The version from the 64-bit `libcuda.so.<version>` among `libs`, if there is one.
fn driver_version(libs: &[FoundLib]) -> Result<Option<DriverVersion>> {
    let Some(cuda) = libs.iter().find(|l| {
        l.class == LibClass::Lib64
            && (l.file_name.starts_with("libcuda.so.")
                || l.soname
                    .as_deref()
                    .is_some_and(|s| s.starts_with("libcuda.so")))
    }) else {
        return Ok(None);
    };
    DriverVersion::from_file_name(&cuda.file_name)
        .map(Some)
        .ok_or_else(|| Error::DriverVersion {
            path: cuda.source.clone(),
        })
}

/// Host libraries by resolved path, each inspected once for all volumes.
struct HostLibs<'a> {
    root: &'a Path,
    inspected: HashMap<PathBuf, ElfInfo>,
}

impl<'a> HostLibs<'a> {
    fn new(root: &'a Path) -> Self {
        HostLibs {
            root,
            inspected: HashMap::new(),
        }
    }

    /// The libraries of the cache matching `prefixes`, resolved inside the root, minus
    /// the blacklisted ones, one per real file and class.
    fn libraries(&mut self, cache: &[CacheEntry], prefixes: &[String]) -> Result<Vec<FoundLib>> {
        let mut out: Vec<FoundLib> = Vec::new();
        for (class, entry) in ldcache::lookup(cache, prefixes) {
            // A stale cache entry (driver removed, ldconfig not re-run) is not fatal.
            let resolved = match resolve_in_root(self.root, Path::new(&entry.value)) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(library = %entry.key, error = %e, "ld.so.cache entry does not resolve, skipped");
                    continue;
                }
            };
            if out
                .iter()
                .any(|l| l.class == class && l.source == resolved.host)
            {
                continue;
            }
            let info = self.inspect(&resolved.host)?;
            if info.is_64 != (class == LibClass::Lib64) {
                tracing::warn!(path = %resolved.host.display(), "ELF class differs from the ld.so.cache entry, skipped");
                continue;
            }
            let file_name = resolved
                .in_root
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if let Some(why) = elf::blacklist_reason(&file_name, info) {
                tracing::info!(path = %resolved.host.display(), reason = why, "library left out");
                continue;
            }
            out.push(FoundLib {
                class,
                source: resolved.host,
                file_name,
                soname: info.soname.clone(),
            });
        }
        Ok(out)
    }

    fn inspect(&mut self, path: &Path) -> Result<&ElfInfo> {
        if !self.inspected.contains_key(path) {
            let fail = |reason: String| Error::Elf {
                path: path.to_owned(),
                reason,
            };
            let map = Mapped::open(path).map_err(|e| fail(e.to_string()))?;
            let info = elf::inspect(map.bytes()).map_err(fail)?;
            self.inspected.insert(path.to_owned(), info);
        }
        Ok(&self.inspected[path])
    }
}
