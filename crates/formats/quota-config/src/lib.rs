//! The per-container files the manager writes and the interposer reads, in
//! the byte layouts of the original vcuda interposer so either side can
//! interoperate with the original:
//!
//! * `vcuda.config`: the packed 8240-byte `resource_data_t` ([`ResourceData`]);
//! * `pids.config`: native-endian `i32` host PIDs ([`encode_pids`], [`decode_pids`]);
//! * for a share on several GPUs, `vcuda-gpus.config` beside a `vcuda.config`
//!   that interposers enforcing one GPU refuse ([`MultiGpuQuota`], [`read_quota`];
//!   docs/multi-gpu.md).
//!
//! No I/O beyond [`write_atomic`] (also the workspace's one temp-file and
//! rename writer, for any file), [`write_multi`], [`read_config`] and
//! [`read_quota`]; everything else is pure so both sides test it directly.

use std::fs;
use std::path::Path;
use thiserror::Error;

mod atomic;
mod multi;

pub use atomic::{Durability, write_atomic};

pub use multi::{
    ENABLE_MULTI_GPU, GPU_RECORD_SIZE, GPUS_FILE, GPUS_HEADER_SIZE, GPUS_MAGIC, GPUS_VERSION,
    GpuQuota, MAX_GPUS, MIG_UUID_PREFIX, MultiGpuQuota, Quota, WriteError, ledger_file,
    ledger_id_file, read_quota, write_multi,
};

/// File name of the quota file in a container's vm directory.
pub const CONFIG_FILE: &str = "vcuda.config";
/// File name of the PID list in a container's vm directory.
pub const PIDS_FILE: &str = "pids.config";
/// File name of the registration socket in a container's vm directory.
pub const SOCKET_FILE: &str = "vcuda.sock";
/// Where the vm directory is mounted inside a container.
pub const CONTAINER_DIR: &str = "/etc/vcuda";

/// Size of the packed `resource_data_t`.
pub const CONFIG_SIZE: usize = 8240;

const POD_UID_OFF: usize = 0;
const POD_UID_LEN: usize = 48;
const LIMIT_OFF: usize = 48;
const CONTAINER_NAME_OFF: usize = 4096;
const CONTAINER_NAME_LEN: usize = 4096;
const BUS_ID_OFF: usize = 8192;
const BUS_ID_LEN: usize = 16;
const GPU_MEMORY_OFF: usize = 8208;
const UTILIZATION_OFF: usize = 8216;
const HARD_LIMIT_OFF: usize = 8220;
const DRIVER_MAJOR_OFF: usize = 8224;
const DRIVER_MINOR_OFF: usize = 8228;
const ENABLE_OFF: usize = 8232;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{what} is {len} bytes, expected {expected}")]
    Size {
        what: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("field {field} {problem}")]
    Field {
        field: &'static str,
        problem: String,
    },
    /// `vcuda-gpus.config` as a whole (header, size, GPU count).
    #[error("{problem}")]
    Gpus { problem: String },
    /// One GPU's record in `vcuda-gpus.config`.
    #[error("GPU {gpu}: field {field} {problem}")]
    GpuField {
        gpu: usize,
        field: &'static str,
        problem: String,
    },
    /// `vcuda-gpus.config`'s first GPU is not the one `vcuda.config` names.
    #[error("GPU 0: field {field} is {gpus}, but vcuda.config says {config}")]
    Mismatch {
        field: &'static str,
        config: String,
        gpus: String,
    },
}

impl ConfigError {
    /// The file the error is about: `vcuda.config`, `vcuda-gpus.config` or
    /// `pids.config`.
    pub fn file(&self) -> &'static str {
        match self {
            ConfigError::Size { what, .. } => what,
            ConfigError::Field { .. } => CONFIG_FILE,
            ConfigError::Gpus { .. }
            | ConfigError::GpuField { .. }
            | ConfigError::Mismatch { .. } => GPUS_FILE,
        }
    }
}

#[derive(Debug, Error)]
#[error("{path}: {source}")]
pub struct IoError {
    pub path: String,
    #[source]
    pub source: std::io::Error,
}

#[derive(Debug, Error)]
pub enum ReadError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error("{path}: {source}")]
    Invalid {
        path: String,
        #[source]
        source: ConfigError,
    },
}

