//! MIG state: mode changes, GPU and compute instances, seen by a second
//! mapping as by another process.

use super::*;
use crate::state::{InstallOutcome, SimRoot};
use crate::{NodeSpec, mig::Placement};

/// Two H100s, the first MIG-capable (also the MIG-use tests' node).
pub(crate) const H100: &str = r#"
name = "t"
driver_version = "580.95.05"
cuda_version = "13.0"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
uuid = "GPU-00000000-0000-0000-0000-000000000000"
memory_mib = 81559
sm_count = 132
compute_capability = "9.0"
pci_bus_id = "00000000:18:00.0"
minor = 0
mig = "h100-80gb"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
uuid = "GPU-00000000-0000-0000-0000-000000000001"
memory_mib = 81559
sm_count = 132
compute_capability = "9.0"
pci_bus_id = "00000000:2A:00.0"
minor = 1
"#;

fn installed() -> (tempfile::TempDir, SimRoot) {
    let dir = tempfile::tempdir().unwrap();
    let root = SimRoot::new(dir.path());
    let node = NodeSpec::parse(H100, "t").unwrap();
    assert_eq!(
        SharedState::install(&root, &node).unwrap(),
        InstallOutcome::Created
    );
    (dir, root)
}

const P_1G: u32 = 19;
const P_3G: u32 = 9;
const P_4G: u32 = 5;

#[test]
fn mode_needs_a_capable_and_idle_gpu() {
    let (_d, root) = installed();
    let s = SharedState::open(&root).unwrap();
    assert_eq!(s.mig_mode(1), Err(MigError::NotCapable));
    assert_eq!(s.set_mig_mode(1, true), Err(MigError::NotCapable));
    assert_eq!(s.mig_mode(0), Ok((false, false)), "starts disabled");
    assert_eq!(
        s.create_gpu_instance(0, P_1G, None),
        Err(MigError::Disabled)
    );
    // A process with a context on the GPU keeps the change pending.
    let me = s.attach().unwrap();
    s.set_active(me, 0);
    assert_eq!(s.set_mig_mode(0, true), Ok(Activation::PendingInUse));
    assert_eq!(s.mig_mode(0), Ok((false, true)));
    drop(s); // the process exits
    let s = SharedState::open(&root).unwrap();
    assert_eq!(s.set_mig_mode(0, true), Ok(Activation::Applied));
    assert_eq!(s.mig_mode(0), Ok((true, true)));
    // Disabling with a GPU instance left is refused until it is gone.
    let gi = s.create_gpu_instance(0, P_1G, None).unwrap();
    assert_eq!(s.set_mig_mode(0, false), Ok(Activation::PendingInUse));
    assert_eq!(s.mig_mode(0), Ok((true, false)));
    s.destroy_gpu_instance(0, gi.id).unwrap();
    assert_eq!(s.set_mig_mode(0, false), Ok(Activation::Applied));
    assert_eq!(s.mig_mode(0), Ok((false, false)));
}

