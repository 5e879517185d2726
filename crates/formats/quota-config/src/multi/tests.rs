//! Quotas on several GPUs: both files' bytes, how a one-GPU reader refuses
//! them, round trips through a directory, and every error naming its file,
//! GPU and field.

use super::*;
use crate::read_config;

fn gpu(i: u8, cores: i32, gib: u64) -> GpuQuota {
    GpuQuota {
        bus_id: format!("0000:{:02X}:00.0", 0x3b + i),
        uuid: format!("GPU-{i:08x}-1111-2222-3333-444455556666"),
        gpu_memory: gib << 30,
        utilization: cores,
        limit: cores,
    }
}

fn sample() -> MultiGpuQuota {
    MultiGpuQuota {
        pod_uid: "0b1c6a3e-8f4e-4c1b-9a77-3f0e2d1c5b6a".into(),
        container_name: "server".into(),
        hard_limit: true,
        driver_version: (550, 54),
        gpus: vec![gpu(0, 40, 20), gpu(1, 40, 20)],
    }
}

fn i32_at(b: &[u8], off: usize) -> i32 {
    i32::from_ne_bytes(b[off..off + 4].try_into().unwrap())
}

fn err(config: &[u8], gpus: &[u8]) -> (String, &'static str) {
    let e = MultiGpuQuota::from_files(config, gpus).unwrap_err();
    (e.to_string(), e.file())
}

#[test]
fn files_round_trip_and_vcuda_config_keeps_its_layout() {
    let (config, gpus) = sample().to_files().unwrap();
    assert_eq!(config.len(), 8240);
    assert_eq!(&config[4096..4102], b"server");
    assert_eq!(&config[8192..8204], b"0000:3B:00.0", "the first GPU");
    assert_eq!(i32_at(&config, 8216), 40, "the first GPU's cores");
    assert_eq!(
        u64::from_ne_bytes(config[8208..8216].try_into().unwrap()),
        0
    );
    assert_eq!(i32_at(&config, 8232), ENABLE_MULTI_GPU);
    assert_eq!(gpus.len(), 32 + 2 * 96);
    assert_eq!(&gpus[0..8], b"VCUDAGPU");
    assert_eq!(&gpus[32 + 96..32 + 96 + 12], b"0000:3C:00.0");
    assert_eq!(MultiGpuQuota::from_files(&config, &gpus).unwrap(), sample());
}

#[test]
fn a_one_gpu_reader_refuses_the_multi_gpu_config() {
    let (config, _) = sample().to_files().unwrap();
    let e = ResourceData::from_bytes(&config).unwrap_err();
    assert_eq!(e.file(), "vcuda.config");
    let text = e.to_string();
    assert!(
        text.contains("field enable is 2") && text.contains("several GPUs"),
        "{text}"
    );
    // Every reader before this one accepted only 0 or 1 (the flag check of
    // quota-config's first version); other values still say so.
    let mut b = config.clone();
    b[8232..8236].copy_from_slice(&3i32.to_ne_bytes());
    assert!(
        ResourceData::from_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("field enable is 3; expected 0 or 1")
    );
}

#[test]
fn directory_round_trip_both_kinds() {
    let dir = tempfile::tempdir().unwrap();
    write_multi(dir.path(), &sample(), 0o644).unwrap();
    assert_eq!(read_quota(dir.path()).unwrap(), Quota::Multi(sample()));
    let e = read_config(&dir.path().join(CONFIG_FILE)).unwrap_err();
    assert!(e.to_string().contains("several GPUs"), "{e}");

    let one = ResourceData {
        pod_uid: "u".into(),
        limit: 0,
        container_name: "c".into(),
        bus_id: "0000:3B:00.0".into(),
        gpu_memory: 1 << 30,
        utilization: 30,
        hard_limit: true,
        driver_version: (550, 54),
        enable: true,
    };
    let single = tempfile::tempdir().unwrap();
    crate::write_atomic(
        &single.path().join(CONFIG_FILE),
        &one.to_bytes().unwrap(),
        0o644,
        crate::Durability::Derived,
    )
    .unwrap();
    assert_eq!(read_quota(single.path()).unwrap(), Quota::Single(one));
}

