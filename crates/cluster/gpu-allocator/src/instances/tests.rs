//! Shares inside MIG instances: placement, accounting, refusals, rescans,
//! and the inventory carrying them to the extender.

use crate::inventory::Inventory;
use crate::tests::pcie_node;
use crate::*;

const GIB: u64 = 1 << 30;

fn inst(uuid: &str, gpu: usize, profile: &str, gib: u64) -> SharedInstance {
    SharedInstance {
        uuid: uuid.into(),
        gpu,
        profile: profile.into(),
        memory_bytes: gib * GIB,
    }
}

/// GPU 1 in MIG mode with two 2g.20gb instances and a 3g.40gb one.
fn node() -> Allocator {
    let mut a = pcie_node(2);
    a.set_mig(1, true).unwrap();
    a.set_instances(vec![
        inst("MIG-a", 1, "2g.20gb", 20),
        inst("MIG-b", 1, "2g.20gb", 20),
        inst("MIG-c", 1, "3g.40gb", 40),
    ]);
    a
}

fn in_mig(uuid: &str, cores: u32, units: u64) -> Placement {
    Placement::InMig {
        gpu: 1,
        instance: uuid.into(),
        cores,
        memory_units: units,
    }
}

#[test]
fn a_share_asking_for_a_profile_goes_to_the_fullest_instance_of_it() {
    let mut a = node();
    let req = Request::share(50, 20);
    let first = a.evaluate_for(&req, Some("2g.20gb")).unwrap();
    assert_eq!(first, in_mig("MIG-a", 50, 20));
    a.commit("p/one", &first).unwrap();
    // The next share packs into the instance already in use.
    let second = a
        .evaluate_for(&Request::share(30, 40), Some("2g.20gb"))
        .unwrap();
    assert_eq!(second, in_mig("MIG-a", 30, 40));
    a.commit("p/two", &second).unwrap();
    // No room left in MIG-a for 30 more cores.
    assert_eq!(
        a.evaluate_for(&Request::share(30, 4), Some("2g.20gb"))
            .unwrap(),
        in_mig("MIG-b", 30, 4)
    );
    let (_, u) = a.instance("MIG-a").unwrap();
    assert_eq!(
        (u.allocated_cores, u.allocated_memory_units, u.shares),
        (80, 60, 2)
    );
    // The GPU's own accounting is untouched; on_gpu says so.
    assert!(a.usage(1).is_idle());
    assert_eq!(first.on_gpu(1), None);
    assert_eq!(first.gpus(), &[1]);
    a.release("p/one").unwrap();
    let (_, u) = a.instance("MIG-a").unwrap();
    assert_eq!(
        (u.allocated_cores, u.allocated_memory_units, u.shares),
        (30, 40, 1)
    );
}

#[test]
fn shares_without_a_profile_never_land_in_an_instance_nor_profiled_ones_on_a_gpu() {
    let mut a = node();
    a.set_mig(0, true).unwrap();
    let e = a.evaluate_for(&Request::share(10, 1), None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient, "{e}");
    assert!(e.to_string().contains("MIG mode"), "{e}");
    let mut b = node();
    b.set_instances(vec![]);
    let e = b
        .evaluate_for(&Request::share(10, 1), Some("2g.20gb"))
        .unwrap_err();
    assert!(
        e.to_string().contains("no 2g.20gb MIG instance serves shares on this node (none of its MIG profiles is configured to take shares)"),
        "{e}"
    );
    let e = a
        .evaluate_for(&Request::share(10, 1), Some("1g.10gb"))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("(profiles taking shares here: 2g.20gb, 3g.40gb)"),
        "{e}"
    );
}

#[test]
fn what_an_instance_cannot_hold_is_refused_naming_why() {
    let a = node();
    let cases = [
        (
            Request::share(50, 81),
            "a 2g.20gb instance holds 80 units (20480 MiB)",
        ),
        (Request::whole(1), "1..99 cores"),
        (Request::shares(2, 30, 8), "1..99 cores"),
    ];
    for (req, want) in cases {
        let e = a.evaluate_for(&req, Some("2g.20gb")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
        assert!(e.to_string().contains(want), "{req:?}: {e}");
    }
    let e = a
        .evaluate_for(&Request::share(50, 0), Some("2g.20gb"))
        .unwrap_err();
    assert_eq!(e, AllocError::ShareWithoutMemory { cores: 50 });
    let mut off = Request::share(50, 4);
    off.share_mode = false;
    assert!(matches!(
        a.evaluate_for(&off, Some("2g.20gb")),
        Err(AllocError::ShareModeOff { .. })
    ));
}

#[test]
fn a_full_or_unhealthy_instance_takes_nothing_and_the_error_shows_the_room() {
    let mut a = node();
    a.commit("p/a", &in_mig("MIG-a", 90, 8)).unwrap();
    a.set_instance_healthy("MIG-b", false);
    let e = a
        .evaluate_for(&Request::share(20, 4), Some("2g.20gb"))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Insufficient);
    assert!(e.to_string().contains("free in each: MIG-a 10c/72u"), "{e}");
    // A commit past the instance's room is a conflict; unknown instances
    // and a wrong GPU are malformed.
    let e = a.commit("p/b", &in_mig("MIG-a", 20, 4)).unwrap_err();
    assert!(matches!(e, AllocError::Conflict { .. }), "{e}");
    let e = a.commit("p/c", &in_mig("MIG-z", 20, 4)).unwrap_err();
    assert!(
        e.to_string()
            .contains("MIG instance MIG-z does not serve shares"),
        "{e}"
    );
    let wrong_gpu = Placement::InMig {
        gpu: 0,
        instance: "MIG-c".into(),
        cores: 10,
        memory_units: 1,
    };
    assert!(
        a.commit("p/d", &wrong_gpu)
            .unwrap_err()
            .to_string()
            .contains("is on GPU1, not GPU0")
    );
}

