use super::*;
use std::fs::File;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

#[test]
fn peek_reads_quota_and_use_without_a_slot() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(super::LEDGER_FILE);
    let (l, _f) = super::Ledger::create(&path, 1000).unwrap();
    let slot = l.claim_slot(42, None).unwrap();
    l.try_reserve(slot, 300).unwrap();
    assert_eq!(super::Ledger::peek(&path).unwrap(), (1000, 300));
    std::fs::write(dir.path().join("short"), b"x").unwrap();
    assert!(matches!(
        super::Ledger::peek(&dir.path().join("short")),
        Err(super::LedgerError::Size { len: 1 })
    ));
}

#[test]
fn local_pids_are_kept_per_slot_and_cleared_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(super::LEDGER_FILE);
    let (l, _f) = super::Ledger::create(&path, 1000).unwrap();
    let a = l.claim_slot(4711, None).unwrap();
    let b = l.claim_slot(4712, None).unwrap();
    assert_eq!(l.slot(a).unwrap().local_pid, 0, "not written yet");
    l.set_local_pid(a, 1);
    l.set_local_pid(b, 27);
    assert_eq!(super::Ledger::peek_local_pids(&path).unwrap(), vec![1, 27]);
    l.clear_slot(a);
    assert_eq!(super::Ledger::peek_local_pids(&path).unwrap(), vec![27]);
    // A slot claimed again starts without the old process's local PID.
    let c = l.claim_slot(4713, None).unwrap();
    assert_eq!(c, a);
    assert_eq!(l.slot(c).unwrap().local_pid, 0);
    // The field sits in bytes the version-1 layout always kept zero.
    let bytes = std::fs::read(&path).unwrap();
    let off = HEADER_SIZE + b * SLOT_SIZE + 24;
    assert_eq!(
        i32::from_ne_bytes(bytes[off..off + 4].try_into().unwrap()),
        27
    );
}

fn new(quota: u64) -> (tempfile::TempDir, Ledger, File) {
    let dir = tempfile::tempdir().unwrap();
    let (l, f) = Ledger::create(&dir.path().join(LEDGER_FILE), quota).unwrap();
    (dir, l, f)
}

#[test]
fn layout_constants() {
    assert_eq!(FILE_SIZE, 69632);
    assert_eq!(COMPUTE_WORDS, 384);
}

#[test]
fn reserve_until_quota_then_refuse() {
    let (_d, l, _f) = new(1000);
    let s = l.claim_slot(42, None).unwrap();
    l.try_reserve(s, 600).unwrap();
    l.try_reserve(s, 400).unwrap();
    assert_eq!(
        l.try_reserve(s, 1),
        Err(OverQuota {
            requested: 1,
            available: 0,
            quota: 1000
        })
    );
    l.release(s, 400);
    assert_eq!(l.used(), 600);
    assert_eq!(l.slot(s).unwrap().used, 600);
    assert_eq!(l.peak(), 1000);
    assert!(l.try_reserve(s, u64::MAX).is_err(), "overflow is refused");
}

#[test]
fn release_saturates() {
    let (_d, l, _f) = new(1000);
    let s = l.claim_slot(1, None).unwrap();
    l.try_reserve(s, 10).unwrap();
    l.release(s, 50);
    assert_eq!((l.used(), l.slot(s).unwrap().used), (0, 0));
}

#[test]
fn clear_slot_gives_bytes_back_and_frees_it() {
    let (_d, l, _f) = new(1000);
    let a = l.claim_slot(10, None).unwrap();
    let b = l.claim_slot(11, None).unwrap();
    assert_ne!(a, b);
    l.try_reserve(a, 300).unwrap();
    l.try_reserve(b, 200).unwrap();
    assert_eq!(l.clear_slot(a), 300);
    assert_eq!(l.used(), 200);
    assert!(l.slot(a).is_none());
    assert_eq!(l.slots().count(), 1);
    assert_eq!(l.claim_slot(12, None), Some(a), "freed slot reused");
}

