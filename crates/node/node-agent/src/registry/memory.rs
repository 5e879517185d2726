//! Memory requests below limits (docs/qos.md, "Memory"): a share's quota
//! is its guarantee; a one-GPU share with a limit above it may borrow
//! memory no share on its GPU is guaranteed, and gives it back — its
//! process is ended — when a guaranteed allocation needs it.
//!
//! Why the node agent decides and not the interposers among themselves:
//! lending is a judgement over every share of a GPU (what is guaranteed,
//! what is lent, who borrowed most), and the agent already holds every
//! ledger. An interposer reserves within its quota alone, without asking
//! (the hot path is unchanged); only an allocation that would take its
//! share above the quota asks here (`MemoryRequest` BORROW), and the agent
//! makes the reservation in the process's ledger slot under a per-GPU
//! lock, so two borrowers can never lend out the same bytes. What is lent
//! is always read from the ledgers (used above quota, per borrower), never
//! kept as a counter of its own: a process that dies, a daemon restart or
//! a tenant writing its ledger cannot make it drift; and each ledger is
//! believed only up to what its share may hold, above that only as far as
//! the driver confirms ([`believed`]), so a ledger written up takes
//! nothing from the others.
//!
//! Whom a reclaim ends is judged on what the driver says each process
//! holds (NVML, the daemon's [`MemoryWitness`]) where it says more than the
//! ledger: a tenant that writes its ledger down would otherwise have an
//! honest borrower ended in its place, and the guaranteed allocation
//! refused.
//!
//! The decisions are the pure functions at the top; [`Lending`] applies
//! them to the registry's shares.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use vcuda_api::vcuda::memory_request::Kind;
use vcuda_api::vcuda::memory_response::Status;
use vcuda_api::vcuda::{MemoryRequest, MemoryResponse};

use super::Procs;

/// One GPU a share's ledger counts memory on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerGpu {
    pub uuid: String,
    /// The share's quota on it: what it is guaranteed.
    pub guarantee: u64,
    /// The GPU's memory (what lending is judged against).
    pub card_bytes: u64,
}

/// What the registry knows of a share's memory: a [`LedgerGpu`] per
/// ledger, in record order, and the limit a one-GPU share may borrow up to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShareMemory {
    pub gpus: Vec<LedgerGpu>,
    /// Bytes above the guarantee it may hold; 0 (or not above the
    /// guarantee): it never borrows.
    pub limit: u64,
}

impl ShareMemory {
    /// The limit, when the share borrows (one GPU, above its guarantee).
    pub fn borrow_limit(&self) -> Option<u64> {
        match self.gpus.as_slice() {
            [g] if self.limit > g.guarantee => Some(self.limit),
            _ => None,
        }
    }

    /// What the share may hold on the GPU of its `ledger`-th ledger: its
    /// limit when it borrows, else its guarantee there.
    pub fn may_hold(&self, ledger: usize) -> u64 {
        self.borrow_limit().unwrap_or(self.gpus[ledger].guarantee)
    }
}

/// A borrower's process ended to give memory back: what the daemon turns
/// into an Event and a log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reclaimed {
    /// The borrower's pod (or claim) UID and container (or request slot).
    pub owner: String,
    pub slot: String,
    pub pid: i32,
    pub gpu: String,
    /// Bytes its share held above its guarantee when it was chosen.
    pub borrowed: u64,
    pub guarantee: u64,
    /// The share whose guaranteed allocation needed the memory.
    pub for_owner: String,
    pub for_slot: String,
}

impl Reclaimed {
    pub fn describe(&self) -> String {
        format!(
            "process {} was ended to reclaim GPU memory: its share held {} MiB above its \
             guarantee of {} MiB on GPU {}, and the share {}/{} needed memory it is guaranteed",
            self.pid,
            mib(self.borrowed),
            mib(self.guarantee),
            self.gpu,
            self.for_owner,
            self.for_slot
        )
    }
}

