//! Objects, resource versions and the event log watches replay from.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Pod,
    Node,
    /// events.k8s.io/v1 Event (what `kubectl describe` lists under a pod).
    Event,
    /// resource.k8s.io/v1 ResourceSlice (cluster-scoped): a DRA driver's devices.
    ResourceSlice,
    /// resource.k8s.io/v1 DeviceClass (cluster-scoped).
    DeviceClass,
    /// resource.k8s.io/v1 ResourceClaim (namespaced).
    ResourceClaim,
}

impl Kind {
    pub fn namespaced(self) -> bool {
        matches!(self, Kind::Pod | Kind::Event | Kind::ResourceClaim)
    }
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
            Kind::Event => "Event",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::DeviceClass => "DeviceClass",
            Kind::ResourceClaim => "ResourceClaim",
        }
    }
    /// The `apiVersion` of its objects and lists.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Event => "events.k8s.io/v1",
            Kind::ResourceSlice | Kind::DeviceClass | Kind::ResourceClaim => "resource.k8s.io/v1",
            Kind::Pod | Kind::Node => "v1",
        }
    }
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Node => "nodes",
            Kind::Event => "events",
            Kind::ResourceSlice => "resourceslices",
            Kind::DeviceClass => "deviceclasses",
            Kind::ResourceClaim => "resourceclaims",
        }
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    #[error("{kind} {name:?} not found")]
    NotFound { kind: &'static str, name: String },
    #[error("{kind} {name:?} already exists")]
    AlreadyExists { kind: &'static str, name: String },
    #[error(
        "Operation cannot be fulfilled on {plural} {name:?}: the object has been modified; please apply your changes to the latest version and try again"
    )]
    Conflict { plural: &'static str, name: String },
    #[error("invalid object: {0}")]
    Invalid(String),
}

impl StoreError {
    pub fn code(&self) -> u16 {
        match self {
            StoreError::NotFound { .. } => 404,
            StoreError::AlreadyExists { .. } | StoreError::Conflict { .. } => 409,
            StoreError::Invalid(_) => 422,
        }
    }
    pub fn reason(&self) -> &'static str {
        match self {
            StoreError::NotFound { .. } => "NotFound",
            StoreError::AlreadyExists { .. } => "AlreadyExists",
            StoreError::Conflict { .. } => "Conflict",
            StoreError::Invalid(_) => "Invalid",
        }
    }
}

/// One change, as a watch reports it.
#[derive(Clone, Debug)]
pub struct Event {
    pub rv: u64,
    pub kind: Kind,
    /// ADDED, MODIFIED or DELETED.
    pub typ: &'static str,
    pub object: Value,
    /// The object before a modification (a watch with a field selector turns
    /// a modification that stops matching into DELETED).
    pub previous: Option<Value>,
}

type Key = (Kind, String, String);

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    log: Vec<Event>,
    conflicts: u32,
}

pub struct Shared {
    store: Mutex<Store>,
    events: broadcast::Sender<Event>,
    patches: AtomicU64,
    uid_seq: AtomicU64,
}

fn resource_version(obj: &Value) -> Option<&str> {
    obj.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
}

/// `obj` names a resourceVersion, and not `current`'s (optimistic
/// concurrency: a write naming one must name the current one).
fn stale(obj: &Value, current: &Value) -> bool {
    resource_version(obj).is_some_and(|want| resource_version(current) != Some(want))
}

/// Identity is not writable: `obj` gets `current`'s name, namespace, uid
/// and creation time (or none where `current` has none).
fn keep_identity(obj: &mut Value, current: &Value) {
    for f in ["name", "namespace", "uid", "creationTimestamp"] {
        match current["metadata"].get(f) {
            Some(v) => obj["metadata"][f] = v.clone(),
            None => {
                if let Some(m) = obj["metadata"].as_object_mut() {
                    m.remove(f);
                }
            }
        }
    }
}

fn not_found(kind: Kind, name: &str) -> StoreError {
    StoreError::NotFound {
        kind: kind.kind(),
        name: name.to_string(),
    }
}

