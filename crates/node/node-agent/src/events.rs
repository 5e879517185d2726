//! What happened to a pod's GPU share, where operators look: a Warning
//! Event on the Pod (`kubectl describe pod`). kubelet reports a refused
//! Allocate only as a generic admission error, a withdrawn wrong guess
//! only as a failed container, and a reclaimed borrower only as exit 137;
//! the Event carries the daemon's own message. Both modes post them (the
//! manager its refusals, guesses and escapes; both daemons reclaims).
//! Each Event names the daemon that posted it (`reportingController`).
//!
//! Events are events.k8s.io/v1 objects created in the background (never on
//! the RPC path); the ClusterRole grants `create` on them and nothing more.
//! The same message for the same pod is posted once a minute at most,
//! since kubelet may retry a refused request in a loop.
//!
//! Why not kube-runtime's `events::Recorder`: it keys a series on (pod,
//! reason, action) without the note, so a second refusal of the same pod
//! for another reason ("no GPU has 80 cores free", later "predicate index
//! 3 is gone") would patch the first Event's count and drop the new
//! message, the one an operator needs; and it patches once per repeat,
//! an API write per kubelet retry, which needs `patch` on events too. Here
//! each distinct message is its own Event, repeats cost nothing, and the
//! ClusterRole keeps `create` only.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::mpsc;

/// Allocate refused for this pod (no fit, bad request, predicate mismatch,
/// a local failure).
pub const ALLOCATE_FAILED: &str = "VcudaAllocateFailed";
/// PreStart found that kubelet gave the devices to another pod than the
/// one guessed at Allocate; the allocation was withdrawn.
pub const WRONG_POD_GUESS: &str = "VcudaWrongPodGuess";
/// The escape guard saw GPU use the interposer did not (gpu-display's
/// `guard`): a process that never registered, a share over its quota.
pub const ESCAPE: &str = "VcudaEscape";
/// A borrower's process was ended to give its borrowed GPU memory back to a
/// guaranteed allocation (docs/qos.md, "Memory").
pub const MEMORY_RECLAIMED: &str = "VcudaMemoryReclaimed";
/// The MIG instance a pod's device (or its claim's) is on was destroyed
/// while the pod held it (docs/mig.md): CUDA on it fails.
pub const MIG_DEVICE_LOST: &str = "VcudaMigDeviceLost";
/// The device-plugin mode's daemon, as its Events name it.
pub const MANAGER: &str = "tencent.com/gpu-manager";
/// The DRA driver, as its Events name it.
pub const DRA_DRIVER: &str = "vcuda.tencent.com/dra-driver";
const REPEAT_AFTER: Duration = Duration::from_secs(60);
const MAX_NOTE: usize = 1024;

/// One Warning about one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEvent {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub reason: &'static str,
    pub note: String,
}

/// Where pod events go: the API server, or memory in tests.
pub trait EventSink: Send + Sync {
    fn post(&self, ev: PodEvent);
}

/// Suppresses repeats of the same (pod, reason, note) within a minute.
#[derive(Default)]
struct Dedup(Mutex<HashMap<(String, &'static str, String), Instant>>);

impl Dedup {
    fn first(&self, ev: &PodEvent) -> bool {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        seen.retain(|_, t| now.duration_since(*t) < REPEAT_AFTER);
        let key = (ev.uid.clone(), ev.reason, ev.note.clone());
        if seen.contains_key(&key) {
            return false;
        }
        seen.insert(key, now);
        true
    }
}

/// Creates the events through the API server, from a background task.
pub struct KubeEvents {
    tx: mpsc::UnboundedSender<PodEvent>,
    dedup: Dedup,
}

impl KubeEvents {
    /// `controller`: the daemon ([`MANAGER`], [`DRA_DRIVER`]); `instance`:
    /// its node name. The Event's `reportingController` and
    /// `reportingInstance`.
    pub fn start(client: Client, controller: &'static str, instance: String) -> KubeEvents {
        let (tx, mut rx) = mpsc::unbounded_channel::<PodEvent>();
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                let api: Api<Event> = Api::namespaced(client.clone(), &ev.namespace);
                let obj = to_event(&ev, controller, &instance);
                match api.create(&PostParams::default(), &obj).await {
                    Ok(_) => {
                        tracing::debug!(pod = %format!("{}/{}", ev.namespace, ev.name), reason = ev.reason, "event posted")
                    }
                    // An event is advice: never retried, never fatal.
                    Err(e) => {
                        tracing::warn!(pod = %format!("{}/{}", ev.namespace, ev.name), reason = ev.reason, error = %e, "posting the pod event failed")
                    }
                }
            }
        });
        KubeEvents {
            tx,
            dedup: Dedup::default(),
        }
    }
}

