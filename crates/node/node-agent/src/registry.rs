//! `vcuda.sock` in every shared container's vm directory: each interposer
//! process connects once and keeps the connection. The kernel reports the
//! peer's host PID (SO_PEERCRED), which goes into `pids.config`; the reply
//! carries the container's ledger descriptors (SCM_RIGHTS: one per GPU of
//! its share, in record order) and the process's slot in each. When the
//! connection closes the process is gone: its PID leaves `pids.config` and
//! its ledger slots are cleared.
//!
//! Protocol 1 is a one-GPU container's (one ledger); a container whose
//! share spans several GPUs is served only at protocol 2, so an interposer
//! that enforces one GPU is refused instead of leaving the others unlimited
//! (docs/multi-gpu.md, "Why an old interposer fails closed").

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use container_ledger::Ledger;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

use budget::{Allowance, LogBudget, MAX_CONNS, MAX_CONNS_PER_PID};

pub mod budget;
pub mod memory;
mod wire;
pub use memory::{LedgerGpu, MemoryWitness, ReclaimSink, Reclaimed, ShareMemory};
use qos_page::{Holder, QosPage, Tier};

// Locks here guard maps changed by single inserts and removes: a panic
// elsewhere cannot leave them half-changed, so a poisoned lock is taken over.

/// One container's registration endpoint.
struct Endpoint {
    cancel: CancellationToken,
    procs: Arc<Procs>,
    /// The socket file it bound (device, inode): removed at stop only if
    /// the path still is that file. Another process (a driver's next
    /// instance, started beside this one in a rolling update) may have
    /// bound the path since, and its socket must stay.
    bound: Option<(u64, u64)>,
}

