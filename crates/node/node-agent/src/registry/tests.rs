use super::*;
use prost::Message;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdStream;
use vcuda_api::vcuda::frame;
use vcuda_api::vcuda::{
    MemoryRequest, MemoryResponse, RegisterRequest, RegisterResponse, register_response::Status,
};

fn ledgers(dir: &Path, n: usize) -> Vec<(Ledger, File)> {
    (0..n)
        .map(|i| Ledger::create(&dir.join(quota_config::ledger_file(i)), 1 << 30).unwrap())
        .collect()
}

fn request(version: u32) -> RegisterRequest {
    RegisterRequest {
        protocol_version: version,
        pod_uid: "uid".into(),
        container_name: "main".into(),
        bus_id: "0000:01:00.0".into(),
        local_pid: 1,
        program: "test".into(),
        previous_slot: None,
        previous_slots: Vec::new(),
        qos_pages: true,
        qos_flags: true,
    }
}

/// Registers over a blocking socket (the interposer's side).
fn register(dir: &Path, req: RegisterRequest) -> (StdStream, RegisterResponse, Vec<OwnedFd>) {
    let mut s = StdStream::connect(dir.join(quota_config::SOCKET_FILE)).unwrap();
    frame::write(&mut s, &req).unwrap();
    let (body, fds) =
        container_ledger::fdpass::recv_frame_fds(s.as_fd(), vcuda_api::vcuda::frame::MAX_FRAME)
            .unwrap();
    (s, RegisterResponse::decode(body.as_slice()).unwrap(), fds)
}

fn inode(fd: &impl AsRawFd) -> u64 {
    // SAFETY: `libc::stat` is plain integers, for which all-zero is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a live descriptor, filling our local `st`.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    st.st_ino
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_gpu_container_gets_every_ledger_in_record_order() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_path_buf();
    let ls = ledgers(&dir, 3);
    let inodes: Vec<u64> = ls.iter().map(|(_, f)| inode(f)).collect();
    let reg = Registry::default();
    reg.serve_gpus("c", &dir, "uid", "main", ls).unwrap();

    let dir2 = dir.clone();
    let (s, resp, fds) = blocking(move || register(&dir2, request(2))).await;
    assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
    assert_eq!(resp.ledger_slots.len(), 3);
    assert_eq!(resp.ledger_slot, Some(resp.ledger_slots[0]));
    let got: Vec<u64> = fds.iter().map(inode).collect();
    assert_eq!(got, inodes, "descriptors in record order");
    let pid = std::process::id() as i32;
    assert_eq!(reg.pids("c"), vec![pid]);
    for (i, fd) in fds.iter().enumerate() {
        let l = Ledger::from_fd(fd.as_fd()).unwrap();
        let slot = resp.ledger_slots[i] as usize;
        assert_eq!(l.slot(slot).unwrap().pid, pid, "ledger {i}");
    }

    // Closing the connection clears the process's slot in every ledger.
    let ledgers: Vec<Ledger> = fds
        .iter()
        .map(|f| Ledger::from_fd(f.as_fd()).unwrap())
        .collect();
    drop(s);
    for _ in 0..200 {
        if reg.pids("c").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(reg.pids("c").is_empty());
    for (i, l) in ledgers.iter().enumerate() {
        let slot = resp.ledger_slots[i] as usize;
        assert!(l.slot(slot).is_none_or(|s| s.pid == 0), "ledger {i}");
    }
    reg.stop("c");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_gpu_client_is_refused_for_a_multi_gpu_container() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_path_buf();
    let reg = Registry::default();
    reg.serve_gpus("c", &dir, "uid", "main", ledgers(&dir, 2))
        .unwrap();
    let dir2 = dir.clone();
    let (_s, resp, fds) = blocking(move || register(&dir2, request(1))).await;
    assert_eq!(resp.status, Status::Rejected as i32);
    assert!(
        resp.message
            .contains("this container's share spans 2 GPUs; this interposer enforces one"),
        "{}",
        resp.message
    );
    assert!(fds.is_empty() && resp.ledger_slot.is_none());
    assert!(reg.pids("c").is_empty());
    let dir2 = dir.clone();
    let (_s, resp, _) = blocking(move || register(&dir2, request(3))).await;
    assert_eq!(resp.status, Status::Rejected as i32);
    assert!(
        resp.message.contains("protocol version 3"),
        "{}",
        resp.message
    );
    reg.stop("c");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_gpu_container_serves_both_versions() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_path_buf();
    let reg = Registry::default();
    let mut ls = ledgers(&dir, 1);
    let ino = inode(&ls[0].1);
    reg.serve("c", &dir, "uid", "main", ls.pop()).unwrap();
    for version in [1, 2] {
        let dir2 = dir.clone();
        let (_s, resp, fds) = blocking(move || register(&dir2, request(version))).await;
        assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
        assert!(resp.ledger_slot.is_some());
        assert_eq!(fds.len(), 1);
        assert_eq!(inode(&fds[0]), ino);
        // Version 1's reply is what it always was.
        assert_eq!(resp.ledger_slots.len(), if version == 1 { 0 } else { 1 });
    }
    reg.stop("c");
}

/// Two registries on one vm directory, as an old and a new DRA driver
/// instance during a rolling update: the new one binds the socket over
/// the old one's; the old one stopping leaves it, and processes still
/// register (with the new one). Found on a real 1.36 node: shares lost
/// their socket after the old driver pod went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_leaves_a_socket_another_registry_bound_since() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_path_buf();
    let (old, new) = (Registry::default(), Registry::default());
    old.serve_gpus("c", &dir, "uid", "main", ledgers(&dir, 1))
        .unwrap();
    new.serve_gpus("c", &dir, "uid", "main", ledgers(&dir, 1))
        .unwrap();
    old.stop("c");
    let sock = dir.join(quota_config::SOCKET_FILE);
    assert!(sock.exists(), "the new registry's socket was removed");
    let dir2 = dir.clone();
    let (_s, resp, _fds) = blocking(move || register(&dir2, request(2))).await;
    assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
    assert_eq!(new.pids("c").len(), 1);
    // Its own socket, stopping removes.
    new.stop("c");
    assert!(!sock.exists());
}

