//! A container's quotas on several GPUs (docs/multi-gpu.md): `vcuda.config`
//! keeps the 8240-byte `resource_data_t` with the container's own fields and
//! the first GPU's bus id and cores, but says `enable = 2` and
//! `gpu_memory = 0`; `vcuda-gpus.config` holds one record per GPU.
//!
//! Why those two values: every interposer of this project before this
//! change accepts only 0 or 1 in `enable`, so it refuses the file and with
//! it every CUDA context (fail closed), instead of enforcing the first
//! GPU's quota and leaving the others unlimited; the original C interposer,
//! which reads any non-zero `enable` as "on", gets a memory quota of 0 and
//! refuses every allocation.
//!
//! `vcuda-gpus.config` (native-endian, like `resource_data_t`):
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `VCUDAGPU` |
//! | 8..12 | version, 1 |
//! | 12..16 | GPU count, 2..=64; 1 for a share in a MIG device |
//! | 16..20 | record size, 96 |
//! | 20..32 | reserved, zero |
//! | 32 + 96·i | GPU i's record, i = 0 the GPU `vcuda.config` names |
//!
//! A record: `bus_id` 0..16 (NUL-terminated, as in `resource_data_t`),
//! `uuid` 16..64 (NUL-terminated), `gpu_memory` 64..72 (u64 bytes),
//! `utilization` 72..76 (i32, 1..=100), `limit` 76..80 (i32, the soft
//! ceiling), 80..96 reserved, zero. GPU i's ledger is [`ledger_file`]`(i)`.
//!
//! A share inside a MIG device (docs/mig.md) is one record whose `uuid` is
//! the instance's `MIG-…` and `bus_id` its parent GPU's; its memory and
//! compute are relative to the instance. Why this file and not
//! `vcuda.config` alone: an interposer from before MIG shares refuses it
//! (fail closed) instead of enforcing the quota against the whole GPU.

use std::path::Path;

use crate::{
    CONFIG_FILE, CONFIG_SIZE, ConfigError, IoError, ReadError, ResourceData, get_i32, get_str,
    put_str,
};

/// File name of the per-GPU quotas in a container's vm directory.
pub const GPUS_FILE: &str = "vcuda-gpus.config";
/// `enable` in a `vcuda.config` whose quotas are in [`GPUS_FILE`].
pub const ENABLE_MULTI_GPU: i32 = 2;
pub const GPUS_MAGIC: [u8; 8] = *b"VCUDAGPU";
pub const GPUS_VERSION: u32 = 1;
pub const GPUS_HEADER_SIZE: usize = 32;
pub const GPU_RECORD_SIZE: usize = 96;
/// Most GPUs one container's share may span.
pub const MAX_GPUS: usize = 64;

const BUS_ID: (usize, usize) = (0, 16);
const UUID: (usize, usize) = (16, 48);
const MEMORY_OFF: usize = 64;
const UTILIZATION_OFF: usize = 72;
const LIMIT_OFF: usize = 76;
const RESERVED: (usize, usize) = (80, 16);

/// The ledger of the GPU at `position` in [`GPUS_FILE`]: the first GPU
/// keeps the one-GPU name (`ledger`), the others `ledger.<position>`.
pub fn ledger_file(position: usize) -> String {
    if position == 0 {
        "ledger".to_string()
    } else {
        format!("ledger.{position}")
    }
}

/// The record of the GPU at `position`'s ledger (`ledger.id`,
/// `ledger.1.id`, …): the inode of the sealed memfd that is the ledger
/// (`node-agent`'s `ledgers`), written by the daemon.
pub fn ledger_id_file(position: usize) -> String {
    format!("{}.id", ledger_file(position))
}

/// One GPU's part of a share on several GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuQuota {
    /// PCI bus id as NVML prints it (at most 15 bytes, e.g. "0000:3B:00.0").
    pub bus_id: String,
    /// `GPU-...` UUID (at most 47 bytes): the interposer matches a CUDA
    /// device by bus id or UUID, whatever `CUDA_VISIBLE_DEVICES` says.
    pub uuid: String,
    /// Memory quota on this GPU in bytes.
    pub gpu_memory: u64,
    /// Compute quota on this GPU in percent, 1..=100.
    pub utilization: i32,
    /// Soft ceiling in percent (utilization..=100) when the container's
    /// limit is soft.
    pub limit: i32,
}

