//! Taking the node's state over and handing it on ([`crate::lifecycle::owner`]).
//!
//! A rolling update with surge: the new manager registers beside the old
//! one (kubelet calls the newer registration) and names itself the
//! successor; the old one, seeing it, refuses new calls, lets those in
//! progress finish, writes what it has not written, stops its state jobs
//! and gives up the lock; the new one then reads the state and opens. The
//! old one keeps serving the running shares' `vcuda.sock` connections
//! until its pod is deleted, and takes the node back should the new one
//! die before it (a new version that crashes).
//!
//! Kubelet ≥ 1.26 drops the newest registration of a resource when an
//! older one's `ListAndWatch` stream ends (`plugin/v1beta1/server.go`,
//! `runClient`), and a pod admitted before the new manager has registered
//! again fails (`UnexpectedAdmissionError`). So the old manager hands its
//! kubelet connections (copies of the fds, over the successor's inbox) to
//! the new one and, stopping, exits without closing them: kubelet's old
//! streams never end. A manager without a successor (a plain
//! restart, kubelet 1.20 without surge) writes the node's allocatable 0
//! when it stops ([`crate::decide::node_status`]).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::edge::plugin::GateControl;
use crate::edge::served::Plugins;
use crate::lifecycle::owner::{self, Claim, Owner, Successor};
use crate::lifecycle::tasks::{AllocationCheck, InventoryPublish, PodRelease};
use crate::manager::Manager;

/// How often an owner looks for a successor.
const SUCCESSOR_POLL: Duration = Duration::from_millis(100);
/// How long a stopping manager waits, after writing allocatable 0, for
/// bindings the scheduler made before it saw the 0 ([`Node::drain`]).
pub const DRAIN_SETTLE: Duration = Duration::from_millis(300);
/// The longest [`Node::drain`] keeps serving for pods awaiting admission.
pub const DRAIN_MAX: Duration = Duration::from_secs(5);

/// What an owner holds: the lock and the jobs that change the state.
pub struct Held {
    owner: Owner,
    jobs: CancellationToken,
}

/// Everything a takeover needs.
pub struct Node {
    pub settings: Arc<Settings>,
    pub mgr: Arc<Manager>,
    pub nvml: Arc<nvml_wrapper::Nvml>,
    pub client: kube::Client,
    pub metrics: gpu_display::ManagerMetrics,
    pub gate: GateControl,
    pub instance: String,
    /// The MIG plugins, whose devices follow their GPU's health.
    pub mig: crate::mig::MigPlugins,
}

impl Node {
    fn dir(&self) -> &std::path::Path {
        &self.settings.checkpoint_path
    }

    /// Reads the state (recovery), starts the jobs that change it and
    /// opens the gate.
    pub async fn take_over(&self, owner: Owner, cancel: &CancellationToken) -> Held {
        let t = Instant::now();
        let report = self.mgr.restore().await;
        let recovery = t.elapsed();
        tracing::info!(
            recovery_ms = recovery.as_millis() as u64,
            kept = report.kept,
            rebuilt = report.rebuilt,
            released = report.released,
            orphans_removed = report.orphans_removed,
            set_aside = ?report.set_aside,
            unreachable = ?report.unreachable,
            "recovery finished"
        );
        let jobs = cancel.child_token();
        self.start_jobs(&jobs);
        self.metrics.set_recovery_duration(recovery);
        self.gate.open();
        tracing::info!(
            restored = report.kept + report.rebuilt,
            instance = %self.instance,
            "step 5/6: state ready"
        );
        Held { owner, jobs }
    }

    fn start_jobs(&self, jobs: &CancellationToken) {
        let (s, mgr) = (&self.settings, &self.mgr);
        let health = node_agent::health::watch(
            self.nvml.clone(),
            mgr.gpus().iter().map(|g| g.uuid.clone()).collect(),
            s.ignored_xids.clone(),
            s.xid_quiet_period,
            node_agent::health::InstanceXids::Instance,
            jobs,
        );
        crate::decide::health::spawn(mgr.clone(), self.mig.clone(), health, jobs.clone());
        AllocationCheck {
            mgr: mgr.clone(),
            period: s.allocation_check_period,
        }
        .spawn(jobs.clone());
        mgr.spawn_lazy_flush(jobs.clone());
        PodRelease { mgr: mgr.clone() }.spawn(jobs.clone());
        InventoryPublish {
            mgr: mgr.clone(),
            client: self.client.clone(),
            node: s.node_name.clone(),
            period: Duration::from_secs(2),
        }
        .spawn(jobs.clone());
    }

