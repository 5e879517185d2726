//! Allocate: which pending pod's container asks (kubelet does not say),
//! where it goes (the allocator, or gpu-admission's predicate), its vm
//! directory and socket, the checkpoint, the answer.
//!
//! The state lock is held only to decide and reserve; the container's
//! files are written outside it, then the allocation is recorded.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::refusal::Refusal;
use device_plugin::api::ContainerAllocateResponse;
use gpu_allocator::{AllocError, ErrorKind, GpuInfo, MEMORY_UNIT_BYTES, Placement, Request};
use k8s_openapi::api::core::v1::{ContainerState, ContainerStatus, Pod};

use super::restore::RESEND_S;
use super::state::State;
use super::{Manager, now};
use crate::allocation::{Allocation, alloc_id};
use crate::decide::pods;
use crate::decide::response::{self, ResponseInput};
use crate::world::{ApiHealth, PatchJob};
use node_agent::events::{self, PodEvent};
use node_agent::vm;

/// How long Allocate waits for a just-created pod to reach the reflector.
/// kubelet can admit a pod before a loaded API server's watch delivers it
/// here (over 1 s seen on the real-node suite's busy machine); a refusal
/// then fails the pod for good (UnexpectedAdmissionError), so waiting is
/// cheap by comparison. Allocate calls are serial in kubelet anyway.
const POD_WAIT: Duration = Duration::from_secs(5);
/// How long an Allocate waits for kubelet's pod-resources `List`.
const KUBELET_LIST: Duration = Duration::from_secs(1);

/// A pod's namespace and name, as kubelet's List names it.
fn key(p: &Pod) -> (String, String) {
    (pods::namespace(p).to_string(), pods::name(p).to_string())
}

/// When an Allocate started and what finding its pod cost (logged with the
/// answer: where the time of a slow Allocate went).
struct Found {
    started: Instant,
    /// Until the pod was found (kubelet's List and any wait for the pod
    /// watch included).
    found_us: u64,
    /// In kubelet's pod-resources List.
    list_us: u64,
}

fn alloc_refusal(e: AllocError) -> Refusal {
    match e.kind() {
        ErrorKind::InvalidRequest => Refusal::invalid(e.to_string()),
        ErrorKind::Insufficient => Refusal::exhausted(e.to_string()),
        ErrorKind::State => Refusal::internal(e.to_string()),
    }
}

/// The pod's soft limit ceiling (`tencent.com/vcuda-core-limit`), if it
/// has one; a value that is not 1..100 is refused, naming it.
fn soft_limit(pod: &Pod) -> Result<Option<u32>, Refusal> {
    let Some(v) = pods::annotation(pod, pods::VCORE_LIMIT) else {
        return Ok(None);
    };
    let (ns, name) = (pods::namespace(pod), pods::name(pod));
    v.trim()
        .parse::<u32>()
        .ok()
        .filter(|l| (1..=100).contains(l))
        .map(Some)
        .ok_or_else(|| {
            Refusal::invalid(format!(
                "pod {ns}/{name}: annotation {}={v:?} must be a number 1..100",
                pods::VCORE_LIMIT
            ))
        })
}

/// The pod's memory limit (`tencent.com/vcuda-memory-limit`) for a
/// container's request, if it has one: a quantity, for a one-GPU share,
/// not below its memory. Equal to it: no limit.
fn memory_ceiling(pod: &Pod, ctx: &str, req: &Request) -> Result<Option<u64>, Refusal> {
    let memory = req.memory_units * MEMORY_UNIT_BYTES;
    gpu_pods::memory_limit(pod, req.cores >= 100, req.gpus, memory)
        .map_err(|e| Refusal::invalid(format!("{ctx}: {e}")))
}

/// Whether two lists of device IDs hold the same IDs, order aside.
fn same_ids(a: &[String], b: &[String]) -> bool {
    a.len() == b.len() && a.iter().collect::<BTreeSet<_>>() == b.iter().collect::<BTreeSet<_>>()
}

