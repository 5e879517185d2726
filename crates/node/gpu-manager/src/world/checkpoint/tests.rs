//! The checkpoint's format, slots, torn writes and migration.

use super::*;
use checkpoint_slots::{HEADER_LEN, MIN_SLOT, encode_slot};

fn alloc(uid: &str) -> Allocation {
    sample_share(uid, 1)
}

fn uids(cp: &Checkpoint) -> Vec<String> {
    let (_, a) = Checkpoint::new(cp.path()).load().unwrap().unwrap();
    a.into_iter().map(|a| a.pod_uid).collect()
}

fn header(path: &Path) -> String {
    let b = std::fs::read(path).unwrap();
    String::from_utf8_lossy(&b[..HEADER_LEN]).into_owned()
}

#[test]
fn round_trip_alternates_slots() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(&dir.path().join("sub"));
    assert!(cp.load().unwrap().is_none());
    let a = alloc("u");
    cp.store(&["GPU-a".into()], [&a]).unwrap();
    let (gpus, allocs) = Checkpoint::new(cp.path()).load().unwrap().unwrap();
    assert_eq!(gpus, vec!["GPU-a"]);
    assert_eq!(allocs, vec![a.clone()]);
    let (sa, sb) = (cp.slot_path(0), cp.slot_path(1));
    assert!(sa.is_file() && !sb.exists());
    assert!(header(&sa).contains("gen=00000000000000000001"));
    // The next write goes to the other slot; the first stays as it was.
    let before = std::fs::read(&sa).unwrap();
    cp.store(&["GPU-a".into()], [&a, &alloc("v")]).unwrap();
    assert_eq!(std::fs::read(&sa).unwrap(), before);
    assert!(header(&sb).contains("gen=00000000000000000002"));
    assert_eq!(uids(&cp), ["u", "v"]);
    cp.store(&["GPU-a".into()], []).unwrap();
    assert!(header(&sa).contains("gen=00000000000000000003"));
    assert!(uids(&cp).is_empty());
    // Slots are padded to a fixed size: an overwrite keeps the size.
    assert_eq!(std::fs::metadata(&sa).unwrap().len(), MIN_SLOT as u64);
    // A fresh Checkpoint (restart) continues after the newest slot.
    let cp2 = Checkpoint::new(cp.path());
    cp2.load().unwrap();
    cp2.store(&["GPU-a".into()], [&a]).unwrap();
    assert!(header(&sb).contains("gen=00000000000000000004"));
    // The payload is plain JSON after the header line.
    let text = std::fs::read_to_string(&sb).unwrap();
    let v: serde_json::Value = serde_json::from_str(text.split_once('\n').unwrap().1).unwrap();
    assert_eq!(v["allocations"][0]["pod_uid"], "u");
}

#[test]
fn torn_or_corrupt_newest_slot_falls_back_to_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(dir.path());
    cp.store(&[], [&alloc("u")]).unwrap(); // a, gen 1
    cp.store(&[], [&alloc("u"), &alloc("v")]).unwrap(); // b, gen 2
    let sb = cp.slot_path(1);
    let good = std::fs::read(&sb).unwrap();
    // Torn: only the first part of the write reached the disk.
    for cut in [0, 10, HEADER_LEN, HEADER_LEN + 20] {
        std::fs::write(&sb, &good[..cut]).unwrap();
        assert_eq!(uids(&cp), ["u"], "cut at {cut}");
    }
    // Torn the other way: the new header over old content.
    let mut mixed = good.clone();
    mixed[HEADER_LEN + 5] ^= 0x20;
    std::fs::write(&sb, &mixed).unwrap();
    assert_eq!(uids(&cp), ["u"]);
    // A verified but unparsable payload is bad too.
    let junk = encode_slot(7, b"{not json", MIN_SLOT);
    std::fs::write(&sb, &junk).unwrap();
    assert_eq!(uids(&cp), ["u"]);
    // After loading, the next write overwrites the damaged slot and
    // leaves the good one alone.
    let cp2 = Checkpoint::new(dir.path());
    cp2.load().unwrap();
    let a_before = std::fs::read(cp.slot_path(0)).unwrap();
    cp2.store(&[], [&alloc("w")]).unwrap();
    assert_eq!(std::fs::read(cp.slot_path(0)).unwrap(), a_before);
    assert!(header(&sb).contains("gen=00000000000000000002"));
    assert_eq!(uids(&cp), ["w"]);
}

