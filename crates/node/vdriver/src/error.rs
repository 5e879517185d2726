use std::io;
use std::path::PathBuf;

/// Everything that can stop a mirror. Each variant names the file involved and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read volume config {path}: {source}; check --volume-config")]
    ConfigRead { path: PathBuf, source: io::Error },

    #[error(
        "invalid volume config {path}: {message}; see config/volume.conf for the expected shape"
    )]
    Config { path: PathBuf, message: String },

    #[error(
        "cannot read ld.so.cache {path}: {source}; run ldconfig on the host, or check that the host root is mounted"
    )]
    LdCacheRead { path: PathBuf, source: io::Error },

    #[error(
        "{path} is not a usable ld.so.cache ({reason}); regenerate it by running ldconfig on the host"
    )]
    LdCacheFormat { path: PathBuf, reason: String },

    #[error(
        "NVIDIA driver not found: ld.so.cache {cache} lists no 64-bit libcuda.so; install the driver on the host and run ldconfig, or point the host root at the right directory"
    )]
    DriverNotFound { cache: PathBuf },

    #[error(
        "cannot read the driver version from {path}: expected a file named libcuda.so.<major>.<minor>[.<patch>]; check the host's driver installation"
    )]
    DriverVersion { path: PathBuf },

    #[error("cannot resolve {path} inside host root {root}: {reason}")]
    Resolve {
        root: PathBuf,
        path: PathBuf,
        reason: String,
    },

    #[error(
        "{path} is not a usable ELF shared object: {reason}; the driver installation looks damaged, reinstall it"
    )]
    Elf { path: PathBuf, reason: String },

    #[error(
        "interposer {path} is not usable: {reason}; check the interposer path given to the manager"
    )]
    Interposer { path: PathBuf, reason: String },

    #[error(
        "cannot {op} {path}: {source}; check that the vdriver directory is on a writable filesystem"
    )]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand for the I/O error of an operation on a path.
pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}