pub type ReclaimSink = Arc<dyn Fn(&Reclaimed) + Send + Sync>;

/// Bytes each process (host PID) holds on the GPU of this UUID as its
/// driver counts them; `None` when it cannot say.
pub type MemoryWitness = Arc<dyn Fn(&str) -> Option<HashMap<i32, u64>> + Send + Sync>;

fn mib(b: u64) -> u64 {
    b / (1024 * 1024)
}

/// One share's use of a GPU, as the decisions see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Use {
    pub guarantee: u64,
    pub used: u64,
    /// It may borrow (has a limit above its guarantee).
    pub borrower: bool,
}

impl Use {
    fn borrowed(&self) -> u64 {
        self.used.saturating_sub(self.guarantee)
    }
}

/// Memory of the card no share is guaranteed.
pub fn lendable(card: u64, uses: &[Use]) -> u64 {
    card.saturating_sub(uses.iter().map(|u| u.guarantee).sum())
}

/// Memory held above guarantees: what is lent out.
pub fn lent(uses: &[Use]) -> u64 {
    uses.iter().map(Use::borrowed).sum()
}

/// Bytes share `me` may still allocate: up to its limit, from its
/// guarantee's rest and what is left to lend.
pub fn may_take(card: u64, uses: &[Use], me: usize, limit: u64) -> u64 {
    let u = uses[me];
    let own = u.guarantee.saturating_sub(u.used);
    let pool = lendable(card, uses).saturating_sub(lent(uses));
    limit.saturating_sub(u.used).min(own + pool)
}

/// What a share is believed to hold of a GPU, its ledger saying `ledger`
/// (a number its tenant can write): all of it up to `cap`, what the share
/// may hold (its limit when it borrows, else its guarantee); above that
/// only as far as the driver says its processes hold (`held`; memory the
/// driver took on its own is real, a number written up is not), and no
/// further than `cap` when the driver cannot say. So no tenant shrinks
/// what the others may borrow beyond what its own limit lets it take.
pub fn believed(ledger: u64, cap: u64, held: Option<u64>) -> u64 {
    if ledger <= cap {
        return ledger;
    }
    ledger.min(cap.max(held.unwrap_or(0)))
}

/// The borrower to reclaim first: the one holding the most above its
/// guarantee (not `not`, the share asking).
pub fn victim(uses: &[Use], not: usize) -> Option<usize> {
    uses.iter()
        .enumerate()
        .filter(|&(i, u)| i != not && u.borrower && u.borrowed() > 0)
        .max_by_key(|(_, u)| u.borrowed())
        .map(|(i, _)| i)
}

/// How long a reclaim waits for an ended process's memory to come back.
const GONE_WITHIN: Duration = Duration::from_secs(10);
/// Borrowers one RECLAIM may end.
const MAX_VICTIMS: usize = 8;

/// The registry's lending state: a lock per GPU and where reclaims go.
#[derive(Default)]
pub struct Lending {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    sink: Mutex<Option<ReclaimSink>>,
    witness: Mutex<Option<MemoryWitness>>,
}

/// A share on the GPU in question, and which of its ledgers counts there.
type Member = (Arc<Procs>, usize);

impl Lending {
    pub fn on_reclaim(&self, sink: ReclaimSink) {
        *self.sink.lock().unwrap_or_else(PoisonError::into_inner) = Some(sink);
    }

    pub fn witnessed_by(&self, w: MemoryWitness) {
        *self.witness.lock().unwrap_or_else(PoisonError::into_inner) = Some(w);
    }

    /// What the witness says processes hold on `gpu` now.
    fn seen(&self, gpu: &str) -> Option<HashMap<i32, u64>> {
        let w = self
            .witness
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()?;
        w(gpu)
    }

    fn lock_of(&self, gpu: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut l = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        l.entry(gpu.to_string()).or_default().clone()
    }