/// Whether the pod is past admission: finished, being deleted, or one of
/// its containers (init ones too) has run, which kubelet lets happen only
/// once it has allocated devices to all of them.
fn past_admission(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let ran = |s: &Option<ContainerState>| {
        s.as_ref()
            .is_some_and(|s| s.running.is_some() || s.terminated.is_some())
    };
    let started = |c: &ContainerStatus| ran(&c.state) || ran(&c.last_state);
    let mut statuses = pod.status.iter().flat_map(|s| {
        let init = s.init_container_statuses.iter().flatten();
        init.chain(s.container_statuses.iter().flatten())
    });
    matches!(phase, Some("Succeeded" | "Failed"))
        || pod.metadata.deletion_timestamp.is_some()
        || statuses.any(started)
}

impl Manager {
    /// The pending pods `select_in_order` would pick from `pods`.
    fn select(&self, pods: &[Arc<Pod>], cores: u64) -> Option<pods::Candidate> {
        let st = self.st();
        pods::select_in_order(
            pods,
            cores,
            |uid, c| st.allocs.contains_key(&alloc_id(uid, c)),
            |uid| st.withdrawn.contains(uid),
            |uid| self.pods.seen(uid),
        )
    }

    /// The pods kubelet admits or runs now, if it says (within a second).
    async fn kubelet_active(&self) -> Option<BTreeSet<(String, String)>> {
        match tokio::time::timeout(KUBELET_LIST, self.kubelet.active_pods()).await {
            Ok(Ok(v)) => Some(v.into_iter().collect()),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "kubelet's active pods unknown: guessing among every pending pod");
                None
            }
            Err(_) => None,
        }
    }

    /// The pod that asks; `list_us` gets the time spent in kubelet's List.
    ///
    /// kubelet's List is taken once: kubelet adds a pod to its pod manager
    /// before it admits it, so the asking pod is in the first answer. A pod
    /// it lists that the watch has not brought is waited for, not read from
    /// the API server: the watch's order is what says the deletions before
    /// it were seen (and released) too. Reading it directly once placed a
    /// pod on capacity a deleted pod still held here (k8s_node's trace: a
    /// predicate mismatch).
    async fn find_candidate(
        &self,
        cores: u64,
        list_us: &mut u64,
    ) -> Result<pods::Candidate, Refusal> {
        let deadline = Instant::now() + POD_WAIT;
        // Only a pod kubelet is admitting can be the one asking: one it
        // refused (no healthy devices while the manager was down) still
        // looks Pending in the API server for a while, and a guess of it
        // made every later guess wrong on the 1.36 node. Read before the
        // List, so a pod the watch brings meanwhile is never missed.
        let mut seen = self.pods.generation();
        let listed = Instant::now();
        let active = self.kubelet_active().await;
        *list_us = listed.elapsed().as_micros() as u64;
        loop {
            let pods = self.pods.pods();
            let admitted: Vec<Arc<Pod>> = match &active {
                Some(a) => pods
                    .iter()
                    .filter(|p| a.contains(&key(p)))
                    .cloned()
                    .collect(),
                None => pods.clone(),
            };
            if let Some(c) = self.select(&admitted, cores) {
                return Ok(c);
            }
            if !self.wait_for_pods(&mut seen, deadline).await {
                if active.is_some()
                    && let Some(c) = self.select(&self.pods.pods(), cores)
                {
                    tracing::warn!(pod = %pods::name(&c.pod), "kubelet lists no pending pod that fits this Allocate: guessing among every pending pod");
                    return Ok(c);
                }
                return Err(self.no_pod(cores, &pods));
            }
        }
    }

    /// Waits for the pod watch to move past `seen` (updated) until
    /// `deadline`; false when it did not.
    async fn wait_for_pods(&self, seen: &mut u64, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !self.pods.changed_since(*seen, left).await {
            return false;
        }
        *seen = self.pods.generation();
        true
    }

    /// Why no pod could be found for an Allocate of `cores`.
    fn no_pod(&self, cores: u64, pods: &[Arc<Pod>]) -> Refusal {
        if self.pods.health() == ApiHealth::Starting {
            return Refusal::unavailable(format!(
                "the manager has not listed this node's pods from the API server yet; cannot tell which pod asks for vcuda-core {cores}; kubelet will retry"
            ));
        }
        if let ApiHealth::Failing(e) = self.pods.health() {
            return Refusal::unavailable(format!(
                "no pending pod on node {} asks for vcuda-core {cores}, and the API server is unreachable ({e}); kubelet will retry",
                self.config.node_name
            ));
        }
        Refusal::precondition(format!(
            "no pending, unassigned pod on node {} has a container asking for vcuda-core {cores} \
             (pending GPU containers: {}); was the pod deleted, or already allocated?",
            self.config.node_name,
            pods::describe_pending(pods)
        ))
    }

    /// The placement gpu-admission chose (`predicate-gpu-idx-<i>`), checked
    /// against this node's state; errors name both sides.
    fn predicated(
        &self,
        st: &State,
        pod: &Pod,
        cand: &pods::Candidate,
        req: &Request,
        ours: &Placement,
        profile: Option<&str>,
    ) -> Result<Option<Placement>, Refusal> {
        let Some(minors) = pods::predicate_minors(pod, cand.container_index) else {
            return Ok(None);
        };
        let instance = gpu_pods::predicate_instance(pod, cand.container_index);
        let key = format!("{}{}", pods::PREDICATE_GPU_IDX_PREFIX, cand.container_index);
        let minors = minors.map_err(Refusal::invalid)?;
        let mut gpus = Vec::new();
        for m in &minors {
            let g = self.gpus.iter().find(|g| g.minor == *m).ok_or_else(|| {
                Refusal::precondition(format!(
                    "gpu-admission chose GPU /dev/nvidia{m} ({key}), which this node does not have (its GPUs: {})",
                    self.gpus.iter().map(|g| format!("/dev/nvidia{}", g.minor)).collect::<Vec<_>>().join(",")
                ))
            })?;
            gpus.push(g.index);
        }
        let mine = ours
            .gpus()
            .iter()
            .map(|&g| format!("/dev/nvidia{}", self.gpus[g].minor))
            .collect::<Vec<_>>()
            .join(",");
        let theirs = minors
            .iter()
            .map(|m| format!("/dev/nvidia{m}"))
            .collect::<Vec<_>>()
            .join(",");
        let recorded = if profile.is_some() || instance.is_some() {
            gpu_pods::recorded_in_instance(req, profile, &gpus, instance)
                .map(Some)
                .map_err(|e| Refusal::precondition(format!("predicate mismatch ({key}): {e}")))?
        } else {
            req.placement_on(&gpus)
        };
        let placement = recorded.ok_or_else(|| {
            Refusal::precondition(format!(
                "predicate mismatch: gpu-admission chose {theirs} ({key}) for vcuda-core {}, \
                 but that request needs {} GPU(s); the manager would choose {mine}",
                cand.cores,
                ours.gpus().len()
            ))
        })?;
        let mut probe = st.allocator.clone();
        if let Err(e) = probe.commit("predicate-probe", &placement) {
            return Err(Refusal::precondition(format!(
                "predicate mismatch: gpu-admission chose {theirs} ({key}), but on this node it does not fit ({e}); \
                 the manager would choose {mine}"
            )));
        }
        Ok(Some(placement))
    }

    /// `Allocate` for vcuda-core: find the pod, place, write the vm
    /// directory, checkpoint, answer.
    pub async fn allocate_vcore(
        &self,
        device_ids: Vec<String>,
    ) -> Result<ContainerAllocateResponse, Refusal> {
        let _serial = self.alloc_lock.lock().await;
        if let Err(e) = self.health() {
            return Err(Refusal::unavailable(format!(
                "{e}; kubelet retries once the manager is restarted"
            )));
        }
        let started = Instant::now();
        self.st().last_allocate = started;
        if let Some((a, pod)) = self.repeated(&device_ids) {
            let r = self.answer_again(&a, &pod);
            return self.said_on(&pod, r);
        }
        let cores = device_ids.len() as u64;
        self.release_holders_of(&device_ids);
        let mut list_us = 0;
        let cand = self.find_candidate(cores, &mut list_us).await?;
        let found = Found {
            started,
            found_us: started.elapsed().as_micros() as u64,
            list_us,
        };
        let pod = cand.pod.clone();
        let r = self.allocate_for(cand, device_ids, found).await;
        self.said_on(&pod, r)
    }

    /// A refusal said on the pod too: kubelet shows only a generic
    /// admission error.
    fn said_on(
        &self,
        pod: &Pod,
        r: Result<ContainerAllocateResponse, Refusal>,
    ) -> Result<ContainerAllocateResponse, Refusal> {
        if let Err(s) = &r {
            self.events.post(PodEvent {
                namespace: pods::namespace(pod).to_string(),
                name: pods::name(pod).to_string(),
                uid: pods::uid(pod).to_string(),
                reason: events::ALLOCATE_FAILED,
                note: s.message().to_string(),
            });
        }
        r
    }

    /// The allocation and pod of an Allocate that repeats the one that
    /// made it: a supervisor resends the call a manager process died
    /// under, after it had booked and persisted it but before it answered.
    /// Only a booking restored at start with no answer seen by kubelet
    /// (`resendable`, for [`RESEND_S`]) qualifies: within one process a
    /// call is answered or refused, and the same IDs come again only for
    /// another container (kubelet let the first pod go). Its IDs are
    /// exactly these and its pod is still listed and not past admission.
    fn repeated(&self, device_ids: &[String]) -> Option<(Allocation, Arc<Pod>)> {
        let a = {
            let mut st = self.st();
            st.resendable
                .retain(|_, t| t.elapsed() < Duration::from_secs(RESEND_S));
            let a = st
                .allocs
                .values()
                .find(|a| same_ids(&a.vcore_ids, device_ids))
                .cloned()?;
            st.resendable.remove(&a.id())?;
            a
        };
        let pod = self
            .pods
            .pods()
            .into_iter()
            .find(|p| pods::uid(p) == a.pod_uid)?;
        (!a.verified && !past_admission(&pod)).then_some((a, pod))
    }

    /// The first answer again, for a repeated Allocate (see
    /// [`Self::repeated`]); the pod's patch is submitted again, as the
    /// process that died may not have sent it.
    fn answer_again(
        &self,
        a: &Allocation,
        pod: &Pod,
    ) -> Result<ContainerAllocateResponse, Refusal> {
        let ctx = format!(
            "pod {}/{} container {}",
            a.namespace, a.pod_name, a.container
        );
        tracing::info!(
            pod = %format!("{}/{}", a.namespace, a.pod_name), container = %a.container, id = %a.id(),
            "Allocate repeated for an allocation already made (a supervisor resent it after the manager process died?): answering it again"
        );
        let internal = |e: String| Refusal::internal(format!("{ctx}: {e}"));
        // The path the first answer mounted. Its files are left as they are
        // (recovery rewrote them, or the first call did in this process);
        // missing (wiped, or recovery failed to write them), they are
        // written the way that call did, which is safe: no container of
        // the pod has started, so none mounts the old directory.
        let dir = self
            .shares
            .vm()
            .dir(&a.pod_uid, &a.container)
            .map_err(|e| internal(e.to_string()))?;
        if !dir.join(quota_config::CONFIG_FILE).is_file() {
            self.open_files(a).map_err(|e| internal(e.to_string()))?;
        }
        let patch = self.patch_if_complete(&self.st(), pod);
        if let Some(job) = patch {
            self.patcher.submit(job);
        }
        Ok(self.answer(a, &dir))
    }

    /// The answer for an allocation whose vm directory is `dir`: the first
    /// Allocate's and a repeat's alike.
    fn answer(&self, a: &Allocation, dir: &Path) -> ContainerAllocateResponse {
        let placement = Placement::from(&a.placement);
        if let Placement::InMig { gpu, instance, .. } = &placement
            && let Some(r) = self.answer_in_mig(a, dir, *gpu, instance)
        {
            return r;
        }
        response::build(&ResponseInput {
            gpus: placement.gpus().iter().map(|&g| &self.gpus[g]).collect(),
            cores: a.cores,
            memory_units: a.memory_units,
            shared: !placement.is_exclusive(),
            vdriver_dir: &self.config.vdriver_dir,
            vm_dir: dir,
            extra_devices: &self.extra.devices,
        })
    }

    /// Allocate for the container that asks: checked names and soft limit,
    /// then (1) the capacity reserved, (2) its files and socket, (3) the
    /// allocation recorded and durable (each undone if a later one fails),
    /// the pod's patch submitted, the answer.
    async fn allocate_for(
        &self,
        cand: pods::Candidate,
        device_ids: Vec<String>,
        found: Found,
    ) -> Result<ContainerAllocateResponse, Refusal> {
        let cores = device_ids.len() as u64;
        let pod = cand.pod.clone();
        let (uid, ns, name) = (pods::uid(&pod), pods::namespace(&pod), pods::name(&pod));
        vm::check_pod_uid(uid).map_err(|e| Refusal::invalid(e.to_string()))?;
        vm::check_container_name(&cand.container).map_err(|e| Refusal::invalid(e.to_string()))?;
        let soft_limit = soft_limit(&pod)?;
        let tier = pods::tier(&pod).map_err(Refusal::invalid)?;
        let ctx = format!("pod {ns}/{name} container {}", cand.container);
        let req = self.request(&ctx, &cand)?;
        let profile = gpu_pods::mig_profile(&pod).map_err(Refusal::invalid)?;
        let memory_ceiling = memory_ceiling(&pod, &ctx, &req)?;
        let id = alloc_id(uid, &cand.container);
        // The watch delivered this pod after every deletion before it: free
        // those first, so the placement (and gpu-admission's, made after
        // them) is judged on the same state, not on one the release task
        // has not caught up with.
        self.release_deleted_pods();
        // 1. Decide and reserve the capacity, under the state lock.
        let placement = self.reserve(&ctx, &cand, (&req, profile.as_deref()), &id)?;
        let gpus: Vec<&GpuInfo> = placement.gpus().iter().map(|&g| &self.gpus[g]).collect();
        let mut alloc = Allocation {
            pod_uid: uid.to_string(),
            namespace: ns.to_string(),
            pod_name: name.to_string(),
            container: cand.container.clone(),
            container_index: cand.container_index,
            // The container's totals (a share on N GPUs: N × each GPU's).
            cores: u32::try_from(cores).unwrap_or(u32::MAX),
            memory_units: match &placement {
                Placement::Exclusive { .. } => gpus.iter().map(|g| g.memory_units()).sum(),
                p => req.memory_units * p.gpus().len() as u64,
            },
            memory_limit: cand.memory_units,
            placement: (&placement).into(),
            soft_limit,
            tier,
            memory_ceiling,
            vcore_ids: device_ids,
            vmemory_ids: vec![],
            verified: false,
            created: now(),
        };
        let undo = || {
            let _ = self.st().allocator.release(&id);
            self.close_files(&id, uid, &cand.container);
        };
        if let Placement::InMig { instance, .. } = &placement
            && !self.knows_instance(instance)
        {
            undo();
            return Err(Refusal::internal(format!(
                "{ctx}: MIG instance {instance} is placed in but its device nodes are unknown"
            )));
        }
        // 2. The container's files and socket, outside the state lock.
        let dir = match self.open_files(&alloc) {
            Ok(d) => d,
            Err(e) => {
                undo();
                return Err(Refusal::internal(format!("{ctx}: {e}")));
            }
        };
        // 3. Recorded, then durable before answering; Allocate calls stay
        // serialised.
        let want = self.record(&mut alloc);
        let synced = Instant::now();
        if let Err(e) = self.persist(want).await {
            {
                let mut st = self.st();
                st.allocs.remove(&id);
                self.changed_lazily(&mut st);
            }
            undo();
            return Err(e.context(&ctx));
        }
        let checkpoint_us = synced.elapsed().as_micros() as u64;
        let patch = {
            let mut st = self.st();
            st.withdrawn.remove(uid);
            self.patch_if_complete(&st, &pod)
        };
        // The API server is patched in the background (never on the RPC).
        if let Some(job) = patch {
            self.patcher.submit(job);
        }
        tracing::info!(
            pod = %format!("{ns}/{name}"), container = %cand.container, uid, %placement,
            took_us = found.started.elapsed().as_micros() as u64, found_us = found.found_us,
            list_us = found.list_us, checkpoint_us, "allocated"
        );
        Ok(self.answer(&alloc, &dir))
    }

    /// The allocator's request for the container: its `vcuda-core` and
    /// `vcuda-memory` totals over the GPUs the pod's `vcuda-gpus`
    /// annotation gives it (one when it does not name it).
    fn request(&self, ctx: &str, cand: &pods::Candidate) -> Result<Request, Refusal> {
        gpu_pods::container_request(
            &cand.pod,
            &cand.container,
            (cand.cores, cand.memory_units),
            self.gpus.len(),
            self.config.share_mode,
        )
        .map_err(|e| match e {
            gpu_pods::RequestError::Annotation(e) => Refusal::invalid(e),
            gpu_pods::RequestError::Split { gpus, error } => Refusal::invalid(format!(
                "{ctx}: annotation {} gives it {gpus} GPUs: {error}",
                pods::VCUDA_GPUS
            )),
        })
    }

    /// Decides where the request goes (the allocator's choice, or
    /// gpu-admission's when it made one) and reserves that capacity, under
    /// the state lock.
    fn reserve(
        &self,
        ctx: &str,
        cand: &pods::Candidate,
        (req, profile): (&Request, Option<&str>),
        id: &str,
    ) -> Result<Placement, Refusal> {
        let mut st = self.st();
        let ours = st.allocator.evaluate_for(req, profile).map_err(|e| {
            let s = alloc_refusal(e);
            s.context(ctx)
        })?;
        let placement = self
            .predicated(&st, &cand.pod, cand, req, &ours, profile)?
            .unwrap_or(ours);
        st.allocator
            .commit(id.to_string(), &placement)
            .map_err(alloc_refusal)?;
        Ok(placement)
    }

    /// Records a new allocation, with vcuda-memory IDs that came before it
    /// (of its size); the state version a write must reach to cover it.
    fn record(&self, alloc: &mut Allocation) -> u64 {
        let mut st = self.st();
        let memory_limit = alloc.memory_limit;
        if let Some(i) = st
            .orphan_memory
            .iter()
            .position(|m| m.len() as u64 == memory_limit)
        {
            alloc.vmemory_ids = st.orphan_memory.remove(i);
        }
        st.allocs.insert(alloc.id(), alloc.clone());
        st.changed()
    }

    /// kubelet hands out only IDs it considers free: an allocation still
    /// holding them belongs to a pod kubelet has let go of.
    fn release_holders_of(&self, device_ids: &[String]) {
        let stale: Vec<String> = {
            let st = self.st();
            st.allocs
                .values()
                .filter(|a| a.vcore_ids.iter().any(|i| device_ids.contains(i)))
                .map(Allocation::id)
                .collect()
        };
        for id in stale {
            tracing::info!(
                id,
                "kubelet reassigned its devices; releasing the old allocation"
            );
            self.release(&id);
        }
    }

    /// The patch that marks a pod assigned, once all its GPU containers are.
    pub(super) fn patch_if_complete(&self, st: &State, pod: &Pod) -> Option<PatchJob> {
        let uid = pods::uid(pod);
        let mut per = BTreeMap::new();
        for (i, c) in pods::gpu_containers(pod) {
            let a = st.allocs.get(&alloc_id(uid, &c))?;
            let p = Placement::from(&a.placement);
            let minors = p.gpus().iter().map(|&g| self.gpus[g].minor).collect();
            let instance = match p {
                Placement::InMig { instance, .. } => Some(instance),
                _ => None,
            };
            per.insert(i, (minors, instance));
        }
        Some(PatchJob {
            namespace: pods::namespace(pod).to_string(),
            name: pods::name(pod).to_string(),
            uid: uid.to_string(),
            annotations: pods::assigned_annotations(&per),
        })
    }

    /// `Allocate` for vcuda-memory: nothing to hand out (vcuda-core's
    /// response carries everything); remember the IDs for PreStart.
    pub fn allocate_vmemory(&self, device_ids: Vec<String>) -> ContainerAllocateResponse {
        let mut st = self.st();
        let n = device_ids.len() as u64;
        let target = st
            .allocs
            .values()
            // Not "unverified": kubelet records after Allocate, so the
            // vcuda-core PreStart may have verified it already.
            .filter(|a| a.vmemory_ids.is_empty() && a.memory_limit == n)
            .max_by_key(|a| a.created)
            .map(Allocation::id);
        match target {
            Some(id) => {
                st.allocs.get_mut(&id).unwrap().vmemory_ids = device_ids;
                // Written with the next write (no sync of its own):
                // kubelet's records have the IDs anyway.
                self.changed_lazily(&mut st);
            }
            None => st.orphan_memory.push(device_ids),
        }
        ContainerAllocateResponse::default()
    }
}
