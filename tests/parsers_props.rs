//! Property tests over every parser a tenant or the API server feeds: the
//! registration request (and its budget), ledger images, the quota files,
//! the ledger id record, placement annotations and the manager's
//! checkpoint slots. Whatever the bytes, a parser answers Ok or a named
//! error, never a panic, and what the writers write reads back as written.

use std::path::Path;

use container_ledger::{FILE_SIZE, Ledger, MemfdId};
use proptest::prelude::*;
use prost::Message;
use quota_config::{GpuQuota, MultiGpuQuota, ResourceData};
use vcuda_api::vcuda::RegisterRequest;

fn resource_data() -> impl Strategy<Value = ResourceData> {
    let fields = (
        "[a-f0-9-]{1,47}",
        "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?",
        "[0-9A-F]{4}:[0-9A-F]{2}:[0-9A-F]{2}\\.[0-7]",
        any::<u64>(),
        any::<bool>(),
        (1i32..1000, 0i32..1000),
        any::<bool>(),
    );
    // A soft limit lies between the quota and 100 (what the writer checks).
    let cores = (1i32..=100).prop_flat_map(|u| (Just(u), u..=100));
    (fields, cores).prop_map(
        |(
            (pod_uid, container_name, bus_id, gpu_memory, hard_limit, driver_version, enable),
            (utilization, limit),
        )| {
            ResourceData {
                pod_uid,
                limit,
                container_name,
                bus_id,
                gpu_memory,
                utilization,
                hard_limit,
                driver_version,
                enable,
            }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn vcuda_config_round_trips(d in resource_data()) {
        let b = d.to_bytes().unwrap();
        prop_assert_eq!(ResourceData::from_bytes(&b).unwrap(), d);
    }

    #[test]
    fn any_bytes_as_vcuda_config_are_read_or_refused(b in prop::collection::vec(any::<u8>(), 0..9000)) {
        let _ = ResourceData::from_bytes(&b);
    }

    #[test]
    fn a_flipped_byte_in_a_vcuda_config_is_read_or_refused(d in resource_data(), at in 0usize..8240, bit in 0u8..8) {
        let mut b = d.to_bytes().unwrap();
        b[at] ^= 1 << bit;
        let _ = ResourceData::from_bytes(&b);
    }

    #[test]
    fn pids_config_reads_whole_i32s_only(b in prop::collection::vec(any::<u8>(), 0..256)) {
        match quota_config::decode_pids(&b) {
            Ok(p) => {
                prop_assert_eq!(b.len() % 4, 0);
                prop_assert_eq!(quota_config::encode_pids(&p), b);
            }
            Err(e) => prop_assert!(b.len() % 4 != 0, "{}", e),
        }
    }

    #[test]
    fn the_gpus_file_is_read_or_refused(config in prop::collection::vec(any::<u8>(), 0..9000), gpus in prop::collection::vec(any::<u8>(), 0..2048)) {
        let _ = MultiGpuQuota::from_files(&config, &gpus);
    }

    #[test]
    fn a_share_on_several_gpus_round_trips(n in 2usize..6, mem in 1u64..(1 << 40), util in 1i32..=100) {
        let q = MultiGpuQuota {
            pod_uid: "uid".into(),
            container_name: "main".into(),
            hard_limit: true,
            driver_version: (550, 54),
            gpus: (0..n)
                .map(|i| GpuQuota {
                    bus_id: format!("0000:{:02X}:00.0", i + 1),
                    uuid: format!("GPU-{i}"),
                    gpu_memory: mem,
                    utilization: util,
                    limit: util,
                })
                .collect(),
        };
        let (c, g) = q.to_files().unwrap();
        prop_assert_eq!(MultiGpuQuota::from_files(&c, &g).unwrap(), q);
    }

    #[test]
    fn any_registration_bytes_decode_or_fail_and_the_budget_judges_them(b in prop::collection::vec(any::<u8>(), 0..2048), gpus in 0usize..8) {
        if let Ok(req) = RegisterRequest::decode(b.as_slice()) {
            let ok = node_agent::registry::budget::check_request(&req, gpus).is_ok();
            if ok {
                prop_assert!(req.program.len() <= node_agent::registry::budget::MAX_PROGRAM);
                prop_assert!(req.previous_slots.len() <= gpus.max(1));
            }
            let _ = node_agent::registry::budget::printable(&req.program);
        }
    }

    #[test]
    fn tenant_strings_print_on_one_line_within_bounds(s in any::<String>()) {
        let p = node_agent::registry::budget::printable(&s);
        let one_line = !p.contains('\n') && !p.contains('\r') && !p.contains('\x1b');
        prop_assert!(one_line, "{:?}", p);
        prop_assert!(p.chars().count() <= 64 * 10 + 1);
    }

    #[test]
    fn the_ledger_id_record_is_read_or_refused(s in any::<String>(), dev in any::<u64>(), ino in any::<u64>()) {
        let _ = MemfdId::parse(&s);
        let id = MemfdId { dev, ino };
        prop_assert_eq!(MemfdId::parse(&id.render()), Some(id));
    }

    #[test]
    fn placement_annotations_are_read_or_refused(v in any::<String>(), t in any::<String>(), idx in 0usize..4) {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": {
                format!("tencent.com/predicate-gpu-idx-{idx}"): v,
                "tencent.com/predicate-node": "n",
                "tencent.com/predicate-time": t,
            }},
            "spec": {"containers": [{"name": "c"}]}
        })).unwrap();
        let _ = gpu_pods::predicate_minors(&pod, idx);
        let _ = vcuda_scheduler::cluster::holding_node(&pod);
    }

    /// A MIG profile annotation and an instance record of any content:
    /// accepted only as a profile name, and then a request the extender
    /// and the manager place or refuse (never a panic).
    #[test]
    fn mig_profiles_and_instance_records_are_read_or_refused(p in any::<String>(), uuid in any::<String>(), g in 0u32..100, m in 0u32..1000) {
        for v in [p.clone(), format!("{g}g.{m}gb"), format!("{g}g.{m}gb+{p}")] {
            let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "annotations": {
                    "tencent.com/vcuda-mig-profile": v,
                    "tencent.com/predicate-gpu-idx-0": "0",
                    "tencent.com/predicate-mig-0": uuid,
                }},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {
                    "tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}}}]}
            })).unwrap();
            match gpu_pods::mig_profile(&pod) {
                Ok(Some(name)) => {
                    prop_assert!(gpu_pods::is_mig_profile_name(&name));
                    let r = gpu_allocator::Request::share(50, 4);
                    let inst = gpu_pods::predicate_instance(&pod, 0);
                    let placed = gpu_pods::recorded_in_instance(&r, Some(&name), &[0], inst);
                    prop_assert!(placed.is_ok());
                }
                Ok(None) => prop_assert!(false, "the annotation is there"),
                Err(e) => prop_assert!(e.contains("is not a MIG profile name"), "{}", e),
            }
        }
    }

    #[test]
    fn checkpoint_payloads_are_read_or_refused(b in prop::collection::vec(any::<u8>(), 0..1024)) {
        let _ = gpu_manager::world::checkpoint::parse(&b);
    }
}

/// Ledger images: files of any content and length are mapped only when
/// their header is this build's, and whatever a mapped one holds, reading
/// it never faults.
#[test]
fn any_ledger_image_is_mapped_only_with_a_valid_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let (_, _) = Ledger::create(&path, 1 << 30).unwrap();
    let valid = std::fs::read(&path).unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let image = (
        prop::collection::vec((0usize..FILE_SIZE, any::<u8>()), 0..64),
        prop_oneof![Just(FILE_SIZE), 0usize..FILE_SIZE * 2],
    );
    runner
        .run(&image, |(edits, len)| {
            let mut b = valid.clone();
            for (at, v) in &edits {
                b[*at] = *v;
            }
            b.resize(len, 0);
            check_image(&path, &b);
            Ok(())
        })
        .unwrap();
}

fn check_image(path: &Path, b: &[u8]) {
    std::fs::write(path, b).unwrap();
    match Ledger::open(path) {
        Ok((l, _)) => {
            assert_eq!(b.len(), FILE_SIZE);
            assert_eq!(&b[..8], b"VCUDALDG");
            let _ = (l.quota(), l.used(), l.peak(), l.slots().count());
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}
