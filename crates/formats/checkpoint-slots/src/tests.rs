//! The engine alone, with a record of its own; the manager's and the DRA
//! driver's tests cover it with theirs (torn slots, wrap-around,
//! migration, other formats).

use super::*;

const LAYOUT: Layout = Layout {
    slots: ["rec.a", "rec.b"],
    legacy: "rec",
    version: 1,
    mirror: false,
};

fn record(items: &[&str]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"version": 1, "items": items})).unwrap()
}

fn items(bytes: &[u8]) -> Result<Vec<String>, serde_json::Error> {
    let v: serde_json::Value = serde_json::from_slice(bytes)?;
    serde_json::from_value(v["items"].clone())
}

fn header(path: &Path) -> String {
    let b = std::fs::read(path).unwrap();
    String::from_utf8_lossy(&b[..HEADER_LEN]).into_owned()
}

#[test]
fn crc32c_check_value() {
    assert_eq!(crc32c(0, b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(crc32c(0, b"1234"), b"56789"), 0xE306_9283);
}

#[test]
fn writes_alternate_and_the_newest_parsing_slot_wins() {
    let dir = tempfile::tempdir().unwrap();
    let s = Slots::new(dir.path(), LAYOUT);
    assert!(s.load(items).unwrap().is_none());
    s.write(&record(&["a"])).unwrap();
    s.write(&record(&["a", "b"])).unwrap();
    assert!(header(&s.slot_path(0)).contains("gen=00000000000000000001"));
    assert!(header(&s.slot_path(1)).contains("gen=00000000000000000002"));
    let fresh = Slots::new(dir.path(), LAYOUT);
    assert_eq!(fresh.load(items).unwrap().unwrap(), ["a", "b"]);
    // A newest slot that verifies but that the caller cannot parse: the
    // other one is used.
    std::fs::write(
        s.slot_path(1),
        encode_slot(3, br#"{"version":1,"items":7}"#, MIN_SLOT),
    )
    .unwrap();
    assert_eq!(fresh.load(items).unwrap().unwrap(), ["a"]);
    // Neither parses: invalid, naming both.
    std::fs::write(s.slot_path(0), encode_slot(2, b"{", MIN_SLOT)).unwrap();
    let e = fresh.load(items).unwrap_err();
    assert!(
        matches!(&e, Error::Invalid { problem, .. } if problem.contains("rec.a") && problem.contains("rec.b")),
        "{e}"
    );
}

/// The single file of earlier versions: read while no slot exists, its
/// parse failure the caller's, removed by the first slot write.
#[test]
fn the_legacy_file_is_read_once_and_removed_by_the_first_write() {
    let dir = tempfile::tempdir().unwrap();
    let s = Slots::new(dir.path(), LAYOUT);
    std::fs::write(s.legacy_path(), b"not json").unwrap();
    let e = s.load(items).unwrap_err();
    assert!(matches!(e, Error::Legacy { .. }), "{e}");
    std::fs::write(s.legacy_path(), record(&["old"])).unwrap();
    assert_eq!(s.load(items).unwrap().unwrap(), ["old"]);
    s.write(&record(&["old", "new"])).unwrap();
    assert!(!s.legacy_path().exists());
    assert_eq!(s.load(items).unwrap().unwrap(), ["old", "new"]);
}

#[test]
fn a_panic_during_a_write_makes_the_next_write_rescan_the_slots() {
    let dir = tempfile::tempdir().unwrap();
    let s = Slots::new(dir.path(), LAYOUT);
    s.write(&record(&["u"])).unwrap();
    // A write that panicked with the cursor lock held, its cursor wrong.
    let c = s.clone();
    let _ = std::thread::spawn(move || {
        let mut cur = c.cursor.lock().unwrap();
        cur.target = 0; // the newest good slot
        panic!("injected: a panic in the middle of a write");
    })
    .join();
    s.write(&record(&["v"])).unwrap();
    // The good slot was not overwritten: the write went to the other one.
    assert!(header(&s.slot_path(0)).contains("gen=00000000000000000001"));
    assert!(header(&s.slot_path(1)).contains("gen=00000000000000000002"));
    assert_eq!(s.load(items).unwrap().unwrap(), ["v"]);
}

/// Another payload version in a slot: neither slot is used, the error
/// names the slot and what it holds.
#[test]
fn another_payload_version_is_another_format() {
    let dir = tempfile::tempdir().unwrap();
    let s = Slots::new(dir.path(), LAYOUT);
    s.write(&record(&["a"])).unwrap();
    std::fs::write(
        s.slot_path(1),
        encode_slot(2, br#"{"version":2,"items":[]}"#, MIN_SLOT),
    )
    .unwrap();
    let e = s.load(items).unwrap_err();
    assert!(
        matches!(&e, Error::OtherFormat { found, .. } if found == "rec.b: payload version 2"),
        "{e}"
    );
}

#[test]
fn generations_compare_with_wrap_around() {
    assert!(newer(0, u64::MAX) && !newer(u64::MAX, 0) && newer(5, 4) && !newer(4, 4));
}

const MIRRORED: Layout = Layout {
    mirror: true,
    ..LAYOUT
};

fn marker(s: &Slots) -> Option<u64> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.legacy_path()).unwrap()).unwrap();
    v[MIRROR_GENERATION].as_u64()
}

