use super::*;

use std::sync::atomic::AtomicUsize;

const MESSAGES: Messages = Messages {
    what: "test child",
    not_ready: "the test child exited before it was ready: not restarting it here",
    restarting: "the test child exited; another starts",
    hung: "the test child is hung (no heartbeat): killing it",
};

fn fast() -> Backoff {
    Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(4),
        Duration::from_secs(60),
    )
}

fn sh(script: &str) -> Spec {
    Spec::new("/bin/sh").arg0("sh").args(["-c", script])
}

/// Runs `script` under a supervisor until it stops; the code, and how many
/// children ran.
async fn supervise(sup: Supervisor, script: &str) -> (i32, usize) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let code = tokio::time::timeout(
        Duration::from_secs(20),
        sup.run(|| {
            let n = r.fetch_add(1, Ordering::SeqCst);
            Ok(sh(script).env("RUN", n.to_string()))
        }),
    )
    .await
    .expect("the supervisor did not stop")
    .expect("the supervisor failed");
    (code, runs.load(Ordering::SeqCst))
}

#[test]
fn backoff_doubles_to_its_maximum_and_starts_over_after_a_stable_run() {
    let mut b = Backoff::default();
    let short = Duration::from_millis(10);
    let waits: Vec<u128> = (0..8).map(|_| b.delay(short).as_millis()).collect();
    assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    assert_eq!(b.delay(STABLE), FIRST_BACKOFF);
    assert_eq!(b.delay(short), Duration::from_millis(200));
    assert_eq!(b.delay(STABLE + short), FIRST_BACKOFF);
}

#[tokio::test]
async fn a_child_that_exits_before_it_was_ready_ends_the_supervisor_with_its_status() {
    let sup = Supervisor::new(MESSAGES, Ready::default()).backoff(fast());
    assert_eq!(supervise(sup, "exit 3").await, (3, 1));
    // Killed by a signal: 128 + signal, as shells report it.
    let sup = Supervisor::new(MESSAGES, Ready::default()).backoff(fast());
    assert_eq!(supervise(sup, "kill -9 $$").await, (137, 1));
}

#[tokio::test]
async fn a_clean_exit_ends_the_supervisor_without_a_restart() {
    let sup = Supervisor::new(MESSAGES, Ready::new(true)).backoff(fast());
    assert_eq!(supervise(sup, "exit 0").await, (0, 1));
}

#[tokio::test]
async fn a_ready_child_that_dies_is_started_again() {
    let sup = Supervisor::new(MESSAGES, Ready::new(true)).backoff(fast());
    // The first three die, the fourth exits cleanly.
    let (code, runs) = supervise(sup, r#"[ "$RUN" -ge 3 ] && exit 0; kill -9 $$"#).await;
    assert_eq!((code, runs), (0, 4));
}

#[tokio::test]
async fn a_child_reports_ready_on_its_pipe_and_is_then_restarted() {
    let ready = Ready::default();
    let reported = Arc::new(AtomicUsize::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let (r, rep) = (runs.clone(), reported.clone());
    let sup = Supervisor::new(MESSAGES, ready.clone()).backoff(fast());
    let code = sup
        .run(|| {
            let n = r.fetch_add(1, Ordering::SeqCst);
            let rep = rep.clone();
            let w = ready.pipe(move || {
                rep.fetch_add(1, Ordering::SeqCst);
            })?;
            // The first reports ready, then fails; the second exits.
            Ok(
                sh(r#"[ "$RUN" = 1 ] && exit 0; printf r >&5; sleep 0.2; exit 7"#)
                    .env("RUN", n.to_string())
                    .pass(w, 5),
            )
        })
        .await
        .unwrap();
    assert_eq!(code, 0);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(reported.load(Ordering::SeqCst), 1);
    assert!(ready.is_set());
}

#[tokio::test]
async fn the_child_gets_its_fds_at_their_numbers_and_its_environment() {
    let (r1, w1) = pipe().unwrap();
    let (r2, w2) = pipe().unwrap();
    let exited = Arc::new(AtomicBool::new(false));
    let e = exited.clone();
    let mut spec = Some(
        sh(r#"echo "one $VAR" >&4; echo two >&3"#)
            .env("VAR", "set")
            .pass(w1, 4)
            .share(w2.as_raw_fd(), 3)
            .on_exit(move || e.store(true, Ordering::SeqCst)),
    );
    let sup = Supervisor::new(MESSAGES, Ready::default());
    let code = sup
        .run(|| Ok(spec.take().expect("started once")))
        .await
        .unwrap();
    assert_eq!(code, 0);
    assert!(exited.load(Ordering::SeqCst));
    // The shared fd stays ours: close it to read to the end.
    drop(w2);
    let read = |f: OwnedFd| {
        let mut s = String::new();
        std::fs::File::from(f).read_to_string(&mut s).unwrap();
        s
    };
    assert_eq!(read(r1), "one set\n");
    assert_eq!(read(r2), "two\n");
}

#[tokio::test]
async fn the_watchdog_kills_a_child_whose_heartbeat_stopped() {
    let heartbeat = Arc::new(Heartbeat::default());
    let sup = Supervisor::new(MESSAGES, Ready::new(true))
        .backoff(fast())
        .watchdog(Watchdog {
            heartbeat: heartbeat.clone(),
            every: Duration::from_millis(20),
            hung: Duration::from_millis(200),
        });
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let t0 = Instant::now();
    let code = sup
        .run(|| {
            let n = r.fetch_add(1, Ordering::SeqCst);
            // Silent until the first beat, then never again.
            heartbeat.beat();
            Ok(sh(if n == 0 { "exec sleep 30" } else { "exit 0" }))
        })
        .await
        .unwrap();
    assert_eq!((code, runs.load(Ordering::SeqCst)), (0, 2));
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn a_child_never_heard_from_is_not_hung() {
    let heartbeat = Arc::new(Heartbeat::default());
    let sup = Supervisor::new(MESSAGES, Ready::new(true)).watchdog(Watchdog {
        heartbeat,
        every: Duration::from_millis(10),
        hung: Duration::from_millis(20),
    });
    assert_eq!(supervise(sup, "sleep 0.3; exit 0").await, (0, 1));
}

#[tokio::test]
async fn a_child_that_cannot_start_is_an_error() {
    let sup = Supervisor::new(MESSAGES, Ready::default());
    let err = sup
        .run(|| Ok(Spec::new("/nonexistent/child")))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("starting the test child (/nonexistent/child): "),
        "{err}"
    );
}