#[test]
fn a_rescan_keeps_accounting_and_a_lost_instance_in_use_stays_unhealthy() {
    let mut a = node();
    a.commit("p/a", &in_mig("MIG-a", 40, 8)).unwrap();
    a.commit("p/c", &in_mig("MIG-c", 40, 8)).unwrap();
    // MIG-a is gone (an operator destroyed it under its pod), MIG-b too
    // (idle), MIG-d is new.
    a.set_instances(vec![
        inst("MIG-c", 1, "3g.40gb", 40),
        inst("MIG-d", 1, "2g.20gb", 20),
    ]);
    let got: Vec<(&str, bool, u32)> = a
        .instances()
        .map(|(i, u)| (i.uuid.as_str(), u.healthy, u.allocated_cores))
        .collect();
    assert_eq!(
        got,
        [
            ("MIG-c", true, 40),
            ("MIG-d", true, 0),
            ("MIG-a", false, 40)
        ]
    );
    assert_eq!(
        a.evaluate_for(&Request::share(10, 1), Some("2g.20gb"))
            .unwrap(),
        in_mig("MIG-d", 10, 1)
    );
    // Its pod going frees it; the next rescan forgets it.
    a.release("p/a").unwrap();
    a.set_instances(vec![inst("MIG-c", 1, "3g.40gb", 40)]);
    assert_eq!(a.instances().count(), 1);
}

#[test]
fn the_inventory_carries_instances_and_older_readers_see_none() {
    let mut a = node();
    a.set_instance_healthy("MIG-b", false);
    let inv = Inventory::of(&a, true);
    let json = inv.to_json();
    assert!(json.contains(r#""instances":[{"uuid":"MIG-a","gpu":1,"profile":"2g.20gb","memory_bytes":21474836480,"healthy":true}"#), "{json}");
    let b = Inventory::from_json(&json).unwrap().allocator();
    let seen: Vec<_> = b.instances().map(|(i, u)| (i.clone(), u)).collect();
    let want: Vec<_> = a.instances().map(|(i, u)| (i.clone(), u)).collect();
    assert_eq!(seen, want);
    // No instances: the field is not written (a version-1 reader's view).
    let plain = Inventory::of(&pcie_node(2), true).to_json();
    assert!(!plain.contains("instances"), "{plain}");
    let bad = json.replace(
        r#""gpu":1,"profile":"3g.40gb""#,
        r#""gpu":7,"profile":"3g.40gb""#,
    );
    let e = Inventory::from_json(&bad).unwrap_err();
    assert!(
        e.to_string()
            .contains("MIG instance MIG-c is on GPU7, and there are 2 GPUs"),
        "{e}"
    );
}

#[test]
fn placements_in_instances_keep_their_serde_form_and_display() {
    let p = in_mig("MIG-a", 50, 20);
    assert_eq!(
        serde_json::to_string(&p).unwrap(),
        r#"{"in_mig":{"gpu":1,"instance":"MIG-a","cores":50,"memory_units":20}}"#
    );
    assert_eq!(
        p.to_string(),
        "share of MIG instance MIG-a on GPU1: 50 cores, 20 memory units"
    );
}

#[test]
fn the_rendered_tree_shows_each_instance_under_its_gpu() {
    let mut a = node();
    a.commit("p/a", &in_mig("MIG-a", 50, 20)).unwrap();
    a.set_instance_healthy("MIG-b", false);
    let text = a.render();
    let lines: Vec<&str> = text.lines().collect();
    let gpu1 = lines.iter().position(|l| l.contains("GPU1 ")).unwrap();
    assert!(lines[gpu1].contains("[MIG]"), "{text}");
    assert!(
        lines[gpu1 + 1].ends_with(
            "MIG 2g.20gb MIG-a: cores 50/100 used, memory 5120/20480 MiB used [1 share]"
        ),
        "{text}"
    );
    assert!(
        lines[gpu1 + 2].ends_with("MIG-b: cores 0/100 used, memory 0/20480 MiB used [UNHEALTHY]"),
        "{text}"
    );
    assert!(lines[gpu1 + 3].contains("MIG 3g.40gb MIG-c"), "{text}");
}