/// The page and tier of a share (docs/qos.md): a latency process gets the
/// GPU's QoS page after its ledger, with a slot that counts it as latency
/// work until its connection closes; a batch process gets the page alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_shares_get_their_gpus_qos_page_and_latency_a_slot() {
    let d = tempfile::tempdir().unwrap();
    let (lat, bat) = (d.path().join("lat"), d.path().join("bat"));
    std::fs::create_dir_all(&lat).unwrap();
    std::fs::create_dir_all(&bat).unwrap();
    let (page, file) = QosPage::create_sealed(0).unwrap();
    let device = QosDevice::new(0, page, file);
    let qos = |tier| ShareQos {
        tier,
        pages: vec![device.clone()],
    };
    let reg = Registry::default();
    reg.serve_share(
        "l",
        &lat,
        "uid",
        "main",
        ledgers(&lat, 1),
        ShareExtras {
            qos: Some(qos(Tier::Latency)),
            ..Default::default()
        },
    )
    .unwrap();
    reg.serve_share(
        "b",
        &bat,
        "uid",
        "main",
        ledgers(&bat, 1),
        ShareExtras {
            qos: Some(qos(Tier::Batch)),
            ..Default::default()
        },
    )
    .unwrap();

    let l2 = lat.clone();
    let (s, resp, fds) = blocking(move || register(&l2, request(1))).await;
    assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
    assert_eq!(
        (Tier::from_wire(resp.qos_tier), resp.qos_page),
        (Tier::Latency, true)
    );
    assert_eq!(fds.len(), 2, "the ledger, then the latency flag");
    let slot = resp.qos_slot.expect("a latency slot") as usize;
    assert_eq!(page.latency_live(), 1);
    assert_eq!(page.generation(), 1);
    let flag_file = device.flags.lock().unwrap()[&slot].clone();
    assert_eq!(inode(&fds[1]), inode(&*flag_file), "its own flag");
    assert!(
        device.sealed_flags().is_empty(),
        "not handed on before it is sealed"
    );
    let flag = qos_page::Flag::adopt(fds[1].as_fd()).unwrap();
    assert_eq!(device.sealed_flags().len(), 1);

    let b2 = bat.clone();
    let (sb, resp, fds) = blocking(move || register(&b2, request(1))).await;
    assert_eq!(
        (Tier::from_wire(resp.qos_tier), resp.qos_page),
        (Tier::Batch, true)
    );
    assert_eq!((resp.qos_slot, fds.len()), (None, 2));
    assert_eq!(inode(&fds[1]), inode(&*device.file), "the GPU's page");
    let seen = QosPage::from_fd(fds[1].as_fd()).unwrap();
    assert_eq!((seen.latency_live(), seen.generation()), (1, 1));
    // It asks for the flags: the latency process's, read-only.
    let views = blocking(move || {
        let v = test_flags(&sb);
        (sb, v)
    })
    .await;
    let (sb, views) = views;
    assert_eq!(views.len(), 1);
    flag.busy(u64::MAX);
    assert_eq!(views[0].deadline(), u64::MAX, "the same memory");
    flag.idle();
    assert_eq!(views[0].deadline(), 0);

    // The latency process ends: its slot and its flag go.
    drop(s);
    for _ in 0..200 {
        if page.latency_live() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(page.latency_live(), 0);
    assert_eq!(seen.generation(), 2, "moved: batch processes ask again");
    assert!(device.flags.lock().unwrap().is_empty());
    let (_, views) = blocking(move || {
        let v = test_flags(&sb);
        (sb, v)
    })
    .await;
    assert!(views.is_empty());
    reg.stop("l");
    reg.stop("b");
}