/// One container's quota: what the manager decided, what the interposer enforces.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResourceData {
    /// Pod UID (at most 47 bytes).
    pub pod_uid: String,
    /// Soft-limit ceiling in percent of the GPU (from the pod annotation
    /// `tencent.com/vcuda-core-limit`); meaningful when `hard_limit` is false.
    pub limit: i32,
    /// Container name (at most 4095 bytes).
    pub container_name: String,
    /// PCI bus id of the GPU, as NVML prints it (at most 15 bytes, e.g.
    /// "0000:3B:00.0"; the 16-byte field cannot hold the 8-digit domain form).
    pub bus_id: String,
    /// Memory quota in bytes.
    pub gpu_memory: u64,
    /// Compute quota in percent of the GPU (`vcuda-core`).
    pub utilization: i32,
    /// True: never above `utilization`. False: may burst up to `limit`
    /// while the GPU is otherwise idle.
    pub hard_limit: bool,
    /// Host driver version, e.g. (550, 54) for 550.54.15.
    pub driver_version: (i32, i32),
    /// False for whole-GPU containers: nothing to enforce.
    pub enable: bool,
}

fn put_str(
    buf: &mut [u8],
    off: usize,
    len: usize,
    field: &'static str,
    s: &str,
) -> Result<(), ConfigError> {
    if s.len() >= len {
        return Err(ConfigError::Field {
            field,
            problem: format!("is {} bytes; at most {} fit", s.len(), len - 1),
        });
    }
    if s.as_bytes().contains(&0) {
        return Err(ConfigError::Field {
            field,
            problem: "contains a NUL byte".into(),
        });
    }
    buf[off..off + s.len()].copy_from_slice(s.as_bytes());
    Ok(())
}

fn get_str(buf: &[u8], off: usize, len: usize, field: &'static str) -> Result<String, ConfigError> {
    let raw = &buf[off..off + len];
    let end = raw
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| ConfigError::Field {
            field,
            problem: "is not NUL-terminated".into(),
        })?;
    String::from_utf8(raw[..end].to_vec()).map_err(|_| ConfigError::Field {
        field,
        problem: "is not UTF-8".into(),
    })
}

fn get_i32(buf: &[u8], off: usize) -> i32 {
    i32::from_ne_bytes(buf[off..off + 4].try_into().unwrap())
}

fn put_enable(buf: &mut [u8], enable: i32) {
    buf[ENABLE_OFF..ENABLE_OFF + 4].copy_from_slice(&enable.to_ne_bytes());
}

