use super::*;
use quota_config::{Quota, read_quota};

fn gpu(i: u8, mem_mib: u64, cores: u32) -> ShareGpu {
    ShareGpu {
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x3b + i),
        uuid: format!("GPU-{i}"),
        memory_bytes: mem_mib << 20,
        cores,
        limit: cores,
        card_bytes: 16 << 30,
    }
}

fn spec(gpus: Vec<ShareGpu>, whole: bool) -> ShareSpec {
    ShareSpec {
        id: "pod-1/main".into(),
        owner: "pod-1".into(),
        slot: "main".into(),
        whole,
        hard_limit: true,
        driver_version: (550, 54),
        gpus,
        tier: qos_page::Tier::Plain,
        memory_limit: None,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_one_gpu_share_gets_its_quota_a_ledger_and_a_socket() {
    let (tmp, rt) = (tempfile::tempdir().unwrap(), rt());
    let _g = rt.enter();
    let shares = Shares::new(tmp.path());
    let dir = shares.open(&spec(vec![gpu(0, 1024, 30)], false)).unwrap();
    assert_eq!(dir, tmp.path().join("pod-1/main"));
    let Quota::Single(q) = read_quota(&dir).unwrap() else {
        panic!("one GPU writes vcuda.config alone")
    };
    assert_eq!(
        (q.bus_id.as_str(), q.gpu_memory, q.utilization, q.enable),
        ("0000:3B:00.0", 1 << 30, 30, true)
    );
    assert!(dir.join(quota_config::SOCKET_FILE).exists());
    assert!(crate::ledgers::id_file(&dir, 0).exists());
    assert_eq!(shares.registry().dir("pod-1/main"), Some(dir.clone()));

    shares.close("pod-1/main", "pod-1", "main");
    assert!(!dir.exists() && !tmp.path().join("pod-1").exists());
    assert_eq!(shares.registry().dir("pod-1/main"), None);
}

#[test]
fn a_share_on_two_gpus_writes_both_quotas_and_a_ledger_each() {
    let (tmp, rt) = (tempfile::tempdir().unwrap(), rt());
    let _g = rt.enter();
    let shares = Shares::new(tmp.path());
    let dir = shares
        .open(&spec(vec![gpu(0, 512, 20), gpu(1, 768, 20)], false))
        .unwrap();
    let Quota::Multi(q) = read_quota(&dir).unwrap() else {
        panic!("two GPUs write vcuda-gpus.config")
    };
    let mems: Vec<u64> = q.gpus.iter().map(|g| g.gpu_memory >> 20).collect();
    assert_eq!(mems, [512, 768]);
    assert!(crate::ledgers::id_file(&dir, 0).exists());
    assert!(crate::ledgers::id_file(&dir, 1).exists());
}

/// Tiers order the tenants of the devices a share runs on: a share inside
/// a MIG device gets that device's page (instances are hardware apart),
/// one on two GPUs a page of each.
#[test]
fn a_tiered_share_gets_the_page_of_its_device_a_mig_device_its_own() {
    use qos_page::Tier;
    let (tmp, rt) = (tempfile::tempdir().unwrap(), rt());
    let _g = rt.enter();
    let shares = Shares::new(tmp.path());
    let mig = |i: u8| ShareGpu {
        uuid: format!("MIG-{i}"),
        card_bytes: 20 << 30,
        ..gpu(0, 1024, 50)
    };
    let open = |id: &str, gpus: Vec<ShareGpu>, tier: Tier| {
        let mut s = spec(gpus, false);
        (s.id, s.owner, s.tier) = (id.into(), id.into(), tier);
        shares.open(&s).unwrap();
    };
    open("lat", vec![mig(1)], Tier::Latency);
    open("bat", vec![mig(1)], Tier::Batch);
    open("far", vec![mig(2)], Tier::Batch);
    open("gpu", vec![gpu(1, 1024, 30)], Tier::Batch);
    open("two", vec![gpu(2, 512, 20), gpu(3, 512, 20)], Tier::Latency);
    let mut pages: Vec<String> = shares.pages.lock().unwrap().keys().cloned().collect();
    pages.sort();
    assert_eq!(
        pages,
        ["GPU-1", "GPU-2", "GPU-3", "MIG-1", "MIG-2"],
        "one page per device"
    );
    let reg = shares.registry();
    assert!(reg.gpu_figures("MIG-1").tiered && reg.gpu_figures("MIG-2").tiered);
    assert!(
        !reg.gpu_figures("GPU-0").tiered,
        "the instances' GPU has none"
    );
    assert!(reg.gpu_figures("GPU-2").tiered && reg.gpu_figures("GPU-3").tiered);
}

#[test]
fn whole_gpus_get_a_quota_file_with_nothing_to_enforce_and_no_socket() {
    let (tmp, rt) = (tempfile::tempdir().unwrap(), rt());
    let _g = rt.enter();
    let shares = Shares::new(tmp.path());
    let dir = shares
        .open(&spec(vec![gpu(0, 81920, 100), gpu(1, 81920, 100)], true))
        .unwrap();
    let Quota::Single(q) = read_quota(&dir).unwrap() else {
        panic!("whole GPUs write vcuda.config alone")
    };
    assert!(!q.enable);
    assert!(!dir.join(quota_config::SOCKET_FILE).exists());
    assert!(!crate::ledgers::id_file(&dir, 0).exists());
    assert_eq!(shares.registry().dir("pod-1/main"), None);
}

#[test]
fn a_socket_that_cannot_be_served_leaves_no_directory_behind() {
    let (tmp, rt) = (tempfile::tempdir().unwrap(), rt());
    let _g = rt.enter();
    let shares = Shares::new(tmp.path());
    // A directory where the socket goes: removing it as a file fails, so
    // the bind does too.
    let sock = tmp
        .path()
        .join("pod-1/main")
        .join(quota_config::SOCKET_FILE);
    std::fs::create_dir_all(sock.join("x")).unwrap();
    let err = shares
        .open(&spec(vec![gpu(0, 1024, 30)], false))
        .unwrap_err();
    assert!(matches!(err, ShareError::Serve { .. }), "{err}");
    assert!(err.to_string().contains("pod-1/main/vcuda.sock"), "{err}");
    assert!(!tmp.path().join("pod-1").exists());
    assert_eq!(shares.registry().dir("pod-1/main"), None);
}

#[test]
fn bad_names_and_no_gpu_are_refused_before_anything_is_written() {
    let (tmp, rt) = (tempfile::tempdir().unwrap(), rt());
    let _g = rt.enter();
    let shares = Shares::new(tmp.path());
    let mut s = spec(vec![gpu(0, 1024, 30)], false);
    s.owner = "../escape".into();
    assert!(matches!(shares.open(&s), Err(ShareError::Vm(_))));
    let s = spec(vec![], false);
    assert!(matches!(shares.open(&s), Err(ShareError::NoGpu)));
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn a_close_racing_a_reopen_keeps_the_new_files() {
    let (tmp, rt) = (tempfile::tempdir().unwrap(), rt());
    let _g = rt.enter();
    let shares = Shares::new(tmp.path());
    let dir = shares.open(&spec(vec![gpu(0, 1024, 30)], false)).unwrap();
    shares.close_unless("pod-1/main", "pod-1", "main", || true);
    assert!(dir.join(quota_config::SOCKET_FILE).exists());
    assert_eq!(shares.registry().dir("pod-1/main"), Some(dir));
}
