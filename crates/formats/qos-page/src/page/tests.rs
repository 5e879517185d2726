use super::*;
use crate::Tier;
use std::os::fd::AsFd;

#[test]
fn a_latency_slot_holds_batch_until_idle_or_its_deadline() {
    let (agent, file) = QosPage::create_sealed(0).unwrap();
    // Another process maps the descriptor it was handed.
    let tenant = QosPage::from_fd(file.as_fd()).unwrap();
    assert_eq!(tenant.latency_live(), 0);
    let h = agent.claim(4242).unwrap();
    assert_eq!(tenant.latency_live(), 1);
    assert_eq!(tenant.held_until(100), None, "registered but idle");
    tenant.busy(h, 1_000);
    assert_ne!(agent.active_word().load(Acquire), 0);
    assert_eq!(agent.held_until(500), Some(1_000));
    tenant.idle(h);
    assert_eq!(agent.held_until(500), None);
    // A deadline that passed no longer counts, and its bit is cleared.
    tenant.busy(h, 1_000);
    assert_eq!(agent.held_until(1_000), None);
    assert_eq!(agent.active_word().load(Acquire), 0);
    // The agent frees a dead process's slot, busy or not.
    tenant.busy(h, 5_000);
    agent.release(h);
    assert_eq!(agent.held_until(0), None);
    assert_eq!(agent.latency_live(), 0);
    agent.add_held(7);
    assert_eq!(tenant.held(), (7, 1));
}

#[test]
fn slots_run_out_after_sixty_four() {
    let (p, _f) = QosPage::create_sealed(1).unwrap();
    let hs: Vec<Holder> = (1..=64).map(|pid| p.claim(pid).unwrap()).collect();
    assert!(p.claim(65).is_none());
    p.release(hs[10]);
    assert_eq!(p.claim(66), Some(Holder { slot: 10 }));
}

#[test]
fn a_plain_file_or_another_layout_is_refused() {
    let dir = std::env::temp_dir().join(format!("qos-page-test-{}", std::process::id()));
    std::fs::write(&dir, [0u8; PAGE_SIZE]).unwrap();
    let f = File::open(&dir).unwrap();
    let _ = std::fs::remove_file(&dir);
    let e = QosPage::from_fd(f.as_fd()).err().unwrap().to_string();
    assert!(e.contains("not sealed"), "{e}");
    assert!(matches!(Tier::parse("gold"), Err(QosError::Tier(_))));
    assert_eq!(Tier::parse("latency").unwrap(), Tier::Latency);
    assert_eq!(Tier::Batch.name(), "batch");
}