/// A tiered share on two GPUs: protocol 2's fields carry a page per GPU
/// after the two ledgers, and a latency process a slot in each; the
/// one-page fields stay unset, so an interposer from before them runs plain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiered_share_on_two_gpus_gets_a_page_and_a_slot_per_gpu() {
    let d = tempfile::tempdir().unwrap();
    let (lat, bat) = (d.path().join("lat"), d.path().join("bat"));
    std::fs::create_dir_all(&lat).unwrap();
    std::fs::create_dir_all(&bat).unwrap();
    let devices: Vec<QosDevice> = (0..2)
        .map(|i| {
            let (page, file) = QosPage::create_sealed(i).unwrap();
            QosDevice::new(i, page, file)
        })
        .collect();
    let reg = Registry::default();
    for (id, dir, tier) in [("l", &lat, Tier::Latency), ("b", &bat, Tier::Batch)] {
        let qos = ShareQos {
            tier,
            pages: devices.clone(),
        };
        let extras = ShareExtras {
            qos: Some(qos),
            ..Default::default()
        };
        reg.serve_share(id, dir, "uid", "main", ledgers(dir, 2), extras)
            .unwrap();
    }
    let l2 = lat.clone();
    let (s, resp, fds) = blocking(move || register(&l2, request(2))).await;
    assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
    assert_eq!(
        (Tier::from_wire(resp.qos_tier), resp.qos_page, resp.qos_slot),
        (Tier::Latency, false, None),
        "not in the one-page fields"
    );
    assert_eq!((resp.qos_pages, resp.qos_slots.len()), (2, 2), "{resp:?}");
    assert_eq!(fds.len(), 4, "two ledgers, then two flags");
    for (i, d) in devices.iter().enumerate() {
        let slot = resp.qos_slots[i] as usize;
        let flag = d.flags.lock().unwrap()[&slot].clone();
        assert_eq!(inode(&fds[2 + i]), inode(&*flag), "flag {i} in order");
        assert_eq!(d.page.latency_live(), 1, "a slot in page {i}");
    }
    let b2 = bat.clone();
    let (_sb, resp, fds) = blocking(move || register(&b2, request(2))).await;
    assert_eq!(
        (
            Tier::from_wire(resp.qos_tier),
            resp.qos_pages,
            resp.qos_slots.len()
        ),
        (Tier::Batch, 2, 0)
    );
    assert_eq!(fds.len(), 4);
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(inode(&fds[2 + i]), inode(&*d.file), "page {i} in order");
    }
    // An interposer from before the pages (no qos_pages in its request):
    // its ledgers alone, as it counts them, and it runs plain.
    let b3 = bat.clone();
    let old = RegisterRequest {
        qos_pages: false,
        ..request(2)
    };
    let (_so, resp, fds) = blocking(move || register(&b3, old)).await;
    assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
    assert_eq!((resp.qos_tier, resp.qos_pages, fds.len()), (0, 0, 2));

    // The latency process ends: its slot in both pages goes.
    drop(s);
    for _ in 0..200 {
        if devices.iter().all(|d| d.page.latency_live() == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(devices.iter().all(|d| d.page.latency_live() == 0));
    reg.stop("l");
    reg.stop("b");
}

const G: u64 = 1 << 30;

/// Serves share `name` on a 16 GiB GPU-0 with `guarantee` and `limit`.
fn serve_on_16g(reg: &Registry, root: &Path, name: &str, guarantee: u64, limit: u64) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let (l, f) = Ledger::create(&dir.join(quota_config::ledger_file(0)), guarantee).unwrap();
    let memory = ShareMemory {
        gpus: vec![LedgerGpu {
            uuid: "GPU-0".into(),
            guarantee,
            card_bytes: 16 * G,
        }],
        limit,
    };
    let extras = ShareExtras { qos: None, memory };
    reg.serve_share(name, &dir, "uid", "main", vec![(l, f)], extras)
        .unwrap();
    dir
}

