//! CDI device resolution as a runtime does it (containerd's `enable_cdi`):
//! a fully qualified ID `vendor/class=name` names a device in one of the
//! spec files (`*.json`) of the CDI directories, whose `kind` is
//! `vendor/class`; the container gets the spec's own `containerEdits`
//! (once per spec) and then that device's.

use std::path::Path;

use serde_json::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CdiError {
    #[error("{0:?} is not a qualified CDI device ID (vendor/class=name)")]
    BadId(String),
    #[error("CDI device {0:?} is in no spec")]
    Unresolved(String),
    #[error("CDI spec {path}: {problem}")]
    BadSpec { path: String, problem: String },
}

/// Checks a spec's shape against what the CDI JSON schema
/// (container-device-interface `schema/schema.json`, `defs.json`) requires:
/// `cdiVersion`, `kind` as `vendor/class`, devices with a name and edits
/// whose device nodes have a path and mounts host and container paths.
pub fn validate(spec: &Value) -> Result<(), String> {
    let s = |p: &str| spec.pointer(p).and_then(Value::as_str);
    let version = s("/cdiVersion").ok_or("cdiVersion missing")?;
    if !version.split('.').all(|p| p.parse::<u32>().is_ok()) || version.split('.').count() != 3 {
        return Err(format!("cdiVersion {version:?} is not a version"));
    }
    let kind = s("/kind").ok_or("kind missing")?;
    if kind.split('/').count() != 2 || kind.split('/').any(str::is_empty) {
        return Err(format!("kind {kind:?} is not vendor/class"));
    }
    let devices = spec
        .get("devices")
        .and_then(Value::as_array)
        .ok_or("devices missing")?;
    for d in devices {
        let name = d
            .get("name")
            .and_then(Value::as_str)
            .ok_or("a device without a name")?;
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.:-".contains(c))
        {
            return Err(format!(
                "device name {name:?} has characters CDI does not allow"
            ));
        }
        let e = d
            .get("containerEdits")
            .ok_or(format!("device {name}: containerEdits missing"))?;
        validate_edits(&format!("device {name}"), e)?;
    }
    if let Some(e) = spec.get("containerEdits") {
        validate_edits("the spec's containerEdits", e)?;
    }
    Ok(())
}

/// The checks on one `containerEdits` (a device's or the spec's own).
fn validate_edits(who: &str, e: &Value) -> Result<(), String> {
    for n in e
        .get("deviceNodes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        n.get("path")
            .and_then(Value::as_str)
            .ok_or(format!("{who}: a deviceNode without path"))?;
        if let Some(p) = n.get("permissions")
            && !p
                .as_str()
                .is_some_and(|p| p.chars().all(|c| "rwm".contains(c)))
        {
            return Err(format!(
                "{who}: deviceNode permissions {p} are not of r, w, m"
            ));
        }
    }
    for m in e
        .get("mounts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(o) = m.get("options")
            && !o.as_array().is_some_and(|o| o.iter().all(Value::is_string))
        {
            return Err(format!(
                "{who}: mount options {o} are not an array of strings"
            ));
        }
        for f in ["hostPath", "containerPath"] {
            m.get(f)
                .and_then(Value::as_str)
                .ok_or(format!("{who}: a mount without {f}"))?;
        }
    }
    for v in e.get("env").and_then(Value::as_array).into_iter().flatten() {
        if !v.as_str().is_some_and(|v| v.contains('=')) {
            return Err(format!("{who}: env entry {v} is not KEY=VALUE"));
        }
    }
    Ok(())
}