#[test]
fn claim_prefers_own_slot() {
    let (_d, l, _f) = new(1000);
    let a = l.claim_slot(10, None).unwrap();
    l.try_reserve(a, 5).unwrap();
    assert_eq!(l.claim_slot(10, Some(a)), Some(a));
    assert_eq!(l.slot(a).unwrap().used, 5);
    let other = l.claim_slot(11, Some(a)).unwrap();
    assert_ne!(other, a, "a slot held by another pid is not handed over");
}

#[test]
fn reconcile_moves_total() {
    let (_d, l, _f) = new(1000);
    let a = l.claim_slot(10, None).unwrap();
    l.try_reserve(a, 100).unwrap();
    l.reconcile(a, 250);
    assert_eq!((l.used(), l.slot(a).unwrap().used), (250, 250));
    l.reconcile(a, 50);
    assert_eq!((l.used(), l.slot(a).unwrap().used), (50, 50));
}

#[test]
fn reclaim_dead_and_reset() {
    let (_d, l, _f) = new(1000);
    let a = l.claim_slot(10, None).unwrap();
    let b = l.claim_slot(11, None).unwrap();
    l.try_reserve(a, 1).unwrap();
    l.try_reserve(b, 2).unwrap();
    assert_eq!(l.reclaim_dead(|pid| pid == 11), vec![(10, 1)]);
    assert_eq!(l.used(), 2);
    let g = l.generation();
    l.reset();
    assert_eq!((l.used(), l.slots().count(), l.generation()), (0, 0, g + 1));
}

#[test]
fn reopen_keeps_state_and_updates_quota() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LEDGER_FILE);
    let (l, _f) = Ledger::create(&path, 1000).unwrap();
    let s = l.claim_slot(7, None).unwrap();
    l.try_reserve(s, 123).unwrap();
    drop(l);
    let (l2, _f2) = Ledger::create(&path, 2000).unwrap();
    assert_eq!((l2.used(), l2.quota()), (123, 2000));
    let (l3, f3) = Ledger::open(&path).unwrap();
    assert_eq!(l3.slot(s).unwrap().pid, 7);
    let dup = dup_cloexec(f3.as_fd()).unwrap();
    let l4 = Ledger::from_fd(dup.as_fd()).unwrap();
    drop(dup);
    l4.try_reserve(s, 1).unwrap();
    assert_eq!(l3.used(), 124, "mappings share the file");
}

#[test]
fn rejects_foreign_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x");
    std::fs::write(&p, vec![0u8; FILE_SIZE]).unwrap();
    assert!(matches!(Ledger::open(&p), Err(LedgerError::Magic)));
    std::fs::write(&p, b"short").unwrap();
    assert!(matches!(
        Ledger::open(&p),
        Err(LedgerError::Size { len: 5 })
    ));
    let e = Ledger::open(&dir.path().join("missing")).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    // A later layout, of another size too, is named by its version, by the
    // writable mapping and the read-only peek alike.
    let mut later = MAGIC.to_vec();
    later.extend_from_slice(&2u32.to_ne_bytes());
    later.resize(FILE_SIZE * 2, 0);
    std::fs::write(&p, &later).unwrap();
    let e = Ledger::open(&p).unwrap_err();
    assert!(matches!(e, LedgerError::Version { found: 2 }), "{e}");
    assert!(
        e.to_string().contains("version 2, this build reads 1"),
        "{e}"
    );
    assert!(matches!(
        Ledger::peek(&p),
        Err(LedgerError::Version { found: 2 })
    ));
}