    /// Answers one request of process `pid` of share `me`; `shares` lists
    /// every served share (read again after each change).
    pub(super) async fn answer(
        &self,
        me: &Arc<Procs>,
        pid: i32,
        req: &MemoryRequest,
        shares: impl Fn() -> Vec<Arc<Procs>>,
    ) -> MemoryResponse {
        let refuse = |message: String| MemoryResponse {
            status: Status::Refused as i32,
            message,
            ..Default::default()
        };
        let Some(gpu) = me.memory.gpus.first().filter(|_| me.memory.gpus.len() == 1) else {
            return refuse("memory requests concern one-GPU shares only".into());
        };
        let Some(slot) = me.slot_of(pid) else {
            return refuse(format!("process {pid} holds no ledger slot"));
        };
        let lock = self.lock_of(&gpu.uuid);
        let _held = lock.lock().await;
        let members = || {
            let (m, mut uses) = members(&shares(), &gpu.uuid);
            believe(&m, &mut uses, || self.seen(&gpu.uuid));
            (m, uses)
        };
        match Kind::try_from(req.kind) {
            Ok(Kind::Borrow) => borrow(me, slot, req.bytes, members),
            Ok(Kind::Info) => {
                let (m, uses) = members();
                let i = position(&m, me);
                let limit = me.memory.may_hold(0);
                MemoryResponse {
                    status: Status::Granted as i32,
                    available: may_take(gpu.card_bytes, &uses, i, limit),
                    ..Default::default()
                }
            }
            Ok(Kind::Reclaim) => self.reclaim(me, &gpu.uuid, req.bytes, members).await,
            _ => refuse(format!("unknown memory request kind {}", req.kind)),
        }
    }

    /// Ends borrowers on the GPU, most borrowed first, until `bytes` came
    /// back or none is left.
    async fn reclaim(
        &self,
        me: &Arc<Procs>,
        gpu: &str,
        bytes: u64,
        members: impl Fn() -> (Vec<Member>, Vec<Use>),
    ) -> MemoryResponse {
        let (m, uses) = members();
        let i = position(&m, me);
        if uses[i].used > uses[i].guarantee {
            return MemoryResponse {
                status: Status::Refused as i32,
                message: "the share holds more than its quota: nothing is reclaimed for it".into(),
                ..Default::default()
            };
        }
        let mut reclaimed = 0u64;
        for _ in 0..MAX_VICTIMS {
            if reclaimed >= bytes {
                break;
            }
            let (m, mut uses) = members();
            let seen = self.seen(gpu);
            if let Some(seen) = &seen {
                witnessed(&m, &mut uses, seen);
            }
            let i = position(&m, me);
            let Some(v) = victim(&uses, i) else { break };
            let (procs, ledger) = &m[v];
            let Some((pid, _)) = procs.largest_process(*ledger, seen.as_ref()) else {
                break;
            };
            let r = Reclaimed {
                owner: procs.pod_uid.clone(),
                slot: procs.container.clone(),
                pid,
                gpu: procs.memory.gpus[*ledger].uuid.clone(),
                borrowed: uses[v].borrowed(),
                guarantee: uses[v].guarantee,
                for_owner: me.pod_uid.clone(),
                for_slot: me.container.clone(),
            };
            end_process(pid, &r.describe());
            wait_gone(procs, pid).await;
            procs.reclaims.fetch_add(1, Ordering::Relaxed);
            reclaimed += r.borrowed;
            tracing::warn!(owner = %r.owner, container = %r.slot, "{}", r.describe());
            let sink = self
                .sink
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            if let Some(s) = sink {
                s(&r);
            }
        }
        if reclaimed == 0 {
            return MemoryResponse {
                status: Status::Refused as i32,
                message: "no memory is lent out on the GPU".into(),
                ..Default::default()
            };
        }
        MemoryResponse {
            status: Status::Granted as i32,
            reclaimed,
            ..Default::default()
        }
    }
}