fn name_of(obj: &Value) -> Option<String> {
    obj.pointer("/metadata/name")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// RFC 3339 UTC timestamp, seconds resolution, as Kubernetes writes them.
pub fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// JSON merge patch (RFC 7386): objects merge, `null` deletes, the rest replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let t = target.as_object_mut().unwrap();
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

impl Shared {
    pub fn new() -> Self {
        Self {
            store: Mutex::default(),
            events: broadcast::Sender::new(4096),
            patches: AtomicU64::new(0),
            uid_seq: AtomicU64::new(0),
        }
    }

    fn key(kind: Kind, ns: Option<&str>, name: &str) -> Key {
        let ns = if kind.namespaced() {
            ns.unwrap_or("default")
        } else {
            ""
        };
        (kind, ns.to_string(), name.to_string())
    }

    fn record(
        &self,
        st: &mut Store,
        kind: Kind,
        typ: &'static str,
        object: Value,
        previous: Option<Value>,
    ) {
        let ev = Event {
            rv: st.rv,
            kind,
            typ,
            object,
            previous,
        };
        st.log.push(ev.clone());
        // No receivers is fine: nobody watches yet.
        let _ = self.events.send(ev);
    }

    pub fn create(
        &self,
        kind: Kind,
        ns: Option<&str>,
        mut obj: Value,
    ) -> Result<Value, StoreError> {
        let name =
            name_of(&obj).ok_or_else(|| StoreError::Invalid("metadata.name is required".into()))?;
        let mut st = self.store.lock().unwrap();
        let ns = if kind.namespaced() {
            Some(
                obj.pointer("/metadata/namespace")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .or(ns.map(str::to_string))
                    .unwrap_or_else(|| "default".into()),
            )
        } else {
            None
        };
        let key = Self::key(kind, ns.as_deref(), &name);
        if st.objects.contains_key(&key) {
            return Err(StoreError::AlreadyExists {
                kind: kind.kind(),
                name,
            });
        }
        st.rv += 1;
        let rv = st.rv;
        let seq = self.uid_seq.fetch_add(1, Ordering::Relaxed);
        let meta = obj
            .as_object_mut()
            .ok_or_else(|| StoreError::Invalid("not an object".into()))?
            .entry("metadata")
            .or_insert_with(|| json!({}));
        let m = meta.as_object_mut().unwrap();
        if let Some(ns) = &ns {
            m.insert("namespace".into(), json!(ns));
        }
        m.entry("uid")
            .or_insert_with(|| json!(format!("00000000-0000-4000-8000-{:012x}", seq + 1)));
        m.entry("creationTimestamp")
            .or_insert_with(|| json!(now_rfc3339()));
        m.insert("resourceVersion".into(), json!(rv.to_string()));
        obj["kind"] = json!(kind.kind());
        obj["apiVersion"] = json!(kind.api_version());
        // The API server starts objects at generation 1 (only the
        // resource.k8s.io kinds here: the others' tests predate it).
        if kind.api_version() == "resource.k8s.io/v1" {
            obj["metadata"]["generation"] = json!(1);
        }
        st.objects.insert(key, obj.clone());
        self.record(&mut st, kind, "ADDED", obj.clone(), None);
        Ok(obj)
    }

    pub fn get(&self, kind: Kind, ns: Option<&str>, name: &str) -> Option<Value> {
        let st = self.store.lock().unwrap();
        st.objects.get(&Self::key(kind, ns, name)).cloned()
    }

    pub fn list(&self, kind: Kind) -> Vec<Value> {
        self.list_with_rv(kind).0
    }

    /// Objects of a kind and the resource version they are current at.
    pub fn list_with_rv(&self, kind: Kind) -> (Vec<Value>, u64) {
        let st = self.store.lock().unwrap();
        let items = st
            .objects
            .iter()
            .filter(|(k, _)| k.0 == kind)
            .map(|(_, v)| v.clone())
            .collect();
        (items, st.rv)
    }

    pub fn inject_conflicts(&self, n: u32) {
        self.store.lock().unwrap().conflicts = n;
    }

    pub fn patch_requests(&self) -> u64 {
        self.patches.load(Ordering::Relaxed)
    }

    pub fn patch(
        &self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        patch: &Value,
    ) -> Result<Value, StoreError> {
        self.patches.fetch_add(1, Ordering::Relaxed);
        let mut st = self.store.lock().unwrap();
        let key = Self::key(kind, ns, name);
        let Some(current) = st.objects.get(&key).cloned() else {
            return Err(not_found(kind, name));
        };
        let conflict = StoreError::Conflict {
            plural: kind.plural(),
            name: name.to_string(),
        };
        if st.conflicts > 0 {
            st.conflicts -= 1;
            return Err(conflict);
        }
        // Optimistic concurrency: a patch naming a resourceVersion must name the current one.
        if stale(patch, &current) {
            return Err(conflict);
        }
        let mut obj = current.clone();
        merge_patch(&mut obj, patch);
        // Identity is not patchable.
        keep_identity(&mut obj, &current);
        st.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        st.objects.insert(key, obj.clone());
        self.record(&mut st, kind, "MODIFIED", obj.clone(), Some(current));
        Ok(obj)
    }

    /// PUT: replaces the object (or only its `status` when `status_only`).
    /// A `metadata.resourceVersion` in `obj` must be the current one;
    /// identity is kept. `metadata.generation` goes up when the spec changed.
    pub fn replace(
        &self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        mut obj: Value,
        status_only: bool,
    ) -> Result<Value, StoreError> {
        let mut st = self.store.lock().unwrap();
        let key = Self::key(kind, ns, name);
        let Some(current) = st.objects.get(&key).cloned() else {
            return Err(not_found(kind, name));
        };
        if name_of(&obj).is_some_and(|n| n != name) {
            return Err(StoreError::Invalid(format!(
                "metadata.name does not match the URL's {name:?}"
            )));
        }
        if stale(&obj, &current) {
            return Err(StoreError::Conflict {
                plural: kind.plural(),
                name: name.to_string(),
            });
        }
        if status_only {
            let mut next = current.clone();
            next["status"] = obj.get("status").cloned().unwrap_or(Value::Null);
            obj = next;
        } else {
            // The status subresource is not written through the main resource.
            if let Some(s) = current.get("status") {
                obj["status"] = s.clone();
            } else if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
            let generation = current
                .pointer("/metadata/generation")
                .and_then(Value::as_i64);
            let bump = current.get("spec") != obj.get("spec");
            if let Some(g) = generation {
                obj["metadata"]["generation"] = json!(if bump { g + 1 } else { g });
            }
        }
        keep_identity(&mut obj, &current);
        obj["kind"] = json!(kind.kind());
        obj["apiVersion"] = json!(kind.api_version());
        st.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        st.objects.insert(key, obj.clone());
        self.record(&mut st, kind, "MODIFIED", obj.clone(), Some(current));
        Ok(obj)
    }

    pub fn delete(&self, kind: Kind, ns: Option<&str>, name: &str) -> Result<Value, StoreError> {
        let mut st = self.store.lock().unwrap();
        let key = Self::key(kind, ns, name);
        let Some(mut obj) = st.objects.remove(&key) else {
            return Err(not_found(kind, name));
        };
        st.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        self.record(&mut st, kind, "DELETED", obj.clone(), None);
        Ok(obj)
    }

    /// Every logged change of `kind`, oldest first.
    pub fn history(&self, kind: Kind) -> Vec<(&'static str, Value)> {
        let st = self.store.lock().unwrap();
        st.log
            .iter()
            .filter(|e| e.kind == kind)
            .map(|e| (e.typ, e.object.clone()))
            .collect()
    }

    /// For a watch from `since`: the logged events after it and a receiver
    /// for what comes next, taken under one lock so nothing falls between.
    /// `since == 0` means "from now, with the current objects as ADDED".
    pub fn watch_from(&self, kind: Kind, since: u64) -> (Vec<Event>, broadcast::Receiver<Event>) {
        let st = self.store.lock().unwrap();
        let rx = self.events.subscribe();
        let backlog = if since == 0 {
            st.objects
                .iter()
                .filter(|(k, _)| k.0 == kind)
                .map(|(_, v)| Event {
                    rv: st.rv,
                    kind,
                    typ: "ADDED",
                    object: v.clone(),
                    previous: None,
                })
                .collect()
        } else {
            st.log
                .iter()
                .filter(|e| e.kind == kind && e.rv > since)
                .cloned()
                .collect()
        };
        (backlog, rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_rfc7386() {
        let mut t = json!({"a": {"b": 1, "c": 2}, "d": [1]});
        merge_patch(&mut t, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
        assert_eq!(t, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
    }

    #[test]
    fn timestamp_shape() {
        let s = now_rfc3339();
        assert_eq!(s.len(), 20, "{s}");
        assert!(s.ends_with('Z') && s.as_bytes()[10] == b'T');
    }

    #[test]
    fn create_patch_delete_and_conflicts() {
        let s = Shared::new();
        let p = s
            .create(Kind::Pod, None, json!({"metadata": {"name": "a"}}))
            .unwrap();
        assert_eq!(p["metadata"]["namespace"], "default");
        assert_eq!(p["metadata"]["resourceVersion"], "1");
        let p2 = s
            .patch(
                Kind::Pod,
                Some("default"),
                "a",
                &json!({"metadata": {"annotations": {"x": "1"}, "uid": "evil"}}),
            )
            .unwrap();
        assert_eq!(p2["metadata"]["annotations"]["x"], "1");
        assert_eq!(p2["metadata"]["uid"], p["metadata"]["uid"]);
        let stale = json!({"metadata": {"resourceVersion": "1", "annotations": {"y": "1"}}});
        assert_eq!(
            s.patch(Kind::Pod, Some("default"), "a", &stale)
                .unwrap_err()
                .code(),
            409
        );
        s.inject_conflicts(1);
        let ok = json!({"metadata": {"annotations": {"y": "1"}}});
        assert!(s.patch(Kind::Pod, Some("default"), "a", &ok).is_err());
        assert!(s.patch(Kind::Pod, Some("default"), "a", &ok).is_ok());
        let (backlog, _rx) = s.watch_from(Kind::Pod, 1);
        assert_eq!(backlog.len(), 2);
        s.delete(Kind::Pod, Some("default"), "a").unwrap();
        assert!(s.get(Kind::Pod, Some("default"), "a").is_none());
    }
}
