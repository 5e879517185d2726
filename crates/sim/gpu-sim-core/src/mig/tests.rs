//! Facts from NVIDIA's MIG user guide ("Supported MIG Profiles", the
//! `-lgip`/`-lgipp` listings) checked against the table.

use super::*;

fn h100() -> &'static MigModel {
    model("h100-80gb").unwrap()
}

/// Places `count` instances of `index` one after another; the mask used.
fn place(m: &MigModel, mut used: u32, index: u32, count: u32) -> Result<u32, u32> {
    let p = m.by_index(index).unwrap();
    for k in 0..count {
        let pl = p.first_free(used).ok_or(k)?;
        used |= pl.mask();
    }
    Ok(used)
}

#[test]
fn profile_indices_are_nvmls() {
    // nvml.h: _1_SLICE 0, _2_SLICE 1, _3_SLICE 2, _4_SLICE 3, _7_SLICE 4,
    // _1_SLICE_REV1 7, _1_SLICE_REV2 9.
    let m = h100();
    let name = |i| m.by_index(i).unwrap().name;
    assert_eq!(name(0), "1g.10gb");
    assert_eq!(name(1), "2g.20gb");
    assert_eq!(name(2), "3g.40gb");
    assert_eq!(name(3), "4g.40gb");
    assert_eq!(name(4), "7g.80gb");
    assert_eq!(name(7), "1g.10gb+me");
    assert_eq!(name(9), "1g.20gb");
    assert!(m.by_index(5).is_none(), "no 8-slice profile on H100");
    // The driver's ids, as nvidia-smi mig -lgip prints them.
    let ids: Vec<u32> = [0, 7, 9, 1, 2, 3, 4]
        .iter()
        .map(|&i| m.by_index(i).unwrap().id)
        .collect();
    assert_eq!(ids, [19, 20, 15, 14, 9, 5, 0]);
    assert_eq!(m.by_id(9).unwrap().name, "3g.40gb");
}

#[test]
fn h100_facts_from_the_guide() {
    let m = h100();
    assert_eq!(place(m, 0, GI_PROFILE_1_SLICE, 7), Ok(0x7f), "7 x 1g.10gb");
    assert_eq!(place(m, 0x7f, GI_PROFILE_1_SLICE, 1), Err(0), "no 8th");
    let g3 = m.by_index(GI_PROFILE_3_SLICE).unwrap();
    let starts: Vec<u32> = g3.placements().map(|p| p.start).collect();
    assert_eq!(starts, [0, 4], "3g.40gb at 0 and 4");
    assert_eq!(g3.placement_size, 4);
    // A 4g.40gb and a 3g.40gb together fill the GPU.
    let used = place(m, 0, GI_PROFILE_4_SLICE, 1).unwrap();
    assert_eq!(g3.first_free(used), Some(Placement { start: 4, size: 4 }));
    assert_eq!(g3.remaining(used, 0), 1);
    // Overlap refused: a 1g at slice 5 blocks the 3g at 4.
    let one = Placement { start: 5, size: 1 };
    assert_eq!(g3.remaining(used | one.mask(), 0), 0);
    assert_eq!(g3.first_free(used | one.mask()), None);
    // 7g takes the whole GPU.
    let g7 = m.by_index(GI_PROFILE_7_SLICE).unwrap();
    assert_eq!(
        g7.placements().collect::<Vec<_>>(),
        [Placement { start: 0, size: 8 }]
    );
    assert_eq!(g7.sms, 132);
    assert_eq!(g7.remaining(one.mask(), 0), 0);
    // Only one +me instance, whatever room is left.
    let me = m.by_index(GI_PROFILE_1_SLICE_REV1).unwrap();
    assert_eq!(me.remaining(0, 0), 1);
    assert_eq!(me.remaining(0, 1), 0);
    assert_eq!((me.ofas, me.jpegs, me.decoders), (1, 1, 1));
}