    /// For a manager started beside an owner: opens its inbox, names itself
    /// the successor, waits for the owner to hand over, takes over. `None`:
    /// cancelled.
    pub async fn succeed(
        &self,
        sockets: &[PathBuf],
        plugins: &Plugins,
        cancel: &CancellationToken,
    ) -> Option<Held> {
        let inbox = self.dir().join(format!("inbox-{}.sock", self.instance));
        if let Err(e) = plugins.open_inbox(&inbox).await {
            tracing::warn!(inbox = %inbox.display(), error = %e, "no inbox for kubelet's connections: kubelet drops this registration once the old manager stops, and it registers again");
        }
        if let Err(e) = owner::announce(self.dir(), &self.instance, sockets, &inbox) {
            tracing::error!(error = %e, dir = %self.dir().display(), "cannot name this manager the successor; the owner hands over only when it stops");
        }
        let t = Instant::now();
        let owner = owner::wait(
            self.dir(),
            &self.settings.device_plugin_path,
            &self.instance,
            cancel,
        )
        .await;
        let held = match owner {
            Some(o) => {
                tracing::info!(
                    waited_ms = t.elapsed().as_millis() as u64,
                    "the previous manager handed the node over"
                );
                Some(self.take_over(o, cancel).await)
            }
            None => None,
        };
        owner::withdraw(self.dir(), &self.instance);
        held
    }