#[test]
fn both_slots_bad_is_invalid_and_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(dir.path());
    cp.store(&[], [&alloc("u")]).unwrap();
    cp.store(&[], [&alloc("u")]).unwrap();
    std::fs::write(cp.slot_path(0), "{").unwrap();
    std::fs::write(cp.slot_path(1), b"").unwrap();
    let e = cp.load().unwrap_err().to_string();
    assert!(
        e.contains("move it away") && e.contains(SLOT_FILES[0]) && e.contains(SLOT_FILES[1]),
        "{e}"
    );
    let aside = cp.set_aside().unwrap();
    assert_eq!(aside.len(), 2);
    assert!(
        aside
            .iter()
            .all(|p| p.is_file() && p.to_string_lossy().contains(".corrupt-"))
    );
    assert!(cp.load().unwrap().is_none());
    cp.store(&[], [&alloc("x")]).unwrap();
    assert_eq!(uids(&cp), ["x"]);
}

#[test]
fn generation_wraps() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(dir.path());
    let payload = |u: &str| encode(&[], [&alloc(u)]);
    std::fs::write(
        cp.slot_path(0),
        encode_slot(u64::MAX, &payload("old"), MIN_SLOT),
    )
    .unwrap();
    std::fs::write(cp.slot_path(1), encode_slot(0, &payload("new"), MIN_SLOT)).unwrap();
    assert_eq!(uids(&cp), ["new"]);
    std::fs::write(
        cp.slot_path(1),
        encode_slot(u64::MAX - 1, &payload("older"), MIN_SLOT),
    )
    .unwrap();
    assert_eq!(uids(&cp), ["old"]);
    // Writing continues across the wrap into the other slot.
    cp.load().unwrap();
    cp.store(&[], [&alloc("next")]).unwrap();
    assert!(header(&cp.slot_path(1)).contains("gen=00000000000000000000"));
    assert_eq!(uids(&cp), ["next"]);
    cp.store(&[], [&alloc("after")]).unwrap();
    assert!(header(&cp.slot_path(0)).contains("gen=00000000000000000001"));
    assert_eq!(uids(&cp), ["after"]);
}

#[test]
fn migrates_the_single_file_format() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(dir.path());
    let legacy = dir.path().join(CHECKPOINT_FILE);
    // As earlier versions wrote it.
    let old = serde_json::json!({"version": 1, "gpus": ["GPU-a"], "allocations": [alloc("u")]});
    std::fs::write(&legacy, serde_json::to_vec(&old).unwrap()).unwrap();
    let (gpus, allocs) = cp.load().unwrap().unwrap();
    assert_eq!(
        (gpus, allocs),
        (vec!["GPU-a".to_string()], vec![alloc("u")])
    );
    cp.store(&["GPU-a".into()], &allocs_of(&["u", "v"]))
        .unwrap();
    assert!(!legacy.exists(), "removed once the slot is durable");
    assert_eq!(uids(&cp), ["u", "v"]);
    // A leftover old file (its removal lost in a crash) loses to a slot.
    std::fs::write(&legacy, serde_json::to_vec(&old).unwrap()).unwrap();
    assert_eq!(uids(&cp), ["u", "v"]);
    // A corrupt old file with no slot: invalid, set aside.
    let dir2 = tempfile::tempdir().unwrap();
    let cp2 = Checkpoint::new(dir2.path());
    std::fs::write(
        dir2.path().join(CHECKPOINT_FILE),
        "{\"version\": 1, \"gpus\": [tru",
    )
    .unwrap();
    assert!(cp2.load().unwrap_err().to_string().contains("move it away"));
    assert_eq!(cp2.set_aside().unwrap().len(), 1);
    assert!(cp2.load().unwrap().is_none());
}

fn allocs_of(u: &[&str]) -> Vec<Allocation> {
    u.iter().map(|u| alloc(u)).collect()
}