#[test]
fn read_errors_name_the_file_at_fault() {
    let dir = tempfile::tempdir().unwrap();
    let (config, mut gpus) = sample().to_files().unwrap();
    crate::write_atomic(
        &dir.path().join(CONFIG_FILE),
        &config,
        0o644,
        crate::Durability::Derived,
    )
    .unwrap();
    let e = read_quota(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("vcuda-gpus.config") && e.contains("No such file"),
        "{e}"
    );
    gpus[32 + 96..32 + 96 + 16].fill(b'x');
    crate::write_atomic(
        &dir.path().join(GPUS_FILE),
        &gpus,
        0o644,
        crate::Durability::Derived,
    )
    .unwrap();
    let e = read_quota(dir.path()).unwrap_err().to_string();
    let want = format!(
        "{}: GPU 1: field bus_id is not NUL-terminated",
        dir.path().join(GPUS_FILE).display()
    );
    assert_eq!(e, want);
    let mut bad = config.clone();
    bad[8220] = 9;
    crate::write_atomic(
        &dir.path().join(CONFIG_FILE),
        &bad,
        0o644,
        crate::Durability::Derived,
    )
    .unwrap();
    let e = read_quota(dir.path()).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}: field hard_limit",
            dir.path().join(CONFIG_FILE).display()
        )),
        "{e}"
    );
}

#[test]
fn header_errors_name_the_gpus_file() {
    let (config, gpus) = sample().to_files().unwrap();
    let with = |off: usize, bytes: &[u8]| {
        let mut g = gpus.clone();
        g[off..off + bytes.len()].copy_from_slice(bytes);
        err(&config, &g)
    };
    for (got, want) in [
        (
            err(&config, &gpus[..10]),
            "10 bytes, shorter than its 32-byte header",
        ),
        (with(0, b"VCUDAGPX"), "does not start with VCUDAGPU"),
        (
            with(8, &2u32.to_ne_bytes()),
            "layout version 2; this build reads 1",
        ),
        (with(16, &64u32.to_ne_bytes()), "record size 64"),
        (with(24, &[1]), "reserved header bytes"),
        (with(12, &3u32.to_ne_bytes()), "224 bytes for 3 GPU(s)"),
        (with(12, &1000u32.to_ne_bytes()), "at most 64 GPUs"),
        (err(&config, &gpus[..32 + 96]), "128 bytes for 2 GPU(s)"),
    ] {
        assert!(got.0.contains(want), "{want:?} not in {:?}", got.0);
        assert_eq!(got.1, GPUS_FILE, "{}", got.0);
    }
}

#[test]
fn record_errors_name_the_gpu_and_field() {
    let (config, gpus) = sample().to_files().unwrap();
    let rec = |i: usize, off: usize, bytes: &[u8]| {
        let mut g = gpus.clone();
        let at = 32 + i * 96 + off;
        g[at..at + bytes.len()].copy_from_slice(bytes);
        err(&config, &g)
    };
    for (got, want) in [
        (
            rec(1, 72, &0i32.to_ne_bytes()),
            "GPU 1: field utilization is 0",
        ),
        (
            rec(1, 64, &0u64.to_ne_bytes()),
            "GPU 1: field gpu_memory is 0",
        ),
        (rec(1, 16, &[0xff, 0]), "GPU 1: field uuid is not UTF-8"),
        (
            rec(1, 90, &[1]),
            "GPU 1: field reserved bytes 80..96 are not zero",
        ),
        (
            rec(1, 0, b"0000:3B:00.0"),
            "GPU 1: field bus_id names the same GPU as GPU 0",
        ),
        (
            rec(0, 0, b"0000:3D:00.0"),
            "GPU 0: field bus_id is 0000:3D:00.0, but vcuda.config says 0000:3B:00.0",
        ),
        (
            rec(0, 72, &50i32.to_ne_bytes()),
            "GPU 0: field utilization is 50, but vcuda.config says 40",
        ),
    ] {
        assert!(got.0.contains(want), "{want:?} not in {:?}", got.0);
        assert_eq!(got.1, GPUS_FILE);
    }
}