#[test]
fn a100_facts_from_the_guide() {
    let m = model("a100-40gb").unwrap();
    let g = |i| m.by_index(i).unwrap();
    assert_eq!(g(GI_PROFILE_1_SLICE).name, "1g.5gb");
    assert_eq!(g(GI_PROFILE_1_SLICE).decoders, 0, "1g.5gb: 0 NVDECs");
    assert_eq!(
        g(GI_PROFILE_1_SLICE_REV2).starts,
        [0, 2, 4, 6],
        "1g.10gb {{0,2,4,6}}:2"
    );
    assert_eq!(g(GI_PROFILE_1_SLICE_REV2).instances, 4);
    assert_eq!(
        g(GI_PROFILE_2_SLICE).starts,
        [0, 2, 4],
        "2g.10gb {{0,2,4}}:2"
    );
    assert_eq!(g(GI_PROFILE_7_SLICE).sms, 98);
    assert_eq!(
        (g(GI_PROFILE_7_SLICE).decoders, g(GI_PROFILE_7_SLICE).ofas),
        (5, 1)
    );
    // 3 x 2g.10gb + 1 x 1g.5gb: a documented valid combination.
    let used = place(m, 0, GI_PROFILE_2_SLICE, 3).unwrap();
    assert_eq!(place(m, used, GI_PROFILE_1_SLICE, 1), Ok(0x7f));
    assert_eq!(m.max_instances(), 7);
    assert_eq!(
        model("a100-80gb").unwrap().by_index(4).unwrap().name,
        "7g.80gb"
    );
    assert_eq!(
        model("h200-141gb").unwrap().by_index(0).unwrap().name,
        "1g.18gb"
    );
}

#[test]
fn compute_instance_profiles() {
    let m = h100();
    let cis = |i: u32| -> Vec<(u32, u32)> {
        m.by_index(i)
            .unwrap()
            .ci_profiles()
            .map(|c| (c.slices, c.instances()))
            .collect()
    };
    assert_eq!(
        cis(GI_PROFILE_7_SLICE),
        [(1, 7), (2, 3), (3, 2), (4, 1), (7, 1)]
    );
    assert_eq!(cis(GI_PROFILE_4_SLICE), [(1, 4), (2, 2), (4, 1)]);
    assert_eq!(cis(GI_PROFILE_3_SLICE), [(1, 3), (2, 1), (3, 1)]);
    assert_eq!(cis(GI_PROFILE_1_SLICE), [(1, 1)]);
    let g3 = m.by_index(GI_PROFILE_3_SLICE).unwrap();
    let c1 = g3.ci_profile(0).unwrap();
    assert_eq!(c1.device_name(), "1c.3g.40gb");
    assert_eq!(c1.sms(), 20);
    assert_eq!(g3.ci_profile(2).unwrap().device_name(), "3g.40gb");
    assert!(g3.ci_profile(3).is_none(), "no 4c in a 3g");
}

#[test]
fn gi_ids_follow_placements() {
    for m in MODELS {
        for p in m.profiles {
            for pl in p.placements() {
                let id = gi_id_of(pl);
                assert!((id as usize) < MAX_GI_IDS);
                assert_eq!(placement_of_gi_id(id), Some(pl), "{} {pl:?}", p.name);
            }
        }
    }
    assert_eq!(placement_of_gi_id(15), None);
}

/// The profile name go-nvlib (NVIDIA's device plugin and DRA driver) derives
/// from `memorySizeMB` and the GPU's total memory (pkg/nvlib/device,
/// getMigMemorySizeGB: the memory fraction rounded up to eighths, times the
/// total in whole GiB rounded up) must be the table's own name.
#[test]
fn names_agree_with_go_nvlibs_rule() {
    let totals = [
        ("a100-40gb", 40960u64),
        ("a100-80gb", 81920),
        ("h100-80gb", 81559),
        ("h200-141gb", 143771),
    ];
    for (key, total_mib) in totals {
        for p in model(key).unwrap().profiles {
            let frac = p.memory_mib as f64 / total_mib as f64;
            let frac = (frac * 8.0).ceil() / 8.0;
            let total_gb = total_mib.div_ceil(1024) as f64;
            let gb = (frac * total_gb).round() as u64;
            let base = p.name.trim_end_matches("+me");
            assert_eq!(base, format!("{}g.{gb}gb", p.slices), "{key}");
        }
    }
}

#[test]
fn mig_uuids_are_stable_and_distinct() {
    let u = mig_uuid("GPU-1", 1, 0);
    assert_eq!(u, mig_uuid("GPU-1", 1, 0));
    assert_ne!(u, mig_uuid("GPU-1", 2, 0));
    assert_ne!(u, mig_uuid("GPU-2", 1, 0));
    assert_eq!(u.len(), 40, "{u}");
    let parts: Vec<usize> = u[4..].split('-').map(str::len).collect();
    assert_eq!(parts, [8, 4, 4, 4, 12], "{u}");
}