/// Gives process `pid` a slot in share `name`'s ledger holding `bytes`, as
/// if it had registered and allocated (SO_PEERCRED makes every test
/// registration this process's own).
fn holding(reg: &Registry, name: &str, pid: i32, bytes: u64) {
    let e = &reg.endpoints.lock().unwrap()[name];
    let (ledger, _) = &e.procs.ledgers[0];
    let s = ledger.claim_slot(pid, None).unwrap();
    ledger.force_reserve(s, bytes);
    e.procs.pids.lock().unwrap().insert(pid, (1, Some(vec![s])));
}

/// Memory requests on the registration connection (docs/qos.md, "Memory"):
/// two borrowers (2 GiB guaranteed, 6 GiB limit) beside an 8 GiB share
/// on a 16 GiB GPU share the 4 GiB nobody is guaranteed; what one borrowed
/// the other cannot; a share within its quota asks a reclaim and the
/// borrower's process (a child of this test) is ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn borrowers_share_what_nobody_is_guaranteed_and_give_it_back() {
    use vcuda_api::vcuda::memory_request::Kind;
    use vcuda_api::vcuda::memory_response::Status as MStatus;
    let d = tempfile::tempdir().unwrap();
    let reg = Registry::default();
    let serve = |name: &str, guarantee: u64, limit: u64| {
        serve_on_16g(&reg, d.path(), name, guarantee, limit)
    };
    let (a, b, g) = (
        serve("a", 2 * G, 6 * G),
        serve("b", 2 * G, 6 * G),
        serve("g", 8 * G, 0),
    );
    let ask = |s: &mut StdStream, kind: Kind, bytes: u64| {
        frame::write(
            s,
            &MemoryRequest {
                kind: kind as i32,
                bytes,
            },
        )
        .unwrap();
        frame::read::<MemoryResponse>(s).unwrap()
    };
    // The borrower is a child process: a reclaim ends it.
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let (a2, b2, g2) = (a.clone(), b.clone(), g.clone());
    let out = blocking(move || {
        // The child's registration: SO_PEERCRED is ours, so register as us
        // and move the slot to the child below.
        let (mut sa, ra, fa) = register(&a2, request(1));
        assert_eq!((ra.memory_limit, ra.reclaim), (6 * G, true), "{ra:?}");
        let (mut sb, _, _) = register(&b2, request(1));
        let (mut sg, rg, _) = register(&g2, request(1));
        assert_eq!((rg.memory_limit, rg.reclaim), (0, true));
        let info = ask(&mut sa, Kind::Info, 0);
        assert_eq!(
            info.available,
            6 * G,
            "2 of its own, 4 to lend, 6 its limit"
        );
        let r = ask(&mut sa, Kind::Borrow, 5 * G);
        assert_eq!(r.status, MStatus::Granted as i32, "{}", r.message);
        let r = ask(&mut sb, Kind::Borrow, 4 * G);
        assert_eq!(r.status, MStatus::Refused as i32);
        assert!(
            r.message.contains("4096 MiB nobody is guaranteed"),
            "{}",
            r.message
        );
        assert_eq!(r.available, 3 * G, "its 2 and the 1 left to lend");
        let r = ask(&mut sg, Kind::Borrow, G);
        assert!(
            r.message.contains("no memory limit above its quota"),
            "{}",
            r.message
        );
        let ledger = Ledger::from_fd(fa[0].as_fd()).unwrap();
        assert_eq!(ledger.used(), 5 * G);
        (sa, sb, sg, ledger, ra.ledger_slot.unwrap() as usize)
    })
    .await;
    // a's connection stays open: its close would clear the slot.
    let (_sa, _sb, mut sg, ledger, slot) = out;
    // Hand a's slot to the child, as if it had registered and borrowed.
    let held = ledger.clear_slot(slot);
    let s = ledger.claim_slot(pid, None).unwrap();
    ledger.force_reserve(s, held);
    reg.endpoints.lock().unwrap()["a"]
        .procs
        .pids
        .lock()
        .unwrap()
        .insert(pid, (1, Some(vec![s])));
    let r = blocking(move || ask(&mut sg, Kind::Reclaim, 4 * G)).await;
    assert_eq!(r.status, MStatus::Granted as i32, "{}", r.message);
    assert_eq!(r.reclaimed, 3 * G, "what the borrower held above its 2 GiB");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    assert_eq!(ledger.used(), 0, "the ended process's slot cleared");
    assert_eq!(reg.ledger_counters("a").unwrap().reclaims, 1);
}