/// The container edits of `id` from the specs in `dir`.
pub fn resolve(dir: &Path, id: &str) -> Result<Value, CdiError> {
    let (kind, name) = id
        .split_once('=')
        .ok_or_else(|| CdiError::BadId(id.into()))?;
    if !kind.contains('/') {
        return Err(CdiError::BadId(id.into()));
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let bad = |problem: String| CdiError::BadSpec {
            path: p.display().to_string(),
            problem,
        };
        let spec: Value =
            serde_json::from_slice(&std::fs::read(&p).map_err(|e| bad(e.to_string()))?)
                .map_err(|e| bad(e.to_string()))?;
        validate(&spec).map_err(bad)?;
        if spec.get("kind").and_then(Value::as_str) != Some(kind) {
            continue;
        }
        for d in spec["devices"].as_array().into_iter().flatten() {
            if d.get("name").and_then(Value::as_str) == Some(name) {
                return Ok(merge(spec.get("containerEdits"), &d["containerEdits"]));
            }
        }
    }
    Err(CdiError::Unresolved(id.into()))
}

/// The spec's edits, then the device's: lists are concatenated.
fn merge(common: Option<&Value>, device: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for e in common.into_iter().chain([device]) {
        for (k, v) in e.as_object().into_iter().flatten() {
            let list = out.entry(k.clone()).or_insert_with(|| Value::Array(vec![]));
            if let (Some(l), Some(v)) = (list.as_array_mut(), v.as_array()) {
                l.extend(v.iter().cloned());
            }
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schema_requirements() {
        let good = json!({"cdiVersion": "0.6.0", "kind": "vcuda.tencent.com/gpu", "devices": [{
            "name": "u1-gpu", "containerEdits": {"env": ["A=b"],
            "deviceNodes": [{"path": "/dev/nvidia0", "permissions": "rwm"}],
            "mounts": [{"hostPath": "/h", "containerPath": "/c", "options": ["ro", "rbind"]}]}}]});
        assert_eq!(validate(&good), Ok(()));
        let break_at = |ptr: &str, v: Value| {
            let mut s = good.clone();
            *s.pointer_mut(ptr).unwrap() = v;
            validate(&s).unwrap_err()
        };
        assert!(break_at("/kind", json!("gpu")).contains("vendor/class"));
        assert!(break_at("/cdiVersion", json!("six")).contains("cdiVersion"));
        assert!(break_at("/devices/0/name", json!("a/b")).contains("characters"));
        assert!(
            break_at("/devices/0/containerEdits/env/0", json!("novalue")).contains("KEY=VALUE")
        );
        assert!(
            break_at("/devices/0/containerEdits/mounts/0/options", json!("ro"))
                .contains("array of strings")
        );
        assert!(
            break_at(
                "/devices/0/containerEdits/deviceNodes/0/permissions",
                json!("x")
            )
            .contains("r, w, m")
        );
        assert!(
            break_at(
                "/devices/0/containerEdits/mounts/0",
                json!({"hostPath": "/h"})
            )
            .contains("containerPath")
        );
    }

    /// The spec's own edits come with every device of it, before the
    /// device's, and are checked like a device's.
    #[test]
    fn spec_edits_come_with_each_device() {
        let dir = tempfile::tempdir().unwrap();
        let spec = json!({"cdiVersion": "0.6.0", "kind": "v.io/gpu",
            "containerEdits": {"env": ["A=1"], "mounts": [{"hostPath": "/h", "containerPath": "/etc/vcuda"}]},
            "devices": [
                {"name": "d0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
                {"name": "d1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}], "env": ["B=2"]}}]});
        std::fs::write(dir.path().join("s.json"), spec.to_string()).unwrap();
        let e = resolve(dir.path(), "v.io/gpu=d1").unwrap();
        assert_eq!(e["env"], json!(["A=1", "B=2"]));
        assert_eq!(e["mounts"][0]["containerPath"], "/etc/vcuda");
        assert_eq!(e["deviceNodes"], json!([{"path": "/dev/nvidia1"}]));
        let mut bad = spec.clone();
        bad["containerEdits"]["env"] = json!(["novalue"]);
        assert!(
            validate(&bad)
                .unwrap_err()
                .starts_with("the spec's containerEdits")
        );
    }
}
