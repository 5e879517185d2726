//! Golden files: the exact bytes of a one-GPU `vcuda.config` (the original
//! 8240-byte `resource_data_t`) and of a share on two GPUs (`vcuda.config`
//! with `enable` 2 and `gpu_memory` 0, plus `vcuda-gpus.config`), as the
//! manager writes them and interposers read them (little-endian hosts).
//!
//! A change to either layout fails here. Regenerate deliberately with
//! `VCUDA_BLESS=1 cargo test -p quota-config --test golden` and say why in
//! the commit: an interposer already installed on a node reads these bytes.
#![cfg(target_endian = "little")]

use std::path::PathBuf;

use quota_config::{
    CONFIG_FILE, GPUS_FILE, GpuQuota, MultiGpuQuota, Quota, ResourceData, read_quota,
};

fn golden(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(rel)
}

/// Compares `bytes` with the golden file (or writes it when blessing).
fn check(rel: &str, bytes: &[u8]) {
    let path = golden(rel);
    if std::env::var_os("VCUDA_BLESS").is_some() {
        std::fs::write(&path, bytes).unwrap();
    }
    let want = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(want.len(), bytes.len(), "{rel}: size");
    if let Some(off) = (0..want.len()).find(|&i| want[i] != bytes[i]) {
        panic!(
            "{rel}: byte {off} is {:#04x}, golden {:#04x}",
            bytes[off], want[off]
        );
    }
}

fn one_gpu() -> ResourceData {
    ResourceData {
        pod_uid: "0b1c6a3e-8f4e-4c1b-9a77-3f0e2d1c5b6a".into(),
        limit: 60,
        container_name: "trainer".into(),
        bus_id: "0000:3B:00.0".into(),
        gpu_memory: 2 << 30,
        utilization: 30,
        hard_limit: false,
        driver_version: (550, 54),
        enable: true,
    }
}

fn two_gpus() -> MultiGpuQuota {
    let gpu = |bus: &str, uuid: &str| GpuQuota {
        bus_id: bus.into(),
        uuid: uuid.into(),
        gpu_memory: 20 << 30,
        utilization: 40,
        limit: 40,
    };
    MultiGpuQuota {
        pod_uid: "7d0c2b7e-3c55-4d8e-a1a4-5b7c1a2f9e10".into(),
        container_name: "server".into(),
        hard_limit: true,
        driver_version: (550, 54),
        gpus: vec![
            gpu("0000:3B:00.0", "GPU-103073d9-fd09-5c26-b01b-d6943a319e0b"),
            gpu("0000:3C:00.0", "GPU-f22b542f-9e35-5ec7-a38a-c95cdf0102ee"),
        ],
    }
}

#[test]
fn one_gpu_vcuda_config_is_the_original_layout() {
    let bytes = one_gpu().to_bytes().unwrap();
    check("vcuda.config", &bytes);
    assert_eq!(ResourceData::from_bytes(&bytes).unwrap(), one_gpu());
    let dir = golden("");
    // The golden directory holds only this file at its top: a one-GPU read.
    assert_eq!(read_quota(&dir).unwrap(), Quota::Single(one_gpu()));
}

#[test]
fn two_gpu_files() {
    let (config, gpus) = two_gpus().to_files().unwrap();
    check(&format!("multi/{CONFIG_FILE}"), &config);
    check(&format!("multi/{GPUS_FILE}"), &gpus);
    assert_eq!(
        read_quota(&golden("multi")).unwrap(),
        Quota::Multi(two_gpus())
    );
}

/// What every interposer that enforces one GPU does with the two-GPU
/// `vcuda.config`: this project's (quota-config's `enable` check has taken
/// 0 or 1 only since its first version) refuses it, so it refuses CUDA;
/// a reader of the original C layout that takes any non-zero `enable` as
/// "on" finds a memory quota of 0.
#[test]
fn one_gpu_readers_fail_closed_on_the_two_gpu_config() {
    let config = std::fs::read(golden(&format!("multi/{CONFIG_FILE}"))).unwrap();
    let enable = i32::from_le_bytes(config[8232..8236].try_into().unwrap());
    let memory = u64::from_le_bytes(config[8208..8216].try_into().unwrap());
    assert!(enable != 0 && enable != 1, "enable {enable}");
    assert_eq!(memory, 0);
    let e = ResourceData::from_bytes(&config).unwrap_err();
    assert!(e.to_string().contains("field enable is 2"), "{e}");
}

/// A share inside a MIG device (docs/mig.md): one record naming the
/// instance (its parent's bus id, the `MIG-…` UUID `nvidia-smi -L` prints).
fn in_mig() -> MultiGpuQuota {
    MultiGpuQuota {
        gpus: vec![GpuQuota {
            bus_id: "0000:18:00.0".into(),
            uuid: "MIG-5c89a4e2-1f3b-5d7a-9e06-2b4c8d1f7a30".into(),
            gpu_memory: 5 << 30,
            utilization: 50,
            limit: 50,
        }],
        ..two_gpus()
    }
}

#[test]
fn a_share_in_a_mig_device_is_one_record() {
    let (config, gpus) = in_mig().to_files().unwrap();
    check(&format!("mig/{CONFIG_FILE}"), &config);
    check(&format!("mig/{GPUS_FILE}"), &gpus);
    assert_eq!(read_quota(&golden("mig")).unwrap(), Quota::Multi(in_mig()));
    // A one-GPU reader refuses it (enable 2), so CUDA fails closed.
    assert!(ResourceData::from_bytes(&config).is_err());
}