/// A borrower that writes its ledger down (0 bytes) while the driver says
/// its process holds 6 GiB is the one a reclaim ends, not the honest
/// borrower holding 3 GiB; without the witness the honest one would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_believes_the_driver_over_a_ledger_written_down() {
    use std::os::unix::process::ExitStatusExt;
    use vcuda_api::vcuda::memory_request::Kind;
    use vcuda_api::vcuda::memory_response::Status as MStatus;
    let d = tempfile::tempdir().unwrap();
    let reg = Registry::default();
    serve_on_16g(&reg, d.path(), "liar", 2 * G, 6 * G);
    serve_on_16g(&reg, d.path(), "honest", 2 * G, 6 * G);
    let g = serve_on_16g(&reg, d.path(), "g", 8 * G, 0);
    let sleeper = || {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    };
    let (mut liar, mut honest) = (sleeper(), sleeper());
    let (lp, hp) = (liar.id() as i32, honest.id() as i32);
    holding(&reg, "liar", lp, 0);
    holding(&reg, "honest", hp, 3 * G);
    reg.memory_witness(Arc::new(move |uuid: &str| {
        assert_eq!(uuid, "GPU-0");
        Some(HashMap::from([(lp, 6 * G), (hp, 3 * G)]))
    }));
    let r = blocking(move || {
        let (mut sg, _, _) = register(&g, request(1));
        frame::write(
            &mut sg,
            &MemoryRequest {
                kind: Kind::Reclaim as i32,
                bytes: 4 * G,
            },
        )
        .unwrap();
        frame::read::<MemoryResponse>(&mut sg).unwrap()
    })
    .await;
    assert_eq!(r.status, MStatus::Granted as i32, "{}", r.message);
    assert_eq!(
        r.reclaimed,
        4 * G,
        "what the driver says it held above 2 GiB"
    );
    assert_eq!(liar.wait().unwrap().signal(), Some(libc::SIGKILL));
    assert!(
        honest.try_wait().unwrap().is_none(),
        "the honest borrower lives"
    );
    let _ = honest.kill();
    assert_eq!(reg.ledger_counters("liar").unwrap().reclaims, 1);
    assert_eq!(reg.ledger_counters("honest").unwrap().reclaims, 0);
}