impl ResourceData {
    /// The packed `resource_data_t` bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ConfigError> {
        self.validate()?;
        self.encode()
    }

    /// The bytes without the value checks (strings are still checked).
    fn encode(&self) -> Result<Vec<u8>, ConfigError> {
        let mut b = vec![0u8; CONFIG_SIZE];
        put_str(&mut b, POD_UID_OFF, POD_UID_LEN, "pod_uid", &self.pod_uid)?;
        b[LIMIT_OFF..LIMIT_OFF + 4].copy_from_slice(&self.limit.to_ne_bytes());
        put_str(
            &mut b,
            CONTAINER_NAME_OFF,
            CONTAINER_NAME_LEN,
            "container_name",
            &self.container_name,
        )?;
        put_str(&mut b, BUS_ID_OFF, BUS_ID_LEN, "bus_id", &self.bus_id)?;
        b[GPU_MEMORY_OFF..GPU_MEMORY_OFF + 8].copy_from_slice(&self.gpu_memory.to_ne_bytes());
        b[UTILIZATION_OFF..UTILIZATION_OFF + 4].copy_from_slice(&self.utilization.to_ne_bytes());
        b[HARD_LIMIT_OFF..HARD_LIMIT_OFF + 4]
            .copy_from_slice(&(self.hard_limit as i32).to_ne_bytes());
        b[DRIVER_MAJOR_OFF..DRIVER_MAJOR_OFF + 4]
            .copy_from_slice(&self.driver_version.0.to_ne_bytes());
        b[DRIVER_MINOR_OFF..DRIVER_MINOR_OFF + 4]
            .copy_from_slice(&self.driver_version.1.to_ne_bytes());
        put_enable(&mut b, self.enable as i32);
        Ok(b)
    }

    /// Parses and validates packed `resource_data_t` bytes of one GPU (or
    /// pass-through). `enable` 2 (quotas on several GPUs) is refused: this
    /// reader enforces one GPU's quota; [`read_quota`] reads both kinds.
    pub fn from_bytes(b: &[u8]) -> Result<ResourceData, ConfigError> {
        let (d, enable) = ResourceData::decode(b)?;
        if enable == ENABLE_MULTI_GPU {
            return Err(ConfigError::Field {
                field: "enable",
                problem: format!(
                    "is {ENABLE_MULTI_GPU}: the container's quotas are on several GPUs ({GPUS_FILE}), \
                     which a one-GPU reader cannot enforce"
                ),
            });
        }
        if enable != 0 && enable != 1 {
            return Err(ConfigError::Field {
                field: "enable",
                problem: format!("is {enable}; expected 0 or 1"),
            });
        }
        d.validate()?;
        Ok(d)
    }

    /// The fields and the raw `enable` word, unvalidated beyond the size,
    /// the strings and the `hard_limit` flag.
    fn decode(b: &[u8]) -> Result<(ResourceData, i32), ConfigError> {
        if b.len() != CONFIG_SIZE {
            return Err(ConfigError::Size {
                what: CONFIG_FILE,
                len: b.len(),
                expected: CONFIG_SIZE,
            });
        }
        let hard_limit = match get_i32(b, HARD_LIMIT_OFF) {
            0 => false,
            1 => true,
            v => {
                return Err(ConfigError::Field {
                    field: "hard_limit",
                    problem: format!("is {v}; expected 0 or 1"),
                });
            }
        };
        let enable = get_i32(b, ENABLE_OFF);
        let d = ResourceData {
            pod_uid: get_str(b, POD_UID_OFF, POD_UID_LEN, "pod_uid")?,
            limit: get_i32(b, LIMIT_OFF),
            container_name: get_str(b, CONTAINER_NAME_OFF, CONTAINER_NAME_LEN, "container_name")?,
            bus_id: get_str(b, BUS_ID_OFF, BUS_ID_LEN, "bus_id")?,
            gpu_memory: u64::from_ne_bytes(
                b[GPU_MEMORY_OFF..GPU_MEMORY_OFF + 8].try_into().unwrap(),
            ),
            utilization: get_i32(b, UTILIZATION_OFF),
            hard_limit,
            driver_version: (get_i32(b, DRIVER_MAJOR_OFF), get_i32(b, DRIVER_MINOR_OFF)),
            enable: enable != 0,
        };
        Ok((d, enable))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, problem: String| Err(ConfigError::Field { field, problem });
        if !(0..=100).contains(&self.utilization) {
            return bad(
                "utilization",
                format!("is {}; expected 0..=100 percent", self.utilization),
            );
        }
        if !self.hard_limit && !(self.utilization..=100).contains(&self.limit) {
            return bad(
                "limit",
                format!(
                    "is {}; a soft limit must lie between utilization ({}) and 100",
                    self.limit, self.utilization
                ),
            );
        }
        if self.enable && self.gpu_memory == 0 {
            return bad(
                "gpu_memory",
                "is 0 for an enforced (shared) container".into(),
            );
        }
        Ok(())
    }
}

/// Encodes host PIDs as `pids.config` does: native-endian i32, back to back.
pub fn encode_pids(pids: &[i32]) -> Vec<u8> {
    pids.iter().flat_map(|p| p.to_ne_bytes()).collect()
}

/// Decodes `pids.config`.
pub fn decode_pids(b: &[u8]) -> Result<Vec<i32>, ConfigError> {
    if !b.len().is_multiple_of(4) {
        return Err(ConfigError::Size {
            what: "pids.config",
            len: b.len(),
            expected: b.len() / 4 * 4,
        });
    }
    Ok(b.chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect())
}