/// The DRA driver's migration (docs/contracts.md): the single file of the
/// releases before slots stays written and is read when it is newer.
#[test]
fn a_mirrored_record_keeps_the_single_file_and_reads_it_when_newer() {
    let dir = tempfile::tempdir().unwrap();
    let s = Slots::new(dir.path(), MIRRORED);
    // An earlier release's single file, no slots: read, and kept.
    std::fs::write(s.legacy_path(), record(&["old"])).unwrap();
    assert_eq!(s.load(items).unwrap().unwrap(), ["old"]);
    s.write(&record(&["old", "a"])).unwrap();
    assert!(s.legacy_path().exists(), "never removed");
    assert_eq!(marker(&s), Some(1), "the slot's generation");
    assert!(header(&s.slot_path(0)).contains("gen=00000000000000000001"));
    assert_eq!(s.load(items).unwrap().unwrap(), ["old", "a"]);
    // A release reading only the single file finds the record.
    assert_eq!(
        items(&std::fs::read(s.legacy_path()).unwrap()).unwrap(),
        ["old", "a"]
    );

    // An earlier release (a rolling update's other instance) writes the
    // single file alone, without the marker: it is the newer record.
    std::fs::write(s.legacy_path(), record(&["old", "a", "theirs"])).unwrap();
    assert_eq!(s.load(items).unwrap().unwrap(), ["old", "a", "theirs"]);
    s.write(&record(&["old", "a", "theirs", "b"])).unwrap();
    assert_eq!(marker(&s), Some(2));
    assert_eq!(s.load(items).unwrap().unwrap(), ["old", "a", "theirs", "b"]);

    // A crash between the single file and the slot: the file is newer.
    let mut v: serde_json::Value = serde_json::from_slice(&record(&["lost slot"])).unwrap();
    v[MIRROR_GENERATION] = 3.into();
    std::fs::write(s.legacy_path(), serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!(s.load(items).unwrap().unwrap(), ["lost slot"]);

    // A later release writes slots alone (the next step of the
    // migration), then is rolled back to this one: its slots are newer
    // than the file it left.
    let next = Slots::new(
        dir.path(),
        Layout {
            legacy: "gone",
            ..LAYOUT
        },
    );
    next.load(items).unwrap();
    next.write(&record(&["later release"])).unwrap();
    next.write(&record(&["later release", "c"])).unwrap();
    assert_eq!(marker(&s), Some(3), "the later release left the file");
    assert_eq!(s.load(items).unwrap().unwrap(), ["later release", "c"]);
}

/// Two processes (a rolling update's instances) writing in turn under the
/// caller's lock: each write lands after the other's, never over the
/// newest slot, whatever each one read last.
#[test]
fn mirrored_writers_take_turns_without_losing_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        Slots::new(dir.path(), MIRRORED),
        Slots::new(dir.path(), MIRRORED),
    );
    a.load(items).unwrap();
    b.load(items).unwrap();
    let mut want = Vec::new();
    for n in 0..6 {
        let w = if n % 2 == 0 { &a } else { &b };
        want.push(format!("w{n}"));
        let refs: Vec<&str> = want.iter().map(String::as_str).collect();
        // Neither writer reads in between: each write finds its slot from
        // the files, not from what its process last did.
        w.write(&record(&refs)).unwrap();
        let reader = Slots::new(dir.path(), MIRRORED);
        assert_eq!(
            reader.load(items).unwrap().unwrap(),
            want,
            "after write {n}"
        );
        // The slot files alone say the same (a release reading only them).
        let only_slots = Slots::new(
            dir.path(),
            Layout {
                legacy: "none",
                ..LAYOUT
            },
        );
        assert_eq!(only_slots.load(items).unwrap().unwrap(), want);
    }
    assert_eq!(marker(&a), Some(6));
}