/// A share without a limit (4 GiB guaranteed) that writes its ledger up
/// to 12 GiB does not shrink what a borrower (2 GiB, limit 6) may take of
/// the 10 GiB nobody is guaranteed: believed up to its guarantee, and
/// above only as far as the driver says (1 GiB here; 7 GiB the driver
/// took on its own would count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_written_up_does_not_shrink_what_others_may_borrow() {
    use vcuda_api::vcuda::memory_request::Kind;
    let d = tempfile::tempdir().unwrap();
    let reg = Registry::default();
    serve_on_16g(&reg, d.path(), "liar", 4 * G, 0);
    let b = serve_on_16g(&reg, d.path(), "b", 2 * G, 6 * G);
    let lp = std::process::id() as i32 + 1_000_000;
    holding(&reg, "liar", lp, 12 * G);
    let info = |b: &Path| {
        let b = b.to_path_buf();
        blocking(move || {
            let (mut s, _, _) = register(&b, request(1));
            frame::write(
                &mut s,
                &MemoryRequest {
                    kind: Kind::Info as i32,
                    bytes: 0,
                },
            )
            .unwrap();
            frame::read::<MemoryResponse>(&mut s).unwrap().available
        })
    };
    // No witness: the liar is believed up to its guarantee.
    assert_eq!(info(&b).await, 6 * G, "its 2 and 4 of the 10 to lend");
    let driver_says = Arc::new(Mutex::new(G));
    let says = driver_says.clone();
    reg.memory_witness(Arc::new(move |_: &str| {
        Some(HashMap::from([(lp, *says.lock().unwrap())]))
    }));
    assert_eq!(info(&b).await, 6 * G, "the driver says 1 GiB");
    // Memory the driver took on its own is real: 7 of the 12 counted,
    // 3 of the 10 lent, 7 left: still its limit.
    *driver_says.lock().unwrap() = 7 * G;
    assert_eq!(info(&b).await, 6 * G);
    *driver_says.lock().unwrap() = 12 * G;
    assert_eq!(
        info(&b).await,
        4 * G,
        "12 held: 8 lent, 2 left and its own 2"
    );
}

/// A batch process's `QOS_FLAGS` over the blocking socket: its flags,
/// mapped read-only.
fn test_flags(s: &std::os::unix::net::UnixStream) -> Vec<qos_page::FlagView> {
    use vcuda_api::vcuda::{MemoryRequest, MemoryResponse, memory_request};
    let mut c = s.try_clone().unwrap();
    let req = MemoryRequest {
        kind: memory_request::Kind::QosFlags as i32,
        bytes: 0,
    };
    vcuda_api::vcuda::frame::write(&mut c, &req).unwrap();
    let (body, fds) = container_ledger::fdpass::recv_frame_fds(c.as_fd(), 65536).unwrap();
    let r = <MemoryResponse as prost::Message>::decode(body.as_slice()).unwrap();
    assert!(r.qos, "{r:?}");
    fds.iter()
        .map(|f| qos_page::FlagView::open(f.as_fd()).unwrap())
        .collect()
}

/// More sealed latency flags than one message carries descriptors (64
/// slots on each of two pages): the batch process's `QOS_FLAGS` is
/// answered with as many as fit, and its connection stays. The build
/// before tried 250 in one message, which the send refused, and closed
/// the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_past_one_message_are_cut_to_what_it_carries() {
    let d = tempfile::tempdir().unwrap();
    let bat = d.path().join("bat");
    std::fs::create_dir_all(&bat).unwrap();
    let devices: Vec<QosDevice> = (0..2)
        .map(|i| {
            let (page, file) = QosPage::create_sealed(i).unwrap();
            let dev = QosDevice::new(i, page, file);
            for slot in 0..qos_page::SLOTS {
                let f = qos_page::make_flag(i, slot).unwrap();
                qos_page::Flag::adopt(f.as_fd()).unwrap();
                dev.flags.lock().unwrap().insert(slot, Arc::new(f));
            }
            dev
        })
        .collect();
    let reg = Registry::default();
    let extras = ShareExtras {
        qos: Some(ShareQos {
            tier: Tier::Batch,
            pages: devices,
        }),
        ..Default::default()
    };
    reg.serve_share("b", &bat, "uid", "main", ledgers(&bat, 2), extras)
        .unwrap();
    let (views, again) = blocking(move || {
        let (s, resp, _) = register(&bat, request(2));
        assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
        let views = test_flags(&s);
        (views, test_flags(&s))
    })
    .await;
    let max = container_ledger::fdpass::MAX_FDS;
    assert_eq!((views.len(), again.len()), (max, max));
    reg.stop("b");
}
