//! MIG devices' memory and timelines: two processes (two mappings) in two
//! GPU instances of one GPU.

use crate::NodeSpec;
use crate::state::{InstallOutcome, SharedState, SimRoot};

use crate::state::mig::tests::H100 as NODE;

const P_1G: u32 = 19;
const P_3G: u32 = 9;
const MIB: u64 = 1 << 20;

/// A MIG-enabled GPU with a 1g and a 3g instance, one CI each: (1g, 3g).
fn two_instances() -> (tempfile::TempDir, SimRoot, u32, u32) {
    let dir = tempfile::tempdir().unwrap();
    let root = SimRoot::new(dir.path());
    let node = NodeSpec::parse(NODE, "t").unwrap();
    let made = SharedState::install(&root, &node).unwrap();
    assert_eq!(made, InstallOutcome::Created);
    let s = SharedState::open(&root).unwrap();
    s.set_mig_mode(0, true).unwrap();
    let small = s.create_gpu_instance(0, P_1G, None).unwrap().id;
    let big = s.create_gpu_instance(0, P_3G, None).unwrap().id;
    s.create_compute_instance(0, small, 0, None).unwrap();
    s.create_compute_instance(0, big, 2, None).unwrap();
    (dir, root, small, big)
}

#[test]
fn each_instance_fills_its_own_memory() {
    let (_d, root, small, big) = two_instances();
    let (a, b) = (
        SharedState::open(&root).unwrap(),
        SharedState::open(&root).unwrap(),
    );
    let (ma, mb) = (a.attach().unwrap(), b.attach().unwrap());
    assert!(a.bind_mig(ma, 0, small, 0));
    assert!(b.bind_mig(mb, 0, big, 0));
    let (small_total, big_total) = (a.gi_memory_total(0, small), a.gi_memory_total(0, big));
    assert_eq!(small_total, 9984 * MIB, "1g.10gb on H100");
    assert_eq!(big_total, 40448 * MIB);
    a.try_alloc(ma, 0, small_total).unwrap();
    let err = a.try_alloc(ma, 0, 1).unwrap_err();
    assert_eq!(err.free, 0, "the 1g is full");
    // The 3g is untouched by the full 1g.
    assert_eq!(b.memory_seen(mb, 0), (big_total, 0));
    b.try_alloc(mb, 0, big_total).unwrap();
    assert!(b.try_alloc(mb, 0, 1).is_err());
    // The parent counts both; the process list names the instance.
    assert_eq!(a.memory_used(0), small_total + big_total);
    let procs = a.processes(0);
    assert_eq!(procs.len(), 2);
    assert!(
        procs
            .iter()
            .any(|p| a.process_mig_use(p.slot, 0) == Some((big, 0)))
    );
    a.free(ma, 0, MIB);
    assert_eq!(a.memory_seen(ma, 0), (small_total, small_total - MIB));
    // A dead process's instance memory comes back.
    drop(b);
    assert_eq!(a.gi_memory_used(0, big), 0);
    assert_eq!(a.memory_used(0), small_total - MIB);
}

#[test]
fn instances_do_not_wait_on_each_other() {
    let (_d, root, small, big) = two_instances();
    let (a, b, c) = (
        SharedState::open(&root).unwrap(),
        SharedState::open(&root).unwrap(),
        SharedState::open(&root).unwrap(),
    );
    let (ma, mb, mc) = (
        a.attach().unwrap(),
        b.attach().unwrap(),
        c.attach().unwrap(),
    );
    a.bind_mig(ma, 0, small, 0);
    b.bind_mig(mb, 0, big, 0);
    c.bind_mig(mc, 0, big, 0);
    let (_, ea) = a.launch(ma, 0, 50_000_000, 0);
    let (sb, eb) = b.launch(mb, 0, 1_000_000, 0);
    assert!(sb < ea, "the 3g runs beside the 1g's long kernel");
    // Another process in the same instance time-slices it: behind the
    // kernel, or at a slice boundary inside it, which then ends later.
    let (sc, _) = c.launch(mc, 0, 1_000_000, 0);
    let (slice, switch) = (c.node().timeslice_ns, c.node().context_switch_ns);
    if sc != eb + switch {
        assert_eq!((sc - switch) % slice, 0, "{sc} {eb}");
        assert_eq!(b.resolve(mb, 0, eb), eb + 1_000_000 + 2 * switch);
    }
    assert_eq!(a.resolve(ma, 0, ea), ea, "the other instance is untouched");
}

#[test]
fn a_compute_instance_in_use_is_not_destroyed() {
    let (_d, root, small, _) = two_instances();
    let a = SharedState::open(&root).unwrap();
    let user = SharedState::open(&root).unwrap();
    let me = user.attach().unwrap();
    user.bind_mig(me, 0, small, 0);
    assert_eq!(
        a.destroy_compute_instance(0, small, 0),
        Err(crate::state::MigError::InUse)
    );
    drop(user); // the process exits
    a.destroy_compute_instance(0, small, 0).unwrap();
    a.destroy_gpu_instance(0, small).unwrap();
}

#[test]
fn each_instance_reads_its_own_utilization() {
    let (_d, root, small, big) = two_instances();
    let s = SharedState::open(&root).unwrap();
    let me = s.attach().unwrap();
    s.bind_mig(me, 0, small, 0);
    let (s1, _) = s.launch(me, 0, 5_000_000, 0);
    let (_, e2) = s.launch(me, 0, 5_000_000, 0);
    let u = s.gi_utilization(0, small, s1, e2);
    assert!((u - 100.0).abs() < 1e-9, "{u}");
    let u = s.gi_utilization(0, small, s1, e2 + 10_000_000);
    assert!((u - 50.0).abs() < 1e-9, "{u}");
    assert_eq!(s.gi_utilization(0, big, s1, e2), 0.0, "the idle 3g");
    assert_eq!(
        s.utilization(0, s1, e2),
        0.0,
        "not on the GPU's own timeline"
    );
    assert_eq!(s.gi_utilization(0, 13, s1, e2), 0.0, "no such instance");
    // A destroyed instance reads 0, though its timeline keeps the kernels.
    drop(s);
    let a = SharedState::open(&root).unwrap();
    a.destroy_compute_instance(0, small, 0).unwrap();
    a.destroy_gpu_instance(0, small).unwrap();
    assert_eq!(a.gi_utilization(0, small, s1, e2), 0.0);
}