/// Reserves `bytes` for a borrower's process: within its limit, and only
/// while what is lent on the GPU stays within what nobody is guaranteed
/// (checked after the reservation, so a concurrent allocation within a
/// quota, which never asks, is counted too).
fn borrow(
    me: &Arc<Procs>,
    slot: usize,
    bytes: u64,
    members: impl Fn() -> (Vec<Member>, Vec<Use>),
) -> MemoryResponse {
    let refuse = |message: String, available: u64| MemoryResponse {
        status: Status::Refused as i32,
        message,
        available,
        ..Default::default()
    };
    let gpu = &me.memory.gpus[0];
    let Some(limit) = me.memory.borrow_limit() else {
        return refuse("the share has no memory limit above its quota".into(), 0);
    };
    let ledger = &me.ledgers[0].0;
    if let Err(over) = ledger.try_reserve_within(slot, bytes, limit) {
        return refuse(
            format!("over the share's memory limit: {over}"),
            over.available,
        );
    }
    let (_, uses) = members();
    let (lent, lendable) = (lent(&uses), lendable(gpu.card_bytes, &uses));
    if lent > lendable {
        ledger.release(slot, bytes);
        let (m, uses) = members();
        let available = may_take(gpu.card_bytes, &uses, position(&m, me), limit);
        return refuse(
            format!(
                "GPU {} has {} MiB nobody is guaranteed and {} MiB of it would be lent: \
                 {bytes} bytes cannot be borrowed",
                gpu.uuid,
                mib(lendable),
                mib(lent)
            ),
            available,
        );
    }
    MemoryResponse {
        status: Status::Granted as i32,
        ..Default::default()
    }
}

/// Every served share's ledger on `gpu`, with its use.
pub(super) fn members(shares: &[Arc<Procs>], gpu: &str) -> (Vec<Member>, Vec<Use>) {
    let mut m = Vec::new();
    let mut uses = Vec::new();
    for p in shares {
        let borrower = p.memory.borrow_limit().is_some();
        for (i, g) in p.memory.gpus.iter().enumerate() {
            let Some((l, _)) = p.ledgers.get(i) else {
                continue;
            };
            if g.uuid == gpu {
                uses.push(Use {
                    guarantee: g.guarantee,
                    used: l.used(),
                    borrower,
                });
                m.push((p.clone(), i));
            }
        }
    }
    (m, uses)
}

/// Each member's use as the larger of its ledger's and what the witness
/// says its registered processes hold.
fn witnessed(m: &[Member], uses: &mut [Use], seen: &HashMap<i32, u64>) {
    for ((procs, _), u) in m.iter().zip(uses.iter_mut()) {
        u.used = u.used.max(held_by(procs, seen));
    }
}

/// What the witness says a share's registered processes hold.
fn held_by(procs: &Procs, seen: &HashMap<i32, u64>) -> u64 {
    procs
        .registered_pids()
        .iter()
        .filter_map(|p| seen.get(p))
        .sum()
}

/// Each member's use as [`believed`]; the witness is asked only when a
/// ledger says more than its share may hold.
fn believe(m: &[Member], uses: &mut [Use], seen: impl FnOnce() -> Option<HashMap<i32, u64>>) {
    let cap = |(procs, ledger): &Member| procs.memory.may_hold(*ledger);
    if m.iter().zip(uses.iter()).all(|(x, u)| u.used <= cap(x)) {
        return;
    }
    let seen = seen();
    for (x, u) in m.iter().zip(uses.iter_mut()) {
        let held = seen.as_ref().map(|s| held_by(&x.0, s));
        u.used = believed(u.used, cap(x), held);
    }
}

fn position(m: &[Member], me: &Arc<Procs>) -> usize {
    m.iter()
        .position(|(p, _)| Arc::ptr_eq(p, me))
        .expect("a share asking is served")
}