#[test]
fn counters_start_at_zero_are_shared_and_survive_reset() {
    let (d, l, f) = new(1000);
    assert_eq!((l.throttled_ns(), l.refused_allocations()), (0, 0));
    let l2 = Ledger::from_fd(f.as_fd()).unwrap();
    l.add_throttled_ns(1_500);
    l2.add_throttled_ns(500);
    l2.count_refused_allocation();
    l.count_refused_allocation();
    assert_eq!(l.qos_held_ns(), 0);
    l2.add_qos_held_ns(700);
    assert_eq!((l.throttled_ns(), l.refused_allocations()), (2_000, 2));
    l.reset();
    assert_eq!((l2.throttled_ns(), l2.refused_allocations()), (2_000, 2));
    assert_eq!(l.qos_held_ns(), 700);
    // They touch nothing else of the header or the compute area.
    assert_eq!((l.quota(), l.used(), l.peak()), (1000, 0, 0));
    assert!(
        l.compute_words()
            .iter()
            .all(|w| w.load(Ordering::Relaxed) == 0)
    );
    let raw = std::fs::read(d.path().join(LEDGER_FILE)).unwrap();
    let at = |o: usize| u64::from_le_bytes(raw[o..o + 8].try_into().unwrap());
    assert_eq!(
        (
            at(THROTTLED_NS_OFFSET),
            at(REFUSED_ALLOCATIONS_OFFSET),
            at(QOS_HELD_NS_OFFSET)
        ),
        (2_000, 2, 700)
    );
    assert_eq!(at(QOS_HOLDS_OFFSET), 1, "one hold counted");
    let reserved = raw[72..QOS_HELD_NS_OFFSET]
        .iter()
        .chain(&raw[96..COMPUTE_OFFSET]);
    assert!(reserved.copied().all(|b| b == 0), "reserved");
    assert_eq!(l.compute_unattributed(), 0);
    l2.set_compute_unattributed(1);
    assert_eq!(l.compute_unattributed(), 1, "shared");
}

#[test]
fn a_ledger_from_before_the_counters_opens_with_them_at_zero() {
    // What an earlier build wrote: the same version, the counters'
    // bytes never touched.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LEDGER_FILE);
    let mut raw = vec![0u8; FILE_SIZE];
    raw[..8].copy_from_slice(&MAGIC);
    raw[8..12].copy_from_slice(&1u32.to_le_bytes());
    raw[12..16].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
    raw[16..20].copy_from_slice(&(SLOTS as u32).to_le_bytes());
    raw[20..24].copy_from_slice(&(SLOT_SIZE as u32).to_le_bytes());
    raw[24..32].copy_from_slice(&777u64.to_le_bytes());
    std::fs::write(&path, &raw).unwrap();
    let (l, _f) = Ledger::create(&path, 1000).unwrap();
    assert_eq!(VERSION, 1, "the counters did not change the layout version");
    assert_eq!((l.throttled_ns(), l.refused_allocations()), (0, 0));
    assert_eq!(l.qos_held_ns(), 0);
    l.count_refused_allocation();
    assert_eq!(l.refused_allocations(), 1);
}

#[test]
fn compute_area_is_shared_and_separate() {
    let (_d, l, f) = new(1000);
    let l2 = Ledger::from_fd(f.as_fd()).unwrap();
    l.compute_words()[0].store(99, Ordering::Relaxed);
    assert_eq!(l2.compute_words()[0].load(Ordering::Relaxed), 99);
    assert_eq!(l2.used(), 0);
    l.compute_words()[COMPUTE_WORDS - 1].store(1, Ordering::Relaxed);
    assert!(
        l.slot(0).is_none(),
        "last compute word does not touch slot 0"
    );
}

#[test]
fn concurrent_reservations_never_overshoot() {
    let (_d, l, _f) = new(10_000);
    let l = Arc::new(l);
    let slots: Vec<usize> = (0..8)
        .map(|i| l.claim_slot(100 + i, None).unwrap())
        .collect();
    let threads: Vec<_> = slots
        .into_iter()
        .map(|s| {
            let l = Arc::clone(&l);
            std::thread::spawn(move || {
                let mut held = 0u64;
                for i in 0..20_000u64 {
                    let n = 1 + (i * 7919 + s as u64 * 31) % 97;
                    if l.try_reserve(s, n).is_ok() {
                        held += n;
                        assert!(l.used() <= 10_000);
                    }
                    if i % 3 == 0 && held > 0 {
                        let r = held.min(50);
                        l.release(s, r);
                        held -= r;
                    }
                }
                held
            })
        })
        .collect();
    let held: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(l.used(), held);
    assert!(l.peak() <= 10_000);
    assert_eq!(l.slots().map(|s| s.used).sum::<u64>(), held);
}
