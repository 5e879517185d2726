use super::*;
use crate::{Flag, FlagView, Tier, make_flag};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;

/// What a tenant holding `f` may try: a writable shared mapping, a write,
/// a resize, removing or adding seals. All refused.
fn cannot_write(f: &File) {
    // SAFETY: a mapping attempt on our own descriptor; unmapped if it
    // ever succeeds (it must not).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_eq!(p, libc::MAP_FAILED, "a writable shared mapping");
    assert!(f.write_at(&[1], 24).is_err(), "write()");
    assert!(f.set_len(0).is_err(), "ftruncate");
    assert!(add_seals(f, libc::F_SEAL_WRITE).is_err(), "more seals");
}

#[test]
fn the_gpu_page_is_the_agents_alone() {
    let (agent, file) = QosPage::create_sealed(0).unwrap();
    // A tenant maps the descriptor it was handed, read-only.
    let tenant = QosPage::from_fd(file.as_fd()).unwrap();
    assert_eq!((tenant.latency_live(), tenant.generation()), (0, 0));
    let h = agent.claim(4242).unwrap();
    assert_eq!((tenant.latency_live(), tenant.generation()), (1, 1));
    agent.release(h);
    assert_eq!((tenant.latency_live(), tenant.generation()), (0, 2));
    agent.release(h);
    assert_eq!(tenant.generation(), 2, "a slot freed twice counts once");
    cannot_write(&file);
}

#[test]
fn a_flag_is_written_by_its_latency_process_alone() {
    let file = make_flag(0, 3).unwrap();
    assert!(!Flag::is_sealed(&file), "not before its process sealed it");
    let e = FlagView::open(file.as_fd()).err().unwrap().to_string();
    assert!(e.contains("not sealed"), "{e}");
    let latency = Flag::adopt(file.as_fd()).unwrap();
    assert!(Flag::is_sealed(&file));
    let batch = FlagView::open(file.as_fd()).unwrap();
    assert_eq!(batch.deadline(), 0);
    latency.busy(1_000);
    assert_eq!(batch.deadline(), 1_000);
    latency.idle();
    assert_eq!(batch.deadline(), 0);
    // What a batch process holding the descriptor may try: refused.
    cannot_write(&file);
    assert!(Flag::adopt(file.as_fd()).is_err(), "a second writer");
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
    // A flag is no GPU page, nor the other way round.
    let flag = make_flag(0, 0).unwrap();
    let _ = Flag::adopt(flag.as_fd()).unwrap();
    let e = QosPage::from_fd(flag.as_fd()).err().unwrap().to_string();
    assert!(e.contains("version"), "{e}");
    let (_, page) = QosPage::create_sealed(2).unwrap();
    assert!(FlagView::open(page.as_fd()).is_err());
    assert!(matches!(Tier::parse("gold"), Err(QosError::Tier(_))));
    assert_eq!(Tier::parse("latency").unwrap(), Tier::Latency);
    assert_eq!(Tier::Batch.name(), "batch");
}
