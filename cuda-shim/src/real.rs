//! Finding and loading the real driver.
//!
//! Never by soname: `dlopen("libcuda.so.1")` from inside the interposer
//! returns the interposer itself. The real libraries are the versioned files
//! beside it (`libcuda.so.550.54.15`), which the vdriver mirror keeps next
//! to the interposer's `libcuda.so.1` / `libnvidia-ml.so.1` links. Which
//! version: the one `vcuda.config` names (major.minor), else the kernel
//! module's (`/proc/driver/nvidia/version`), else the only one there.

use std::ffi::{CStr, CString, c_void};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One of the two real libraries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lib {
    Cuda,
    Nvml,
}

impl Lib {
    pub fn prefix(self) -> &'static str {
        match self {
            Lib::Cuda => "libcuda.so.",
            Lib::Nvml => "libnvidia-ml.so.",
        }
    }
}

/// A loaded library handle (never closed).
#[derive(Debug, Clone, Copy)]
pub struct Handle(pub *mut c_void);
// SAFETY: the handle is an opaque dlopen handle, never closed; dlsym on it is thread-safe.
unsafe impl Send for Handle {}
// SAFETY: as for Send.
unsafe impl Sync for Handle {}

static CUDA: OnceLock<Result<Handle, String>> = OnceLock::new();
static NVML: OnceLock<Result<Handle, String>> = OnceLock::new();

/// The real library, loaded on first use; a failure is the process's
/// fail-closed line.
pub fn handle(lib: Lib) -> Result<Handle, &'static str> {
    let r = try_handle(lib);
    if let Err(e) = r {
        crate::log::fail_closed(e);
    }
    r
}

/// [`handle`] without printing the failure (the caller says it in its own
/// words).
pub fn try_handle(lib: Lib) -> Result<Handle, &'static str> {
    let cell = match lib {
        Lib::Cuda => &CUDA,
        Lib::Nvml => &NVML,
    };
    cell.get_or_init(|| load(lib))
        .as_ref()
        .copied()
        .map_err(String::as_str)
}

/// `dlsym` in the real library; 0 when missing or the library is not
/// loadable.
pub fn sym(lib: Lib, name: &CStr) -> usize {
    match handle(lib) {
        // SAFETY: `h` is a live dlopen handle (never closed) and `name` a NUL-terminated CStr.
        Ok(h) => unsafe { libc::dlsym(h.0, name.as_ptr()) as usize },
        Err(_) => 0,
    }
}

/// Resolves `name` into `cache` (a per-call-site static) and returns it.
#[cold]
pub fn resolve_into(cache: &AtomicUsize, lib: Lib, name: &CStr) -> usize {
    let p = sym(lib, name);
    if p != 0 {
        cache.store(p, Ordering::Release);
    } else {
        crate::log::log!(Warn, "the real driver has no {name:?}");
    }
    p
}

/// The real function `$name` of type `$ty` in the real CUDA driver (cached
/// per call site), or returns `CUDA_ERROR_NOT_FOUND` from the caller.
macro_rules! real_cuda {
    ($name:ident : $ty:ty) => {{
        static CACHE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let mut p = CACHE.load(std::sync::atomic::Ordering::Acquire);
        if p == 0 {
            p = $crate::real::resolve_into(
                &CACHE,
                $crate::real::Lib::Cuda,
                // SAFETY: literal with a NUL appended.
                unsafe {
                    std::ffi::CStr::from_bytes_with_nul_unchecked(
                        concat!(stringify!($name), "\0").as_bytes(),
                    )
                },
            );
            if p == 0 {
                return cuda_abi::CUDA_ERROR_NOT_FOUND;
            }
        }
        // SAFETY: `p` is the non-zero address dlsym gave for `$name` in the real driver, whose
        // C signature `$ty` is at every call site.
        unsafe { std::mem::transmute::<usize, $ty>(p) }
    }};
}
pub(crate) use real_cuda;