    /// Runs until `cancel`, handing the state over to each successor that
    /// appears, and taking it back should that successor die while this
    /// manager still runs (a new version that crashes once registered):
    /// the node is never left without an owner. Returns, at `cancel`, what
    /// is held and whether the state had been handed over.
    pub async fn hold(
        &self,
        held: Held,
        plugins: &Plugins,
        cancel: &CancellationToken,
    ) -> (Option<Held>, bool) {
        let mut held = Some(held);
        let mut handed_to: Option<Successor> = None;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return (held, handed_to.is_some()),
                () = tokio::time::sleep(SUCCESSOR_POLL) => {}
            }
            match held.take() {
                Some(h) => match owner::successor(self.dir(), &self.instance) {
                    Some(next) => {
                        self.hand_over(h, &next, plugins).await;
                        handed_to = Some(next);
                    }
                    None => held = Some(h),
                },
                None => {
                    if handed_to.as_ref().is_some_and(|s| !s.alive())
                        && let Ok(Claim::Owned(o)) = owner::claim(
                            self.dir(),
                            &self.settings.device_plugin_path,
                            &self.instance,
                        )
                    {
                        tracing::warn!(
                            successor = %handed_to.as_ref().map_or("", |s| &s.instance),
                            "the manager this one handed the node over to is gone and nobody owns the node: taking it back"
                        );
                        held = Some(self.take_over(o, cancel).await);
                        plugins.register_again().await;
                        handed_to = None;
                    }
                }
            }
        }
    }

    async fn hand_over(&self, held: Held, to: &Successor, plugins: &Plugins) {
        let t = Instant::now();
        let name = &to.instance;
        tracing::info!(successor = %name, "a new manager is registered beside this one: handing the node over");
        self.gate.hand_over(name).await;
        held.jobs.cancel();
        // Releases not yet written (they wait for the next write).
        if let Err(e) = self.mgr.flush().await {
            tracing::error!(error = %e.message(), "writing the checkpoint before the handover failed; the successor's recovery rebuilds what it lacks");
        }
        drop(held.owner);
        match &to.inbox {
            Some(inbox) => match plugins
                .hand_over_connections(inbox, self.mig.kubelet_connections())
                .await
            {
                Ok(n) => {
                    tracing::info!(successor = %name, connections = n, "kubelet's connections handed over")
                }
                Err(e) => {
                    tracing::warn!(successor = %name, error = %e, "handing kubelet's connections over failed: kubelet drops the successor's registration when this manager stops, and it registers again")
                }
            },
            None => {
                tracing::warn!(successor = %name, "the successor has no inbox (an earlier version?): kubelet's connections close when this manager stops")
            }
        }
        tracing::info!(
            successor = %name,
            ms = t.elapsed().as_millis() as u64,
            "handed over; serving the running shares' connections until this pod stops"
        );
    }

    /// At shutdown, before the plugins stop and again after
    /// ([`crate::decide::node_status`]): unless a successor serves, the
    /// node's allocatable 0, so the scheduler stops placing pods here.
    /// For the node's owner only. Whether it wrote 0 (no successor).
    pub async fn withdraw(&self) -> bool {
        match owner::successor(self.dir(), &self.instance) {
            Some(next) => {
                tracing::info!(successor = %next.instance, "a new manager is registered: leaving the node's vcuda allocatable to it");
                false
            }
            None => {
                let node = &self.settings.node_name;
                crate::decide::node_status::set_allocatable(&self.client, node, 0, 0).await;
                true
            }
        }
    }

    /// After [`Self::withdraw`] wrote 0, with the plugins still serving:
    /// pods the scheduler bound here before it saw the 0 reach the kubelet
    /// afterwards, and with no plugin left it refuses them for good
    /// (`UnexpectedAdmissionError`; a kubelet 1.20 DaemonSet rollback
    /// refused pods created 0.5-8 s into it). Waits [`DRAIN_SETTLE`] for
    /// bindings in flight, then until no pod awaits admission, at most
    /// [`DRAIN_MAX`] in all (the pod's grace period is 30 s; a pod pending
    /// longer is stuck for another reason).
    pub async fn drain(&self) {
        let t0 = Instant::now();
        tokio::time::sleep(DRAIN_SETTLE).await;
        loop {
            let seen = self.mgr.pod_generation();
            let waiting = self.mgr.awaiting_admission();
            let left = DRAIN_MAX.saturating_sub(t0.elapsed());
            if waiting.is_empty() || left.is_zero() {
                let ms = t0.elapsed().as_millis() as u64;
                match waiting.is_empty() {
                    true => tracing::info!(ms, "no pod bound here awaits admission"),
                    false => {
                        tracing::warn!(ms, pods = ?waiting, "stopping with pods bound here not yet admitted: the kubelet will refuse them")
                    }
                }
                return;
            }
            tracing::info!(pods = ?waiting, "serving until the kubelet admits the pods bound here");
            let _ = tokio::time::timeout(left.min(DRAIN_SETTLE), self.mgr.pod_changes(seen)).await;
        }
    }

    /// At shutdown, with the plugins stopped: an owner writes what it has
    /// not written and, unless a successor serves, the node's allocatable 0.
    pub async fn stop(&self, held: Option<Held>) {
        let Some(held) = held else {
            return;
        };
        held.jobs.cancel();
        let _ = self.mgr.flush().await;
        // Kubelet has no devices from here: the scheduler must not place
        // pods on them until the next manager registers.
        let _ = self.withdraw().await;
        drop(held.owner);
    }
}

/// The inbox: takes the fds one predecessor sends, keeps them in `into`,
/// then removes itself.
pub fn open_inbox(path: &Path, into: Arc<Mutex<Vec<OwnedFd>>>) -> std::io::Result<()> {
    let _ = std::fs::remove_file(path);
    let listener = std::os::unix::net::UnixListener::bind(path)?;
    listener.set_nonblocking(true)?;
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        // A predecessor's supervisor and the predecessor itself (its MIG
        // plugins' connections) each send once.
        let until = Instant::now() + INBOX_OPEN;
        let mut senders = 0;
        while senders < INBOX_SENDERS && Instant::now() < until {
            match listener.accept() {
                Ok((conn, _)) => {
                    senders += 1;
                    keep_connections(&conn, &into);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        let _ = std::fs::remove_file(&path);
    });
    Ok(())
}

/// How long a successor's inbox takes senders, and how many.
const INBOX_OPEN: Duration = Duration::from_secs(300);
const INBOX_SENDERS: usize = 2;

fn keep_connections(conn: &std::os::unix::net::UnixStream, into: &Mutex<Vec<OwnedFd>>) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    while let Ok((msg, mut fds)) = fd_pass::recv(conn) {
        if msg.is_empty() {
            break;
        }
        let n = fds.len();
        into.lock()
            .unwrap_or_else(|p| p.into_inner())
            .append(&mut fds);
        tracing::info!(
            connections = n,
            "kept kubelet's connections to the previous manager open"
        );
    }
}