#[test]
fn instances_are_placed_shared_and_destroyed() {
    let (_d, root) = installed();
    let a = SharedState::open(&root).unwrap();
    let b = SharedState::open(&root).unwrap();
    a.set_mig_mode(0, true).unwrap();
    // A 3g.40gb at 4, then a 1g.10gb goes to the first free slice.
    let g3 = a
        .create_gpu_instance(0, P_3G, Some(Placement { start: 4, size: 4 }))
        .unwrap();
    assert_eq!((g3.id, g3.profile.name), (1, "3g.40gb"));
    let g1 = b.create_gpu_instance(0, P_1G, None).unwrap();
    assert_eq!(g1.placement, Placement { start: 0, size: 1 });
    assert_eq!(g1.id, 7);
    // Overlaps are refused, and so is the 4g.40gb that needs 0..4.
    assert_eq!(
        a.create_gpu_instance(0, P_1G, Some(Placement { start: 5, size: 1 })),
        Err(MigError::NoRoom)
    );
    assert_eq!(a.create_gpu_instance(0, P_4G, None), Err(MigError::NoRoom));
    assert_eq!(a.gpu_instance_room(0, P_4G), Ok(0));
    assert_eq!(a.gpu_instance_room(0, P_1G), Ok(3), "slices 1, 2, 3");
    assert_eq!(
        a.create_gpu_instance(0, P_3G, Some(Placement { start: 2, size: 4 })),
        Err(MigError::BadPlacement)
    );
    // Compute instances: seen by the other mapping; the GI is in use.
    let c = b.create_compute_instance(0, g3.id, 2, None).unwrap();
    assert_eq!((c.id, c.profile.slices), (0, 3));
    assert_eq!(a.compute_instance_room(0, g3.id, 0), Ok(0), "3c fills it");
    assert_eq!(
        a.create_compute_instance(0, g3.id, 0, None),
        Err(MigError::NoRoom)
    );
    let c1 = a.create_compute_instance(0, g1.id, 0, None).unwrap();
    // The driver's capability files: GI 1 of GPU minor 0 is minor 3 + 9.
    let caps = root
        .root
        .join("proc/driver/nvidia/capabilities/gpu0/mig/gi1");
    let access = std::fs::read_to_string(caps.join("access")).unwrap();
    assert!(access.starts_with("DeviceFileMinor: 12\n"), "{access}");
    let ci = std::fs::read_to_string(caps.join("ci0/access")).unwrap();
    assert!(ci.starts_with("DeviceFileMinor: 13\n"), "{ci}");
    assert!(root.root.join("dev/nvidia-caps/nvidia-cap13").exists());
    let devs: Vec<(u32, u32)> = b.mig_devices(0).iter().map(|(g, c)| (g.id, c.id)).collect();
    assert_eq!(devs, [(1, 0), (7, 0)]);
    assert_eq!(a.destroy_gpu_instance(0, g3.id), Err(MigError::InUse));
    b.destroy_compute_instance(0, g3.id, c.id).unwrap();
    assert_eq!(
        b.destroy_compute_instance(0, g3.id, c.id),
        Err(MigError::NotFound)
    );
    assert!(!caps.join("ci0").exists(), "withdrawn with the CI");
    a.destroy_gpu_instance(0, g3.id).unwrap();
    assert!(!caps.exists() && !root.root.join("dev/nvidia-caps/nvidia-cap12").exists());
    assert_eq!(b.gpu_instances(0).len(), 1);
    assert_eq!(
        b.gpu_instance_room(0, P_4G),
        Ok(0),
        "the 1g at 0 is in the way"
    );
    a.destroy_compute_instance(0, g1.id, c1.id).unwrap();
    a.destroy_gpu_instance(0, g1.id).unwrap();
    assert_eq!(b.gpu_instance_room(0, P_4G), Ok(1));
    assert!(b.mig_devices(0).is_empty());
}

#[test]
fn seven_single_slices_and_their_compute_instances() {
    let (_d, root) = installed();
    let s = SharedState::open(&root).unwrap();
    s.set_mig_mode(0, true).unwrap();
    for k in 0..7 {
        let g = s.create_gpu_instance(0, P_1G, None).unwrap();
        assert_eq!(g.placement.start, k);
        s.create_compute_instance(0, g.id, 0, None).unwrap();
    }
    assert_eq!(s.create_gpu_instance(0, P_1G, None), Err(MigError::NoRoom));
    assert_eq!(s.mig_devices(0).len(), 7);
    // A 7g.80gb's seven 1c compute instances take ids 0..7.
    let (_d2, root2) = installed();
    let t = SharedState::open(&root2).unwrap();
    t.set_mig_mode(0, true).unwrap();
    let g7 = t.create_gpu_instance(0, 0, None).unwrap();
    for k in 0..7 {
        assert_eq!(t.create_compute_instance(0, g7.id, 0, None).unwrap().id, k);
    }
    assert_eq!(
        t.create_compute_instance(0, g7.id, 0, None),
        Err(MigError::NoRoom)
    );
}