/// Like [`real_cuda!`] for NVML; returns `NVML_ERROR_FUNCTION_NOT_FOUND`.
macro_rules! real_nvml {
    ($name:ident : $ty:ty) => {{
        static CACHE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let mut p = CACHE.load(std::sync::atomic::Ordering::Acquire);
        if p == 0 {
            // SAFETY: literal with a NUL appended.
            p = $crate::real::resolve_into(&CACHE, $crate::real::Lib::Nvml, unsafe {
                std::ffi::CStr::from_bytes_with_nul_unchecked(
                    concat!(stringify!($name), "\0").as_bytes(),
                )
            });
            if p == 0 {
                return $crate::nvml::NVML_ERROR_FUNCTION_NOT_FOUND;
            }
        }
        // SAFETY: `p` is the non-zero address dlsym gave for `$name` in the real NVML, whose C
        // signature `$ty` is at every call site.
        unsafe { std::mem::transmute::<usize, $ty>(p) }
    }};
}
pub(crate) use real_nvml;

/// Path of this library as the dynamic linker loaded it.
pub fn own_path() -> Option<PathBuf> {
    // SAFETY: `Dl_info` is pointers and integers, for which all-zero is valid.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let addr = own_path as *const c_void;
    // SAFETY: dladdr on an address inside this library, filling our local.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr succeeded and `dli_fname` is non-NULL (checked above): a NUL-terminated
    // path the loader owns.
    let s = unsafe { CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(s.to_bytes())))
}

/// `550.54.15` -> [550, 54, 15]; None unless 2 or 3 numeric parts.
pub fn parse_version(v: &str) -> Option<Vec<u32>> {
    let parts: Vec<u32> = v
        .split('.')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    (2..=3).contains(&parts.len()).then_some(parts)
}

/// The kernel module's version from `/proc/driver/nvidia/version`.
pub fn kernel_module_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.contains("Kernel Module"))?;
    let rest = &line[line.find("Kernel Module")? + "Kernel Module".len()..];
    let v = rest
        .split_whitespace()
        .find(|w| parse_version(w).is_some())?;
    Some(v.to_string())
}