impl GpuQuota {
    /// A share inside a MIG device: its quotas are relative to the
    /// instance (memory of its card, compute of its SMs).
    pub fn is_mig(&self) -> bool {
        self.uuid.starts_with(MIG_UUID_PREFIX)
    }
}

/// How a MIG device's UUID starts (`nvidia-smi -L`).
pub const MIG_UUID_PREFIX: &str = "MIG-";

/// A container's quotas on two or more GPUs, or inside one MIG device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiGpuQuota {
    pub pod_uid: String,
    pub container_name: String,
    /// The container's limit mode, the same on every GPU.
    pub hard_limit: bool,
    pub driver_version: (i32, i32),
    /// In the order the manager chose; the first is the GPU `vcuda.config`
    /// names.
    pub gpus: Vec<GpuQuota>,
}

/// What a container's vm directory says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quota {
    /// `vcuda.config` alone: pass-through (`enable` 0) or one GPU.
    Single(ResourceData),
    /// `vcuda.config` with `enable` 2 and `vcuda-gpus.config`.
    Multi(MultiGpuQuota),
}

fn gpu_err(gpu: usize, field: &'static str, problem: String) -> ConfigError {
    ConfigError::GpuField {
        gpu,
        field,
        problem,
    }
}

impl MultiGpuQuota {
    /// The `vcuda.config` an interposer that enforces one GPU refuses.
    fn config(&self) -> ResourceData {
        let first = &self.gpus[0];
        ResourceData {
            pod_uid: self.pod_uid.clone(),
            limit: first.limit,
            container_name: self.container_name.clone(),
            bus_id: first.bus_id.clone(),
            gpu_memory: 0,
            utilization: first.utilization,
            hard_limit: self.hard_limit,
            driver_version: self.driver_version,
            enable: true,
        }
    }

    /// The two files' bytes: (`vcuda.config`, `vcuda-gpus.config`).
    pub fn to_files(&self) -> Result<(Vec<u8>, Vec<u8>), ConfigError> {
        self.validate()?;
        let mut config = self.config().encode()?;
        crate::put_enable(&mut config, ENABLE_MULTI_GPU);
        let mut gpus = vec![0u8; GPUS_HEADER_SIZE + self.gpus.len() * GPU_RECORD_SIZE];
        gpus[0..8].copy_from_slice(&GPUS_MAGIC);
        gpus[8..12].copy_from_slice(&GPUS_VERSION.to_ne_bytes());
        gpus[12..16].copy_from_slice(&(self.gpus.len() as u32).to_ne_bytes());
        gpus[16..20].copy_from_slice(&(GPU_RECORD_SIZE as u32).to_ne_bytes());
        for (i, g) in self.gpus.iter().enumerate() {
            let r = &mut gpus[GPUS_HEADER_SIZE + i * GPU_RECORD_SIZE..][..GPU_RECORD_SIZE];
            let field = |f, e: ConfigError| match e {
                ConfigError::Field { problem, .. } => gpu_err(i, f, problem),
                e => e,
            };
            put_str(r, BUS_ID.0, BUS_ID.1, "bus_id", &g.bus_id).map_err(|e| field("bus_id", e))?;
            put_str(r, UUID.0, UUID.1, "uuid", &g.uuid).map_err(|e| field("uuid", e))?;
            r[MEMORY_OFF..MEMORY_OFF + 8].copy_from_slice(&g.gpu_memory.to_ne_bytes());
            r[UTILIZATION_OFF..UTILIZATION_OFF + 4].copy_from_slice(&g.utilization.to_ne_bytes());
            r[LIMIT_OFF..LIMIT_OFF + 4].copy_from_slice(&g.limit.to_ne_bytes());
        }
        Ok((config, gpus))
    }