/// Tells the process why (a line on its stderr, which is its container's
/// log), then ends it as the kernel's OOM killer would: SIGKILL.
fn end_process(pid: i32, why: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking: a full pipe must not stall the reclaim.
    let stderr = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/{pid}/fd/2"));
    if let Ok(mut f) = stderr {
        let _ = writeln!(f, "vcuda: {why}");
    }
    // SAFETY: kill(2) with a PID and a signal number; no memory is passed.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Waits until `pid` no longer holds GPU memory: its registration closed
/// (the kernel closed its descriptors, so the driver freed its memory) or
/// the process is gone or a zombie; then its ledger slots are cleared.
async fn wait_gone(procs: &Procs, pid: i32) {
    let start = Instant::now();
    while start.elapsed() < GONE_WITHIN {
        if !procs.registered(pid) || exited(pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if exited(pid) {
        procs.forget(pid);
    } else {
        tracing::error!(
            pid,
            "a reclaimed process did not end within {GONE_WITHIN:?}"
        );
    }
}

/// Whether the process has exited (gone, or a zombie not yet reaped).
fn exited(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command's closing parenthesis.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_none_or(|c| c == 'Z' || c == 'X'),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn u(guarantee: u64, used: u64, borrower: bool) -> Use {
        Use {
            guarantee: guarantee * G,
            used: used * G,
            borrower,
        }
    }

    #[test]
    fn the_issues_example_lends_twelve_then_eight_is_guaranteed() {
        // A burstable 4 GiB / 12 GiB share alone on a 16 GiB card.
        let alone = [u(4, 4, true)];
        assert_eq!(lendable(16 * G, &alone), 12 * G);
        assert_eq!(may_take(16 * G, &alone, 0, 12 * G), 8 * G);
        // It filled to its limit; then an 8 GiB guaranteed share came.
        let both = [u(4, 12, true), u(8, 0, false)];
        assert_eq!(lendable(16 * G, &both), 4 * G);
        assert_eq!(
            lent(&both),
            8 * G,
            "over-lent: a guaranteed allocation reclaims"
        );
        assert_eq!(victim(&both, 1), Some(0));
        assert_eq!(may_take(16 * G, &both, 0, 12 * G), 0);
    }

    #[test]
    fn the_victim_is_the_largest_borrower_never_the_asker_nor_a_guaranteed_share() {
        let uses = [u(2, 5, true), u(2, 9, true), u(4, 6, false), u(1, 1, true)];
        assert_eq!(victim(&uses, 3), Some(1));
        assert_eq!(
            victim(&uses, 1),
            Some(0),
            "the asker itself is never chosen"
        );
        // Above its quota without a limit (memory the driver took on its
        // own): not a borrower, never ended for it.
        assert_eq!(victim(&[u(4, 6, false), u(1, 0, false)], 1), None);
    }

    #[test]
    fn a_ledger_is_believed_up_to_its_cap_and_above_it_as_far_as_the_driver_says() {
        let cap = 4 * G;
        assert_eq!(believed(3 * G, cap, None), 3 * G);
        assert_eq!(believed(3 * G, cap, Some(0)), 3 * G, "within: the ledger");
        // Written up to 12: the driver says 1 (or nothing), so the cap.
        assert_eq!(believed(12 * G, cap, Some(G)), cap);
        assert_eq!(believed(12 * G, cap, None), cap);
        // The driver took 6 on its own: real, counted; never past the ledger.
        assert_eq!(believed(6 * G, cap, Some(6 * G)), 6 * G);
        assert_eq!(believed(6 * G, cap, Some(9 * G)), 6 * G);
    }

    #[test]
    fn a_share_within_its_guarantee_may_take_the_rest_of_it_and_the_pool() {
        let uses = [u(4, 1, true), u(4, 6, true)];
        // 16 - 8 = 8 lendable, 2 lent: 6 in the pool, 3 of its own.
        assert_eq!(may_take(16 * G, &uses, 0, 12 * G), 9 * G);
        // Its limit caps it.
        assert_eq!(may_take(16 * G, &uses, 0, 5 * G), 4 * G);
        // Guarantees over the card (placement never does this): nothing to lend.
        assert_eq!(lendable(4 * G, &uses), 0);
    }
}