/// Picks the real library among `candidates` (file names with `prefix`),
/// by the rules in the module doc. Pure, for testing.
pub fn choose(
    prefix: &str,
    candidates: &[String],
    config_version: Option<(i32, i32)>,
    module_version: Option<&str>,
) -> Result<String, String> {
    let mut versioned: Vec<(Vec<u32>, &String)> = candidates
        .iter()
        .filter_map(|n| Some((parse_version(n.strip_prefix(prefix)?)?, n)))
        .collect();
    versioned.sort();
    if let Some((maj, min)) = config_version.filter(|&(a, _)| a > 0)
        && let Some((_, n)) = versioned
            .iter()
            .rev()
            .find(|(v, _)| v[0] as i64 == maj as i64 && v[1] as i64 == min as i64)
    {
        return Ok((*n).clone());
    }
    if let Some(mv) = module_version {
        let want = format!("{prefix}{mv}");
        if let Some((_, n)) = versioned.iter().find(|(_, n)| **n == want) {
            return Ok((*n).clone());
        }
    }
    if versioned.len() == 1 {
        return Ok(versioned[0].1.clone());
    }
    let mut looked = Vec::new();
    if let Some((maj, min)) = config_version.filter(|&(a, _)| a > 0) {
        looked.push(format!(
            "{prefix}{maj}.{min}[.*] (driver_version in vcuda.config)"
        ));
    }
    if let Some(mv) = module_version {
        looked.push(format!("{prefix}{mv} (/proc/driver/nvidia/version)"));
    }
    looked.push(format!("a single {prefix}<version>"));
    Err(format!(
        "looked for {}; found {}",
        looked.join(", or "),
        if versioned.is_empty() {
            "none".to_string()
        } else {
            versioned
                .iter()
                .map(|(_, n)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        }
    ))
}

/// The real NVML's SONAME is `libnvidia-ml.so.1`, and the dynamic linker
/// answers a later `dlopen("libnvidia-ml.so.1")` (pynvml, a framework's
/// NVML probe) with the first loaded object that has that name or SONAME:
/// once the real library is loaded, that would be it, and the program would
/// bypass our NVML views. So before loading it, the interposer takes the
/// name itself: a bare-name `dlopen` that the library path resolves to our
/// own file (the vdriver mirror's hard link) adds the name to our link map
/// entry, which comes first. Anything else it finds is closed again.
fn claim_soname(own: &Path, soname: &CStr) {
    let Ok(own_c) = CString::new(own.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: dlopen/dlclose with NUL-terminated CStrings that outlive the calls; a handle we
    // get from the bare-name dlopen that is not our own is closed once, and ours (RTLD_NOLOAD)
    // is only compared.
    unsafe {
        let me = libc::dlopen(own_c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        let h = libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if !h.is_null() && h != me {
            crate::log::log!(
                Warn,
                "{soname:?} on the library path is not the interposer: a program that \
                 loads it by that name bypasses the NVML views"
            );
            libc::dlclose(h);
        }
    }
}

fn load(lib: Lib) -> Result<Handle, String> {
    let own = own_path().ok_or("cannot find the interposer's own path (dladdr failed)")?;
    let own_id = std::fs::metadata(&own).ok().map(|m| (m.dev(), m.ino()));
    let mut dirs: Vec<PathBuf> = own.parent().map(Path::to_path_buf).into_iter().collect();
    if let Ok(canon) = std::fs::canonicalize(&own)
        && let Some(d) = canon.parent()
        && !dirs.iter().any(|x| x == d)
    {
        dirs.push(d.to_path_buf());
    }
    let config_version = crate::config::enforce()
        .map(|e| e.data.driver_version)
        .or_else(|| {
            // Pass-through or closed: still honour a readable config's version.
            let p = crate::config::config_dir().join(quota_config::CONFIG_FILE);
            quota_config::read_config(&p).ok().map(|d| d.driver_version)
        });
    let module = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| kernel_module_version(&t));
    if lib == Lib::Nvml {
        claim_soname(&own, c"libnvidia-ml.so.1");
    }
    let mut errors = Vec::new();
    for dir in &dirs {
        let names: Vec<String> = match std::fs::read_dir(dir) {
            Ok(rd) => rd
                .filter_map(Result::ok)
                .filter(|e| {
                    // Never ourselves, whatever the name.
                    e.metadata().ok().map(|m| (m.dev(), m.ino())) != own_id
                })
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(lib.prefix()))
                .collect(),
            Err(e) => {
                errors.push(format!("{}: {e}", dir.display()));
                continue;
            }
        };
        match choose(lib.prefix(), &names, config_version, module.as_deref()) {
            Ok(name) => {
                let path = dir.join(&name);
                let c =
                    CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
                // SAFETY: dlopen with a NUL-terminated CString that outlives the call.
                let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
                if h.is_null() {
                    // SAFETY: dlerror takes no arguments; its string is read at once, below.
                    let err = unsafe { libc::dlerror() };
                    let msg = if err.is_null() {
                        "unknown error".into()
                    } else {
                        // SAFETY: `err` is non-NULL (checked above): dlerror's NUL-terminated
                        // message, copied before any other dl call.
                        unsafe { CStr::from_ptr(err) }
                            .to_string_lossy()
                            .into_owned()
                    };
                    return Err(format!(
                        "cannot load the real driver {}: {msg}",
                        path.display()
                    ));
                }
                crate::log::log!(Debug, "loaded the real driver {}", path.display());
                return Ok(Handle(h));
            }
            Err(e) => errors.push(format!("in {}: {e}", dir.display())),
        }
    }
    Err(format!(
        "cannot find the real driver ({}*) beside the interposer {}: {}",
        lib.prefix(),
        own.display(),
        errors.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn picks_by_config_then_module_then_single() {
        let c = names(&[
            "libcuda.so.1",
            "libcuda.so",
            "libcuda.so.550.54.15",
            "libcuda.so.535.104.05",
        ]);
        assert_eq!(
            choose("libcuda.so.", &c, Some((550, 54)), None).unwrap(),
            "libcuda.so.550.54.15"
        );
        assert_eq!(
            choose("libcuda.so.", &c, Some((0, 0)), Some("535.104.05")).unwrap(),
            "libcuda.so.535.104.05"
        );
        let e = choose("libcuda.so.", &c, Some((999, 1)), None).unwrap_err();
        assert!(
            e.contains("libcuda.so.999.1") && e.contains("550.54.15"),
            "{e}"
        );
        let one = names(&["libcuda.so.1", "libcuda.so.580.65"]);
        assert_eq!(
            choose("libcuda.so.", &one, Some((999, 1)), None).unwrap(),
            "libcuda.so.580.65"
        );
        assert!(choose("libcuda.so.", &names(&["libcuda.so.1"]), None, None).is_err());
    }

    #[test]
    fn kernel_module_line() {
        let t = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(kernel_module_version(t).as_deref(), Some("550.54.15"));
        let open =
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n";
        assert_eq!(kernel_module_version(open).as_deref(), Some("580.65.06"));
        assert_eq!(kernel_module_version("nothing"), None);
    }
}