    /// Parses both files and checks they belong together. Errors say which
    /// file ([`ConfigError::file`]), which GPU and which field.
    pub fn from_files(config: &[u8], gpus: &[u8]) -> Result<MultiGpuQuota, ConfigError> {
        let (data, enable) = ResourceData::decode(config)?;
        if enable != ENABLE_MULTI_GPU {
            return Err(ConfigError::Field {
                field: "enable",
                problem: format!(
                    "is {enable}; a container with quotas on several GPUs has {ENABLE_MULTI_GPU}"
                ),
            });
        }
        if data.gpu_memory != 0 {
            return Err(ConfigError::Field {
                field: "gpu_memory",
                problem: format!(
                    "is {}; with quotas on several GPUs it is 0 and each GPU's is in {GPUS_FILE}",
                    data.gpu_memory
                ),
            });
        }
        let records = decode_gpus(gpus)?;
        let q = MultiGpuQuota {
            pod_uid: data.pod_uid.clone(),
            container_name: data.container_name.clone(),
            hard_limit: data.hard_limit,
            driver_version: data.driver_version,
            gpus: records,
        };
        q.validate()?;
        let first = &q.gpus[0];
        for (field, in_config, in_gpus) in [
            ("bus_id", data.bus_id.clone(), first.bus_id.clone()),
            (
                "utilization",
                data.utilization.to_string(),
                first.utilization.to_string(),
            ),
            ("limit", data.limit.to_string(), first.limit.to_string()),
        ] {
            if in_config != in_gpus {
                return Err(ConfigError::Mismatch {
                    field,
                    config: in_config,
                    gpus: in_gpus,
                });
            }
        }
        Ok(q)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let n = self.gpus.len();
        let one_mig = n == 1 && self.gpus[0].is_mig();
        if !(2..=MAX_GPUS).contains(&n) && !one_mig {
            return Err(ConfigError::Gpus {
                problem: format!(
                    "names {n} GPU(s); a share on several GPUs has 2..={MAX_GPUS}, a share in a MIG device 1 (`MIG-` uuid); one GPU: vcuda.config alone"
                ),
            });
        }
        if n > 1
            && let Some(i) = self.gpus.iter().position(GpuQuota::is_mig)
        {
            let p = format!(
                "is MIG device {}: CUDA enumerates one MIG device per process and no GPU beside it, so a share in a MIG device is this file's only record",
                self.gpus[i].uuid
            );
            return Err(gpu_err(i, "uuid", p));
        }
        for (i, g) in self.gpus.iter().enumerate() {
            if !(1..=100).contains(&g.utilization) {
                let p = format!("is {}; expected 1..=100 percent", g.utilization);
                return Err(gpu_err(i, "utilization", p));
            }
            if !self.hard_limit && !(g.utilization..=100).contains(&g.limit) {
                let p = format!(
                    "is {}; a soft limit must lie between utilization ({}) and 100",
                    g.limit, g.utilization
                );
                return Err(gpu_err(i, "limit", p));
            }
            if g.gpu_memory == 0 {
                return Err(gpu_err(i, "gpu_memory", "is 0".into()));
            }
            if g.bus_id.is_empty() {
                return Err(gpu_err(i, "bus_id", "is empty".into()));
            }
            if let Some(j) = self.gpus[..i]
                .iter()
                .position(|o| o.bus_id == g.bus_id || o.uuid == g.uuid)
            {
                let p = format!("names the same GPU as GPU {j} ({} / {})", g.bus_id, g.uuid);
                return Err(gpu_err(i, "bus_id", p));
            }
        }
        Ok(())
    }
}