#[test]
fn config_errors_name_vcuda_config() {
    let (config, gpus) = sample().to_files().unwrap();
    let one_gpu = {
        let mut b = config.clone();
        b[8232..8236].copy_from_slice(&1i32.to_ne_bytes());
        b
    };
    let (text, file) = err(&one_gpu, &gpus);
    assert!(text.contains("field enable is 1"), "{text}");
    assert_eq!(file, CONFIG_FILE);
    let mut with_memory = config.clone();
    with_memory[8208..8216].copy_from_slice(&(1u64 << 30).to_ne_bytes());
    let (text, file) = err(&with_memory, &gpus);
    assert!(text.contains("field gpu_memory is 1073741824"), "{text}");
    assert_eq!(file, CONFIG_FILE);
    let (text, file) = err(&config[..100], &gpus);
    assert!(text.contains("100 bytes, expected 8240"), "{text}");
    assert_eq!(file, CONFIG_FILE);
}

#[test]
fn what_cannot_be_written_is_refused() {
    let one = MultiGpuQuota {
        gpus: vec![gpu(0, 40, 20)],
        ..sample()
    };
    assert!(
        one.to_files()
            .unwrap_err()
            .to_string()
            .contains("names 1 GPU(s)")
    );
    let mut soft = sample();
    soft.hard_limit = false;
    soft.gpus[1].limit = 20;
    assert!(
        soft.to_files()
            .unwrap_err()
            .to_string()
            .contains("GPU 1: field limit is 20; a soft limit must lie between utilization (40)")
    );
    soft.gpus[1].limit = 90;
    let (config, gpus) = soft.to_files().unwrap();
    assert_eq!(MultiGpuQuota::from_files(&config, &gpus).unwrap(), soft);
    let mut long = sample();
    long.gpus[1].uuid = "G".repeat(48);
    assert!(
        long.to_files()
            .unwrap_err()
            .to_string()
            .contains("GPU 1: field uuid is 48 bytes; at most 47 fit")
    );
    let mut same = sample();
    same.gpus[1].uuid = same.gpus[0].uuid.clone();
    assert!(
        same.to_files()
            .unwrap_err()
            .to_string()
            .contains("names the same GPU as GPU 0")
    );
}

#[test]
fn ledgers_keep_the_one_gpu_name_for_the_first_gpu() {
    assert_eq!(ledger_file(0), container_ledger::LEDGER_FILE);
    assert_eq!(ledger_file(1), "ledger.1");
    assert_eq!(ledger_file(7), "ledger.7");
}

#[test]
fn a_share_in_a_mig_device_is_one_record_and_alone() {
    // A MIG device's UUID as `nvidia-smi -L` prints it (40 bytes: fits).
    let mig = GpuQuota {
        uuid: "MIG-3d2c1b0a-9f8e-5d4c-b3a2-918273645546".into(),
        ..gpu(0, 50, 5)
    };
    let one = MultiGpuQuota {
        gpus: vec![mig.clone()],
        ..sample()
    };
    let (config, gpus) = one.to_files().unwrap();
    assert_eq!(MultiGpuQuota::from_files(&config, &gpus).unwrap(), one);
    assert_eq!(u32::from_ne_bytes(gpus[12..16].try_into().unwrap()), 1);
    // A one-GPU reader refuses it: enable is 2, not 0 or 1.
    assert!(crate::ResourceData::from_bytes(&config).is_err());
    let beside = MultiGpuQuota {
        gpus: vec![gpu(1, 40, 20), mig],
        ..sample()
    };
    let e = beside.to_files().unwrap_err().to_string();
    assert!(
        e.contains("GPU 1: field uuid is MIG device MIG-3d2c1b0a")
            && e.contains("one MIG device per process"),
        "{e}"
    );
}