/// Reads and validates a `vcuda.config`.
pub fn read_config(path: &Path) -> Result<ResourceData, ReadError> {
    let bytes = fs::read(path).map_err(|source| IoError {
        path: path.display().to_string(),
        source,
    })?;
    ResourceData::from_bytes(&bytes).map_err(|source| ReadError::Invalid {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ResourceData {
        ResourceData {
            pod_uid: "0b1c6a3e-8f4e-4c1b-9a77-3f0e2d1c5b6a".into(),
            limit: 0,
            container_name: "trainer".into(),
            bus_id: "0000:3B:00.0".into(),
            gpu_memory: 2 << 30,
            utilization: 30,
            hard_limit: true,
            driver_version: (550, 54),
            enable: true,
        }
    }

    #[test]
    fn layout_matches_resource_data_t() {
        let b = sample().to_bytes().unwrap();
        assert_eq!(b.len(), 8240);
        assert_eq!(&b[0..36], sample().pod_uid.as_bytes());
        assert_eq!(&b[4096..4103], b"trainer");
        assert_eq!(&b[8192..8204], b"0000:3B:00.0");
        assert_eq!(
            u64::from_ne_bytes(b[8208..8216].try_into().unwrap()),
            2 << 30
        );
        assert_eq!(i32::from_ne_bytes(b[8216..8220].try_into().unwrap()), 30);
        assert_eq!(i32::from_ne_bytes(b[8220..8224].try_into().unwrap()), 1);
        assert_eq!(i32::from_ne_bytes(b[8224..8228].try_into().unwrap()), 550);
        assert_eq!(i32::from_ne_bytes(b[8228..8232].try_into().unwrap()), 54);
        assert_eq!(i32::from_ne_bytes(b[8232..8236].try_into().unwrap()), 1);
        assert_eq!(ResourceData::from_bytes(&b).unwrap(), sample());
    }

    #[test]
    fn soft_limit_round_trips() {
        let d = ResourceData {
            hard_limit: false,
            limit: 80,
            ..sample()
        };
        assert_eq!(ResourceData::from_bytes(&d.to_bytes().unwrap()).unwrap(), d);
        let bad = ResourceData { limit: 10, ..d };
        let e = bad.to_bytes().unwrap_err().to_string();
        assert!(e.contains("limit") && e.contains("between"), "{e}");
    }

    #[test]
    fn corrupt_files_are_named_errors() {
        let e = ResourceData::from_bytes(&[0u8; 100]).unwrap_err();
        assert!(e.to_string().contains("100 bytes, expected 8240"));
        let mut b = sample().to_bytes().unwrap();
        b[8220] = 7;
        assert!(
            ResourceData::from_bytes(&b)
                .unwrap_err()
                .to_string()
                .contains("hard_limit")
        );
        let mut b = sample().to_bytes().unwrap();
        b[0..48].fill(b'x');
        assert!(
            ResourceData::from_bytes(&b)
                .unwrap_err()
                .to_string()
                .contains("pod_uid is not NUL-terminated")
        );
        let mut b = sample().to_bytes().unwrap();
        b[8216..8220].copy_from_slice(&500i32.to_ne_bytes());
        assert!(
            ResourceData::from_bytes(&b)
                .unwrap_err()
                .to_string()
                .contains("utilization")
        );
    }

    #[test]
    fn oversize_fields_are_refused() {
        let d = ResourceData {
            pod_uid: "u".repeat(48),
            ..sample()
        };
        assert!(d.to_bytes().unwrap_err().to_string().contains("at most 47"));
        let d = ResourceData {
            bus_id: "00000000:3B:00.0".into(),
            ..sample()
        };
        assert!(d.to_bytes().unwrap_err().to_string().contains("bus_id"));
    }

    #[test]
    fn pids_round_trip() {
        let b = encode_pids(&[1, 4242, 99999]);
        assert_eq!(b.len(), 12);
        assert_eq!(decode_pids(&b).unwrap(), vec![1, 4242, 99999]);
        assert!(decode_pids(&b[..5]).is_err());
        assert!(decode_pids(&[]).unwrap().is_empty());
    }

    #[test]
    fn atomic_write_replaces_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(CONFIG_FILE);
        write_atomic(
            &p,
            &sample().to_bytes().unwrap(),
            0o644,
            Durability::Durable,
        )
        .unwrap();
        assert_eq!(read_config(&p).unwrap(), sample());
        let leftovers: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
        let e = write_atomic(
            &dir.path().join("missing/x"),
            b"x",
            0o644,
            Durability::Durable,
        )
        .unwrap_err();
        assert!(e.to_string().contains("missing"));
    }
}