fn decode_gpus(b: &[u8]) -> Result<Vec<GpuQuota>, ConfigError> {
    let header = |problem: String| Err(ConfigError::Gpus { problem });
    if b.len() < GPUS_HEADER_SIZE {
        return header(format!(
            "is {} bytes, shorter than its {GPUS_HEADER_SIZE}-byte header",
            b.len()
        ));
    }
    if b[0..8] != GPUS_MAGIC {
        return header("does not start with VCUDAGPU".into());
    }
    let word = |off: usize| u32::from_ne_bytes(b[off..off + 4].try_into().unwrap());
    if word(8) != GPUS_VERSION {
        return header(format!(
            "layout version {}; this build reads {GPUS_VERSION}",
            word(8)
        ));
    }
    let (n, size) = (word(12) as usize, word(16) as usize);
    if size != GPU_RECORD_SIZE {
        return header(format!(
            "record size {size}; version {GPUS_VERSION} records are {GPU_RECORD_SIZE} bytes"
        ));
    }
    if b[20..32].iter().any(|&x| x != 0) {
        return header("reserved header bytes 20..32 are not zero".into());
    }
    let expected = GPUS_HEADER_SIZE + n.min(MAX_GPUS + 1) * GPU_RECORD_SIZE;
    if n > MAX_GPUS || b.len() != expected {
        return header(format!(
            "is {} bytes for {n} GPU(s); expected {GPUS_HEADER_SIZE} + {n} × {GPU_RECORD_SIZE} (at most {MAX_GPUS} GPUs)",
            b.len()
        ));
    }
    (0..n)
        .map(|i| {
            let r = &b[GPUS_HEADER_SIZE + i * GPU_RECORD_SIZE..][..GPU_RECORD_SIZE];
            let field = |f, e: ConfigError| match e {
                ConfigError::Field { problem, .. } => gpu_err(i, f, problem),
                e => e,
            };
            if r[RESERVED.0..RESERVED.0 + RESERVED.1]
                .iter()
                .any(|&x| x != 0)
            {
                return Err(gpu_err(i, "reserved", "bytes 80..96 are not zero".into()));
            }
            Ok(GpuQuota {
                bus_id: get_str(r, BUS_ID.0, BUS_ID.1, "bus_id").map_err(|e| field("bus_id", e))?,
                uuid: get_str(r, UUID.0, UUID.1, "uuid").map_err(|e| field("uuid", e))?,
                gpu_memory: u64::from_ne_bytes(r[MEMORY_OFF..MEMORY_OFF + 8].try_into().unwrap()),
                utilization: get_i32(r, UTILIZATION_OFF),
                limit: get_i32(r, LIMIT_OFF),
            })
        })
        .collect()
}

/// Writes a container's quotas on several GPUs into `dir`: the per-GPU
/// file first, then `vcuda.config`, each atomically, so a reader that sees
/// `enable` 2 always finds the GPUs. Both fsynced
/// ([`crate::Durability::Durable`]).
pub fn write_multi(dir: &Path, q: &MultiGpuQuota, mode: u32) -> Result<(), WriteError> {
    use crate::Durability::Durable;
    let (config, gpus) = q.to_files()?;
    crate::write_atomic(&dir.join(GPUS_FILE), &gpus, mode, Durable)?;
    crate::write_atomic(&dir.join(CONFIG_FILE), &config, mode, Durable)?;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    #[error(transparent)]
    Io(#[from] IoError),
}

/// Reads a vm directory's quota: `vcuda.config`, and `vcuda-gpus.config`
/// when it says so. Errors name the file at fault.
pub fn read_quota(dir: &Path) -> Result<Quota, ReadError> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|source| IoError {
            path: path.display().to_string(),
            source,
        })
    };
    let invalid = |source: ConfigError| ReadError::Invalid {
        path: dir.join(source.file()).display().to_string(),
        source,
    };
    let config = read(CONFIG_FILE)?;
    let (_, enable) = ResourceData::decode(&config).map_err(invalid)?;
    if enable != ENABLE_MULTI_GPU {
        return ResourceData::from_bytes(&config)
            .map(Quota::Single)
            .map_err(invalid);
    }
    let gpus = read(GPUS_FILE)?;
    MultiGpuQuota::from_files(&config, &gpus)
        .map(Quota::Multi)
        .map_err(invalid)
}

const _: () = assert!(CONFIG_SIZE == 8240);

#[cfg(test)]
mod tests;