fn file_id(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Registered processes of one container.
struct Procs {
    dir: PathBuf,
    pod_uid: String,
    container: String,
    /// One per GPU of the share, in record order (empty: no ledger).
    ledgers: Vec<(Ledger, File)>,
    /// host PID -> (connections, its slot in each ledger)
    pids: Mutex<BTreeMap<i32, (u32, Option<Slots>)>>,
    /// Open connections, registered or not ([`MAX_CONNS`]).
    conns: AtomicUsize,
    /// Log lines this container's connections may cause.
    logs: LogBudget,
    /// The share's compute tier and the QoS page of each of its GPUs.
    qos: Option<ShareQos>,
    /// host PID -> its latency slot in each of those pages.
    holders: Mutex<HashMap<i32, Vec<Holder>>>,
    /// Guarantees and limit, for lending ([`memory`]).
    memory: ShareMemory,
    /// Its processes ended to give borrowed memory back.
    reclaims: std::sync::atomic::AtomicU64,
}

/// What a share is served with besides its ledgers.
#[derive(Clone, Default)]
pub struct ShareExtras {
    pub qos: Option<ShareQos>,
    pub memory: ShareMemory,
}

/// A share's compute tier and the QoS page of each of its GPUs (or of its
/// MIG device), in record order (docs/qos.md), handed to each registering
/// process after the ledgers' descriptors.
#[derive(Clone)]
pub struct ShareQos {
    pub tier: Tier,
    pub pages: Vec<QosDevice>,
}

/// One device's QoS page, the memfd it lives in, and the latency flags of
/// the processes holding its slots (shared by every share on the device).
#[derive(Clone)]
pub struct QosDevice {
    /// The page's number among the daemon's (names the flags' memfds).
    pub index: usize,
    pub page: QosPage,
    pub file: Arc<File>,
    /// Slot -> that latency process's flag (docs/qos.md).
    pub flags: Arc<Mutex<BTreeMap<usize, Arc<File>>>>,
}

impl QosDevice {
    pub fn new(index: usize, page: QosPage, file: File) -> QosDevice {
        QosDevice {
            index,
            page,
            file: Arc::new(file),
            flags: Default::default(),
        }
    }

    fn flags(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Arc<File>>> {
        self.flags.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The flag of the latency process in `slot`.
    fn flag(&self, slot: usize) -> Option<Arc<File>> {
        self.flags().get(&slot).cloned()
    }

    /// The flags their processes have sealed, by slot: what batch
    /// processes may be given (one not yet sealed could still be mapped
    /// writable by whoever holds it).
    pub fn sealed_flags(&self) -> Vec<(usize, Arc<File>)> {
        let flags = self.flags();
        let sealed = flags
            .iter()
            .filter(|(_, f)| qos_page::Flag::is_sealed(&***f));
        sealed.map(|(&s, f)| (s, f.clone())).collect()
    }
}

impl ShareQos {
    /// Gives back a process's slots (`hs[i]` in `pages[i]`) and drops its
    /// flags.
    fn release(&self, hs: &[Holder]) {
        for (d, h) in self.pages.iter().zip(hs) {
            d.flags().remove(&h.slot);
            d.page.release(*h);
        }
    }
}

impl Drop for Procs {
    // The endpoint stopped (the share closed): no process of it counts as
    // latency work any more.
    fn drop(&mut self) {
        if let Some(q) = &self.qos {
            let holders = self
                .holders
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner);
            for (_, hs) in holders.drain() {
                q.release(&hs);
            }
        }
    }
}

/// One open connection of a container, counted while it lives.
struct ConnGuard(Arc<Procs>);

impl ConnGuard {
    fn new(p: &Arc<Procs>) -> Option<ConnGuard> {
        let n = p.conns.fetch_add(1, Ordering::AcqRel);
        if n >= MAX_CONNS {
            p.conns.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(ConnGuard(p.clone()))
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.conns.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A process's slot in each of the container's ledgers, in record order.
type Slots = Vec<usize>;

impl Procs {
    fn write_pids(&self, pids: &BTreeMap<i32, (u32, Option<Slots>)>) {
        let list: Vec<i32> = pids.keys().copied().collect();
        let path = self.dir.join(quota_config::PIDS_FILE);
        // Derived state (rebuilt from live registrations): no fsync.
        if let Err(e) = crate::vm::replace_file(&path, &quota_config::encode_pids(&list), 0o644) {
            tracing::error!(error = %e, "writing pids.config");
        }
    }

    /// Counts a connection of `pid` and claims its slots (the ones it
    /// held, `prefer`, in record order, when re-registering). `Ok(None)`
    /// when the container keeps no ledger or one of them is full; `Err`
    /// when the process already holds [`MAX_CONNS_PER_PID`] connections.
    fn add(&self, pid: i32, prefer: &[usize]) -> Result<Option<Slots>, String> {
        let mut pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        let e = pids.entry(pid).or_insert((0, None));
        if e.0 >= MAX_CONNS_PER_PID {
            return Err(format!(
                "process {pid} already holds {} registrations; one is all a process needs",
                e.0
            ));
        }
        e.0 += 1;
        let first = e.0 == 1;
        if e.1.is_none() && !self.ledgers.is_empty() {
            e.1 = self.claim(pid, prefer);
        }
        let slots = e.1.clone();
        if first {
            self.write_pids(&pids);
        }
        Ok(slots)
    }

    /// A slot in every ledger, or none at all.
    fn claim(&self, pid: i32, prefer: &[usize]) -> Option<Slots> {
        let mut got = Vec::with_capacity(self.ledgers.len());
        for (i, (l, _)) in self.ledgers.iter().enumerate() {
            match l.claim_slot(pid, prefer.get(i).copied()) {
                Some(s) => got.push(s),
                None => {
                    self.clear(&got);
                    return None;
                }
            }
        }
        Some(got)
    }

    /// Clears a process's slots; returns the bytes given back per ledger.
    fn clear(&self, slots: &[usize]) -> Vec<u64> {
        slots
            .iter()
            .zip(&self.ledgers)
            .map(|(&s, (l, _))| l.clear_slot(s))
            .collect()
    }

    /// The process's slot in the first ledger.
    fn slot_of(&self, pid: i32) -> Option<usize> {
        let pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        pids.get(&pid)?.1.as_ref()?.first().copied()
    }

    fn registered(&self, pid: i32) -> bool {
        let pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        pids.contains_key(&pid)
    }

    /// The process holding the most on the ledger's GPU, and how much: by its slot, or by
    /// what `seen` (the driver) says a registered process holds, whichever
    /// is more.
    fn largest_process(
        &self,
        ledger: usize,
        seen: Option<&HashMap<i32, u64>>,
    ) -> Option<(i32, u64)> {
        let (l, _) = self.ledgers.get(ledger)?;
        let mut held: HashMap<i32, u64> = l.slots().map(|s| (s.pid, s.used)).collect();
        for pid in self.registered_pids() {
            if let Some(&b) = seen.and_then(|s| s.get(&pid)) {
                let e = held.entry(pid).or_default();
                *e = (*e).max(b);
            }
        }
        held.into_iter().max_by_key(|&(pid, b)| (b, pid))
    }

    fn registered_pids(&self) -> Vec<i32> {
        let pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        pids.keys().copied().collect()
    }

    /// Drops an exited process at once (what its connection's close does,
    /// for a reclaim that cannot wait for it): a prune that takes every
    /// other process for alive.
    fn forget(&self, pid: i32) {
        self.prune_by(|p| p != pid);
    }

    /// A latency-tier process's slot in each of its share's QoS pages,
    /// claimed once per process; `None` for other tiers or when a page's
    /// slots are all taken (none is then held).
    fn qos_slots(&self, pid: i32) -> Option<Vec<Holder>> {
        let q = self.qos.as_ref().filter(|q| q.tier == Tier::Latency)?;
        let mut holders = self.holders.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = holders.get(&pid) {
            return Some(h.clone());
        }
        let mut hs = Vec::with_capacity(q.pages.len());
        for d in &q.pages {
            let Some(h) = d.page.claim(pid) else {
                q.release(&hs);
                tracing::warn!(pid, container = %self.container,
                    "every latency slot of a GPU's QoS page is taken: the process runs as a plain share");
                return None;
            };
            match qos_page::make_flag(d.index, h.slot) {
                Ok(f) => {
                    d.flags().insert(h.slot, Arc::new(f));
                }
                Err(e) => {
                    d.page.release(h);
                    q.release(&hs);
                    tracing::warn!(pid, container = %self.container, error = %e,
                        "making a latency flag: the process runs as a plain share");
                    return None;
                }
            }
            hs.push(h);
        }
        holders.insert(pid, hs.clone());
        Some(hs)
    }

    fn release_qos(&self, pid: i32) {
        let holder = self
            .holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&pid);
        if let (Some(q), Some(hs)) = (&self.qos, holder) {
            q.release(&hs);
        }
    }

    fn drop_conn(&self, pid: i32) {
        let mut pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(e) = pids.get_mut(&pid) else { return };
        e.0 -= 1;
        if e.0 == 0 {
            self.release_qos(pid);
            let (_, slots) = pids.remove(&pid).unwrap();
            if let Some(s) = slots {
                let freed = self.clear(&s);
                tracing::debug!(pid, slots = ?s, ?freed, "ledger slots cleared");
            }
            self.write_pids(&pids);
        }
    }

    /// Removes PIDs whose process is gone (a backstop: closing the
    /// connection normally does it) and clears every ledger slot a dead
    /// process still holds (one that died while no daemon watched its
    /// connection: a daemon restart took the ledger back with it). Returns
    /// how many PIDs and slots went.
    fn prune(&self) -> usize {
        self.prune_by(alive)
    }

    /// [`Procs::prune`] of the processes `alive` says are gone.
    fn prune_by(&self, alive: impl Fn(i32) -> bool) -> usize {
        let mut pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        let dead: Vec<i32> = pids.keys().copied().filter(|&p| !alive(p)).collect();
        for p in &dead {
            self.release_qos(*p);
            if let Some((_, Some(s))) = pids.remove(p) {
                self.clear(&s);
            }
        }
        if !dead.is_empty() {
            self.write_pids(&pids);
        }
        // Under the lock: a slot being claimed belongs to a live PID.
        let reclaimed: usize = self
            .ledgers
            .iter()
            .map(|(l, _)| l.reclaim_dead(&alive).len())
            .sum();
        if reclaimed > 0 {
            tracing::info!(container = %self.container, reclaimed, "ledger slots of dead processes cleared");
        }
        dead.len() + reclaimed
    }
}

/// Whether a host PID is alive (the manager runs in the host PID namespace).
pub fn alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks that the PID exists; it sends nothing.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// A container's counters kept by its interposers in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerCounters {
    pub throttled_ns: u64,
    pub refused_allocations: u64,
    /// The compute controller cannot attribute NVML samples to the
    /// container (`Ledger::compute_unattributed`, non-zero).
    pub compute_unattributed: bool,
    /// Bytes held above its memory quota (borrowed, for a share with a
    /// limit above it).
    pub borrowed_bytes: u64,
    /// Its processes ended to give borrowed memory back.
    pub reclaims: u64,
    /// Time its batch-tier launches waited for a latency-tier tenant
    /// (`Ledger::qos_held_ns`, its GPUs summed).
    pub qos_held_ns: u64,
}

/// A GPU's figures across its shares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuFigures {
    /// Time batch launches on it were held for latency work, all
    /// processes (the QoS page's counter; 0 without tiered shares).
    pub batch_held_ns: u64,
    pub batch_holds: u64,
    /// A tiered share serves on it (the counters above are its page's).
    pub tiered: bool,
    /// Memory its shares hold above their guarantees.
    pub memory_lent_bytes: u64,
}

#[derive(Clone, Default)]
pub struct Registry {
    endpoints: Arc<Mutex<HashMap<String, Endpoint>>>,
    lending: Arc<memory::Lending>,
}

impl Registry {
    /// Serves `<dir>/vcuda.sock` for a one-GPU container until
    /// [`Registry::stop`]. PIDs already in `pids.config` that are still
    /// alive are kept (a restarted manager); the ledger is never truncated.
    pub fn serve(
        &self,
        id: &str,
        dir: &Path,
        pod_uid: &str,
        container: &str,
        ledger: Option<(Ledger, File)>,
    ) -> std::io::Result<()> {
        self.serve_gpus(id, dir, pod_uid, container, ledger.into_iter().collect())
    }

    /// [`Registry::serve`] for a container with one ledger per GPU of its
    /// share, in the order of `vcuda-gpus.config`'s records (the files
    /// `quota_config::ledger_file(i)`). With two or more, only protocol-2
    /// clients are accepted; each gets a slot in every ledger and all the
    /// descriptors, in that order.
    pub fn serve_gpus(
        &self,
        id: &str,
        dir: &Path,
        pod_uid: &str,
        container: &str,
        ledgers: Vec<(Ledger, File)>,
    ) -> std::io::Result<()> {
        self.serve_share(id, dir, pod_uid, container, ledgers, ShareExtras::default())
    }

    /// Where reclaims of borrowed memory are reported (the daemon's Events).
    pub fn on_reclaim(&self, sink: ReclaimSink) {
        self.lending.on_reclaim(sink);
    }

    /// What a reclaim believes over the ledgers (the daemon's NVML).
    pub fn memory_witness(&self, w: MemoryWitness) {
        self.lending.witnessed_by(w);
    }

    fn shares(&self) -> Vec<Arc<Procs>> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|e| e.procs.clone())
            .collect()
    }

    /// [`Registry::serve_gpus`] with the share's compute tier and its GPUs'
    /// QoS pages (one per ledger), which every registering process gets
    /// (latency-tier ones with a slot in it), and its memory guarantees and
    /// limit.
    pub fn serve_share(
        &self,
        id: &str,
        dir: &Path,
        pod_uid: &str,
        container: &str,
        ledgers: Vec<(Ledger, File)>,
        extras: ShareExtras,
    ) -> std::io::Result<()> {
        self.stop(id);
        let qos = extras.qos.filter(|q| q.pages.len() == ledgers.len());
        let sock = dir.join(quota_config::SOCKET_FILE);
        let _ = std::fs::remove_file(&sock);
        let listener = UnixListener::bind(&sock)?;
        let bound = file_id(&sock);
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666))?;
        let old: BTreeMap<i32, (u32, Option<Slots>)> =
            std::fs::read(dir.join(quota_config::PIDS_FILE))
                .ok()
                .and_then(|b| quota_config::decode_pids(&b).ok())
                .unwrap_or_default()
                .into_iter()
                .filter(|&p| alive(p))
                // No connection yet: the process reconnects on its own (or is pruned).
                .map(|p| (p, (0, None)))
                .collect();
        let procs = Arc::new(Procs {
            dir: dir.to_path_buf(),
            pod_uid: pod_uid.to_string(),
            container: container.to_string(),
            ledgers,
            pids: Mutex::new(old),
            conns: AtomicUsize::new(0),
            logs: LogBudget::default(),
            qos,
            holders: Mutex::new(HashMap::new()),
            memory: extras.memory,
            reclaims: Default::default(),
        });
        procs.prune();
        let cancel = CancellationToken::new();
        let (c, p, reg) = (cancel.clone(), procs.clone(), self.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    _ = c.cancelled() => return,
                    a = listener.accept() => a,
                };
                match conn {
                    Ok((stream, _)) => {
                        let Some(guard) = ConnGuard::new(&p) else {
                            if p.logs.take() != Allowance::Drop {
                                tracing::warn!(container = %p.container, max = MAX_CONNS,
                                    "registration refused: the container holds the most connections allowed");
                            }
                            continue;
                        };
                        let (c, reg) = (c.clone(), reg.clone());
                        tokio::spawn(async move {
                            let p = &guard.0;
                            if let Err(e) = wire::handle(stream, p, &reg, &c).await
                                && let Allowance::Log { dropped } = p.logs.take()
                            {
                                tracing::warn!(container = %p.container, error = %e, dropped,
                                    "registration connection");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept on vcuda.sock");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                id.to_string(),
                Endpoint {
                    cancel,
                    procs,
                    bound,
                },
            );
        Ok(())
    }

    pub fn stop(&self, id: &str) {
        if let Some(e) = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id)
        {
            e.cancel.cancel();
            let sock = e.procs.dir.join(quota_config::SOCKET_FILE);
            if e.bound.is_some() && file_id(&sock) == e.bound {
                let _ = std::fs::remove_file(sock);
            }
        }
    }

    /// The vm directory a container is served in.
    pub fn dir(&self, id: &str) -> Option<PathBuf> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .map(|e| e.procs.dir.clone())
    }

    /// Registered host PIDs of a container.
    pub fn pids(&self, id: &str) -> Vec<i32> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .map(|e| e.procs.registered_pids())
            .unwrap_or_default()
    }

    /// The container's ledger counters: (ns its launches slept for compute
    /// tokens, allocations refused for its memory quota), summed over the
    /// GPUs of its share. `None` when the container is not served or keeps
    /// no ledger.
    pub fn ledger_counters(&self, id: &str) -> Option<LedgerCounters> {
        let eps = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let procs = &eps.get(id)?.procs;
        let ledgers = &procs.ledgers;
        if ledgers.is_empty() {
            return None;
        }
        let borrowed_bytes = match procs.memory.gpus.as_slice() {
            [g] => ledgers[0].0.used().saturating_sub(g.guarantee),
            _ => 0,
        };
        Some(LedgerCounters {
            borrowed_bytes,
            reclaims: procs.reclaims.load(Ordering::Relaxed),
            throttled_ns: ledgers.iter().map(|(l, _)| l.throttled_ns()).sum(),
            refused_allocations: ledgers.iter().map(|(l, _)| l.refused_allocations()).sum(),
            compute_unattributed: ledgers.iter().any(|(l, _)| l.compute_unattributed() != 0),
            qos_held_ns: ledgers.iter().map(|(l, _)| l.qos_held_ns()).sum(),
        })
    }

    /// A GPU's QoS and lending figures (docs/qos.md), for the display.
    pub fn gpu_figures(&self, uuid: &str) -> GpuFigures {
        let shares = self.shares();
        // The batch shares' own counts of their held launches on the GPU
        // (their ledgers: the GPU's page is the agent's alone).
        let (mut held_ns, mut holds, mut tiered) = (0, 0, false);
        for p in &shares {
            let Some(i) = p.memory.gpus.iter().position(|g| g.uuid == uuid) else {
                continue;
            };
            tiered |= p.qos.is_some();
            if let Some((l, _)) = p.ledgers.get(i) {
                held_ns += l.qos_held_ns();
                holds += l.qos_holds();
            }
        }
        let (_, uses) = memory::members(&shares, uuid);
        GpuFigures {
            batch_held_ns: held_ns,
            batch_holds: holds,
            tiered,
            memory_lent_bytes: memory::lent(&uses),
        }
    }

    /// [`Self::gpu_figures`] of a GPU and of the MIG devices (`instances`,
    /// by UUID) its shares run in, summed: each instance has a page of its
    /// own, and the display shows the GPU.
    pub fn gpu_figures_with(&self, uuid: &str, instances: &[&str]) -> GpuFigures {
        let mut all = self.gpu_figures(uuid);
        for f in instances.iter().map(|m| self.gpu_figures(m)) {
            all.batch_held_ns += f.batch_held_ns;
            all.batch_holds += f.batch_holds;
            all.tiered |= f.tiered;
            all.memory_lent_bytes += f.memory_lent_bytes;
        }
        all
    }

    pub fn prune(&self) -> usize {
        let eps: Vec<Arc<Procs>> = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|e| e.procs.clone())
            .collect();
        eps.iter().map(|p| p.prune()).sum()
    }
}

#[cfg(test)]
mod tests;