impl EventSink for KubeEvents {
    fn post(&self, ev: PodEvent) {
        if self.dedup.first(&ev) {
            let _ = self.tx.send(ev);
        }
    }
}

/// What the daemon was doing when it had to say `reason` (the Event's action).
fn action(reason: &str) -> &'static str {
    match reason {
        WRONG_POD_GUESS => "PreStartContainer",
        MEMORY_RECLAIMED => "ReclaimMemory",
        _ => "Allocate",
    }
}

/// The events.k8s.io/v1 object for `ev`, posted by `controller` on `instance`.
pub fn to_event(ev: &PodEvent, controller: &str, instance: &str) -> Event {
    let now = k8s_openapi::jiff::Timestamp::now();
    let mut note = ev.note.clone();
    if note.len() > MAX_NOTE {
        // The API server refuses notes over 1 kB.
        let mut cut = MAX_NOTE - 3;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
        note.push_str("...");
    }
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{:x}", ev.name, now.as_nanosecond())),
            namespace: Some(ev.namespace.clone()),
            ..Default::default()
        },
        event_time: Some(MicroTime(now)),
        reporting_controller: Some(controller.into()),
        reporting_instance: Some(format!("{controller}-{instance}")),
        action: Some(action(ev.reason).into()),
        reason: Some(ev.reason.into()),
        note: Some(note),
        type_: Some("Warning".into()),
        regarding: Some(ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(ev.namespace.clone()),
            name: Some(ev.name.clone()),
            uid: Some(ev.uid.clone()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Keeps what was posted (tests), with the same repeat suppression.
#[derive(Default)]
pub struct MemoryEvents {
    posted: Mutex<Vec<PodEvent>>,
    dedup: Dedup,
}

impl MemoryEvents {
    pub fn posted(&self) -> Vec<PodEvent> {
        self.posted.lock().unwrap().clone()
    }
}

impl EventSink for MemoryEvents {
    fn post(&self, ev: PodEvent) {
        if self.dedup.first(&ev) {
            self.posted.lock().unwrap().push(ev);
        }
    }
}

/// Drops everything (a manager without an API server).
pub struct NoEvents;

impl EventSink for NoEvents {
    fn post(&self, _: PodEvent) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(note: &str) -> PodEvent {
        PodEvent {
            namespace: "ml".into(),
            name: "train".into(),
            uid: "u-1".into(),
            reason: ALLOCATE_FAILED,
            note: note.into(),
        }
    }

    #[test]
    fn repeats_within_a_minute_are_posted_once() {
        let m = MemoryEvents::default();
        m.post(ev("no GPU has 80 cores free"));
        m.post(ev("no GPU has 80 cores free"));
        m.post(ev("another reason"));
        assert_eq!(
            m.posted(),
            vec![ev("no GPU has 80 cores free"), ev("another reason")]
        );
    }

    #[test]
    fn the_event_names_the_pod_and_fits_the_api_limits() {
        let e = to_event(&ev(&"é".repeat(2000)), MANAGER, "node-1");
        let r = e.regarding.unwrap();
        assert_eq!(
            (r.kind.as_deref(), r.name.as_deref(), r.uid.as_deref()),
            (Some("Pod"), Some("train"), Some("u-1"))
        );
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.reason.as_deref(), Some(ALLOCATE_FAILED));
        assert!(e.note.as_ref().unwrap().len() <= MAX_NOTE);
        assert!(e.metadata.name.unwrap().starts_with("train."));
        assert_eq!(
            e.reporting_instance.as_deref(),
            Some("tencent.com/gpu-manager-node-1")
        );
    }
}