#[test]
fn slots_grow_and_shrink() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(dir.path());
    let many: Vec<Allocation> = (0..200).map(|i| alloc(&format!("u{i}"))).collect();
    cp.store(&[], &many).unwrap();
    cp.store(&[], &many).unwrap();
    let big = std::fs::metadata(cp.slot_path(0)).unwrap().len();
    assert!(big > MIN_SLOT as u64 && big.is_power_of_two());
    assert_eq!(uids(&cp).len(), 200);
    cp.store(&[], [&alloc("x")]).unwrap();
    assert_eq!(
        std::fs::metadata(cp.slot_path(0)).unwrap().len(),
        MIN_SLOT as u64
    );
    assert_eq!(uids(&cp), ["x"]);
}

#[test]
fn a_failed_write_leaves_the_previous_slot() {
    // A directory where a slot file should be: writes to it fail, as
    // root too (the e2e test uses a read-only bind mount).
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(dir.path());
    cp.store(&[], [&alloc("u")]).unwrap(); // a
    std::fs::create_dir(cp.slot_path(1)).unwrap();
    let e = cp.store(&[], [&alloc("v")]).unwrap_err().to_string();
    assert!(e.contains(SLOT_FILES[1]), "{e}");
    assert_eq!(uids(&cp), ["u"], "slot a intact, the bad slot ignored");
    // The retry goes to the same slot, never over the good one.
    let a = std::fs::read(cp.slot_path(0)).unwrap();
    assert!(cp.store(&[], [&alloc("v")]).is_err());
    assert_eq!(std::fs::read(cp.slot_path(0)).unwrap(), a);
    std::fs::remove_dir(cp.slot_path(1)).unwrap();
    cp.store(&[], [&alloc("v")]).unwrap(); // b, created now
    assert_eq!(uids(&cp), ["v"]);
    // Overwriting a fails: b stays, the retry goes to a again.
    let b = std::fs::read(cp.slot_path(1)).unwrap();
    std::fs::remove_file(cp.slot_path(0)).unwrap();
    std::fs::create_dir(cp.slot_path(0)).unwrap();
    assert!(cp.store(&[], [&alloc("w")]).is_err());
    assert_eq!(uids(&cp), ["v"]);
    std::fs::remove_dir(cp.slot_path(0)).unwrap();
    cp.store(&[], [&alloc("w")]).unwrap();
    assert_eq!(std::fs::read(cp.slot_path(1)).unwrap(), b);
    assert_eq!(uids(&cp), ["w"]);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "no temp file"
    );
}

/// A rolled-back upgrade: the newer manager wrote one slot in a format this
/// build does not read. Neither that slot nor the older one (possibly stale)
/// is used, and the error names both formats.
#[test]
fn another_format_in_either_slot_is_a_version_error_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Checkpoint::new(dir.path());
    cp.store(&["GPU-a".into()], [&alloc("old")]).unwrap();
    cp.store(&["GPU-a".into()], [&alloc("old"), &alloc("new")])
        .unwrap();
    // Slot b (the newest) rewritten with payload version 2, checksum valid.
    let payload = String::from_utf8(encode(&["GPU-a".into()], [&alloc("new")]))
        .unwrap()
        .replacen("\"version\":1", "\"version\":2", 1);
    std::fs::write(cp.slot_path(1), encode_slot(3, payload.as_bytes(), 4096)).unwrap();
    let e = Checkpoint::new(dir.path()).load().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, CheckpointError::Version { .. }), "{msg}");
    assert!(
        msg.contains("gpu-manager.json.b: payload version 2") && msg.contains("payload version 1"),
        "{msg}"
    );
    // A future slot layout is named by its header.
    let mut future = std::fs::read(cp.slot_path(0)).unwrap();
    future[..19].copy_from_slice(b"vcuda-checkpoint v3");
    std::fs::write(cp.slot_path(0), future).unwrap();
    let msg = Checkpoint::new(dir.path()).load().unwrap_err().to_string();
    assert!(
        msg.contains("slot layout \"vcuda-checkpoint v3\"")
            && msg.contains("reads slot layout \"vcuda-checkpoint v2\""),
        "{msg}"
    );
}
