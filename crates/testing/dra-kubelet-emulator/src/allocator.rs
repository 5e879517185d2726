//! A stand-in for the scheduler's DRA allocator, enough for one node and
//! `exactly` requests (count 1) whose DeviceClass selects by driver (and,
//! like the request's own selectors, by attribute: [`crate::selector`]):
//! first fit over the node's published devices, honouring consumable
//! capacity (KEP-5075): a request's `capacity.requests` or the device's
//! request policy default, rounded up to the policy's step, must fit in
//! what the claims already allocated there left over; a device without
//! `allowMultipleAllocations` goes to one claim; a device tainted
//! `NoSchedule` or `NoExecute` (KEP-5055) only to a request that tolerates
//! the taint; a device that consumes shared counters (KEP-4815,
//! partitionable devices: `consumesCounters` against a `sharedCounters`
//! set of its pool) only while every counter it consumes has room left
//! by the devices already allocated, as the scheduler's allocator checks
//! (k8s.io/dynamic-resource-allocation `structured`, the partitionable
//! devices allocator's available-counters check: a pool's counter sets
//! minus what the allocated devices consume, [`crate::counters`]). The allocation (results
//! with `consumedCapacity` and `shareID`, class then claim configs) is
//! written to the claim's status as the scheduler would.

use std::collections::BTreeMap;

use apiserver_emulator::{ApiServer, Kind};
use serde_json::{Value, json};

use crate::counters;
use crate::selector::{self, Cond};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AllocError {
    #[error("ResourceClaim {0} not found")]
    NoClaim(String),
    #[error("claim {claim}: {problem}")]
    Unsupported { claim: String, problem: String },
    #[error("claim {claim}: request {request:?} fits on no device of node {node}")]
    NoFit {
        claim: String,
        request: String,
        node: String,
    },
}

/// Whole numbers with binary or decimal suffixes (what the tests use).
pub(crate) fn qty(v: &Value) -> Option<u128> {
    let s = v
        .as_str()
        .map(str::to_string)
        .or_else(|| v.as_u64().map(|n| n.to_string()))?;
    let i = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: u128 = s[..i].parse().ok()?;
    let m: u128 = match &s[i..] {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return None,
    };
    Some(n * m)
}

/// (driver, pool, device).
pub(crate) type DeviceKey = (String, String, String);

/// Capacity already allocated per device (driver, pool, device) and
/// whether any allocation there is exclusive.
fn in_use(
    api: &ApiServer,
    except_uid: &str,
) -> BTreeMap<DeviceKey, (BTreeMap<String, u128>, bool)> {
    let mut used: BTreeMap<DeviceKey, (BTreeMap<String, u128>, bool)> = BTreeMap::new();
    for c in api.list(Kind::ResourceClaim) {
        if c.pointer("/metadata/uid").and_then(Value::as_str) == Some(except_uid) {
            continue;
        }
        let results = c
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array);
        for r in results.into_iter().flatten() {
            let s = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            let e = used
                .entry((s("driver"), s("pool"), s("device")))
                .or_default();
            match r.get("consumedCapacity").and_then(Value::as_object) {
                Some(cc) => {
                    for (k, v) in cc {
                        *e.0.entry(k.clone()).or_default() += qty(v).unwrap_or(0);
                    }
                }
                None => e.1 = true,
            }
        }
    }
    used
}

/// The CEL expressions of the `selectors` at `pointer` of `v`.
fn cel_selectors(v: &Value, pointer: &str) -> Vec<String> {
    array(v, pointer)
        .filter_map(|s| s.pointer("/cel/expression")?.as_str().map(str::to_string))
        .collect()
}

/// What a request consumes of one capacity, or None when it cannot.
fn consume(cap: &Value, asked: Option<u128>) -> Option<u128> {
    let value = qty(cap.get("value")?)?;
    let policy = cap.get("requestPolicy");
    let want = asked
        .or_else(|| policy.and_then(|p| p.get("default")).and_then(qty))
        .unwrap_or(value);
    let Some(range) = policy.and_then(|p| p.get("validRange")) else {
        return (want <= value).then_some(want);
    };
    let min = range.get("min").and_then(qty).unwrap_or(0);
    let max = range.get("max").and_then(qty).unwrap_or(value);
    let mut q = want.max(min);
    if let Some(step) = range.get("step").and_then(qty).filter(|&s| s > 0) {
        q = min + (q - min).div_ceil(step) * step;
    }
    (q <= max).then_some(q)
}

fn print_qty(n: u128) -> String {
    for (suffix, shift) in [("Gi", 30), ("Mi", 20)] {
        if n != 0 && n.is_multiple_of(1u128 << shift) {
            return format!("{}{suffix}", n >> shift);
        }
    }
    n.to_string()
}

/// Allocates claim `namespace/name` on `node` and writes the allocation;
/// an allocated claim is returned as it is.
pub fn allocate(
    api: &ApiServer,
    namespace: &str,
    name: &str,
    node: &str,
) -> Result<Value, AllocError> {
    let who = format!("{namespace}/{name}");
    let claim = api
        .get(Kind::ResourceClaim, Some(namespace), name)
        .ok_or_else(|| AllocError::NoClaim(who.clone()))?;
    if let Some(a) = claim.pointer("/status/allocation") {
        return Ok(a.clone());
    }
    let uid = claim
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or("");
    let mut used = in_use(api, uid);
    let slices: Vec<Value> = api
        .list(Kind::ResourceSlice)
        .into_iter()
        .filter(|s| s.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node))
        .collect();
    let mut counters = counters::Room::new(&slices, used.keys());
    let mut results = Vec::new();
    let mut config = Vec::new();
    for (n, req) in array(&claim, "/spec/devices/requests").enumerate() {
        let req = resolve(api, req, &who)?;
        let Some(choice) = first_fit(&slices, &used, &counters, &req) else {
            return Err(AllocError::NoFit {
                claim: who,
                request: req.name,
                node: node.to_string(),
            });
        };
        // UUID-shaped and distinct within the claim (the scheduler's are random).
        let share_id = format!(
            "{:08x}-0000-4000-8000-{:012x}",
            n + 1,
            uid.len() as u64 * 1000 + results.len() as u64
        );
        counters.book(&(
            req.driver.clone(),
            choice.pool.clone(),
            choice.device.clone(),
        ));
        results.push(take(&mut used, &req, choice, share_id));
        config.extend(array(&req.class, "/spec/config").map(|c| {
            let mut c = c.clone();
            c["source"] = json!("FromClass");
            c["requests"] = json!([req.name]);
            c
        }));
    }
    // Class configs first, then the claim's: drivers let later ones win.
    config.extend(array(&claim, "/spec/devices/config").map(|c| {
        let mut c = c.clone();
        c["source"] = json!("FromClaim");
        c
    }));
    let allocation = json!({
        "devices": {"results": results, "config": config},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}
    });
    api.patch(
        Kind::ResourceClaim,
        Some(namespace),
        name,
        &json!({"status": {"allocation": allocation}}),
    )
    .map_err(|e| unsupported(&who, e.to_string()))?;
    Ok(allocation)
}

/// The items of the array at `pointer`, none when it is absent.
fn array<'a>(v: &'a Value, pointer: &str) -> impl Iterator<Item = &'a Value> {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn unsupported(who: &str, problem: String) -> AllocError {
    AllocError::Unsupported {
        claim: who.to_string(),
        problem,
    }
}

/// One claim request, checked against what is emulated and resolved to
/// its DeviceClass.
struct Request {
    name: String,
    class: Value,
    driver: String,
    /// The class's and the request's selectors, all of which must match.
    selectors: Vec<Cond>,
    /// `capacity.requests`: what it asks of each consumable capacity.
    asked: serde_json::Map<String, Value>,
    /// `tolerations` of device taints.
    tolerations: Vec<Value>,
}

fn resolve(api: &ApiServer, req: &Value, who: &str) -> Result<Request, AllocError> {
    let name = req
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let ex = req
        .get("exactly")
        .ok_or_else(|| unsupported(who, format!("request {name:?} is not an `exactly` request")))?;
    if ex.get("count").and_then(Value::as_u64).unwrap_or(1) != 1 {
        return Err(unsupported(
            who,
            format!("request {name:?}: only count 1 is emulated"),
        ));
    }
    let class_name = ex
        .get("deviceClassName")
        .and_then(Value::as_str)
        .unwrap_or("");
    let class = api
        .get(Kind::DeviceClass, None, class_name)
        .ok_or_else(|| {
            unsupported(
                who,
                format!("request {name:?}: DeviceClass {class_name:?} not found"),
            )
        })?;
    let mut selectors = Vec::new();
    let exprs = cel_selectors(&class, "/spec/selectors");
    for e in exprs.iter().chain(&cel_selectors(ex, "/selectors")) {
        selectors.extend(selector::parse(e).ok_or_else(|| {
            unsupported(
                who,
                format!("request {name:?}: selector {e:?} is outside the emulated CEL"),
            )
        })?);
    }
    let driver = selectors
        .iter()
        .find_map(|c| match c {
            Cond::Driver(d) => Some(d.clone()),
            Cond::Attribute { .. } => None,
        })
        .ok_or_else(|| {
            unsupported(
                who,
                format!("DeviceClass {class_name:?}: no `device.driver == '...'` selector"),
            )
        })?;
    let asked = ex
        .pointer("/capacity/requests")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    Ok(Request {
        name,
        class,
        driver,
        selectors,
        asked,
        tolerations: array(ex, "/tolerations").cloned().collect(),
    })
}

type Used = BTreeMap<DeviceKey, (BTreeMap<String, u128>, bool)>;

/// A device for a request and what it takes of each capacity (`None`:
/// the whole device, for this claim alone).
struct Choice {
    pool: String,
    device: String,
    consumed: Option<BTreeMap<String, u128>>,
}

/// The first device of the request's driver, in slice order, that fits.
fn first_fit(
    slices: &[Value],
    used: &Used,
    counters: &counters::Room,
    req: &Request,
) -> Option<Choice> {
    slices
        .iter()
        .filter(|s| s.pointer("/spec/driver").and_then(Value::as_str) == Some(req.driver.as_str()))
        .find_map(|s| {
            let pool = s
                .pointer("/spec/pool/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            array(s, "/spec/devices")
                .filter(|d| counters.fits(&req.driver, pool, d))
                .find_map(|d| fit(d, pool, used, req))
        })
}

/// Whether `d` takes the request: a device without
/// `allowMultipleAllocations` only while nothing holds it, one with it
/// while every capacity has room for what the request consumes.
fn fit(d: &Value, pool: &str, used: &Used, req: &Request) -> Option<Choice> {
    let device = d.get("name").and_then(Value::as_str).unwrap_or("");
    if !selector::matches(&req.selectors, &req.driver, d) {
        return None;
    }
    if array(d, "/taints").any(|t| !tolerated(t, &req.tolerations)) {
        return None;
    }
    let key = (req.driver.clone(), pool.to_string(), device.to_string());
    let (already, exclusive) = used.get(&key).cloned().unwrap_or_default();
    if exclusive {
        return None;
    }
    let choice = |consumed| Choice {
        pool: pool.to_string(),
        device: device.to_string(),
        consumed,
    };
    if d.get("allowMultipleAllocations").and_then(Value::as_bool) != Some(true) {
        return (already.is_empty() && !used.contains_key(&key)).then(|| choice(None));
    }
    let mut consumed = BTreeMap::new();
    for (cname, cap) in d
        .get("capacity")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let q = consume(cap, req.asked.get(cname).and_then(qty))?;
        let total = cap.get("value").and_then(qty).unwrap_or(0);
        if already.get(cname).copied().unwrap_or(0) + q > total {
            return None;
        }
        consumed.insert(cname.clone(), q);
    }
    Some(choice(Some(consumed)))
}

/// Whether a device taint lets the request have the device: an effect
/// other than `NoSchedule`/`NoExecute` never keeps one away; otherwise a
/// toleration must match (`Exists` on the key or any key, `Equal` on key
/// and value; an empty effect matches every effect), as
/// resource.k8s.io/v1 `DeviceToleration` says.
fn tolerated(taint: &Value, tolerations: &[Value]) -> bool {
    let field = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let effect = field(taint, "effect");
    if effect != "NoSchedule" && effect != "NoExecute" {
        return true;
    }
    tolerations.iter().any(|t| {
        let key_ok = field(t, "key").is_empty() || field(t, "key") == field(taint, "key");
        let effect_ok = field(t, "effect").is_empty() || field(t, "effect") == effect;
        let value_ok = match field(t, "operator").as_str() {
            "Exists" => true,
            "" | "Equal" => {
                !field(t, "key").is_empty() && field(t, "value") == field(taint, "value")
            }
            _ => false,
        };
        key_ok && effect_ok && value_ok
    })
}

/// Books `choice` in `used` (so the claim's next requests see it) and
/// returns its allocation result.
fn take(used: &mut Used, req: &Request, choice: Choice, share_id: String) -> Value {
    let Choice {
        pool,
        device,
        consumed,
    } = choice;
    let key = (req.driver.clone(), pool.clone(), device.clone());
    let mut r = json!({"request": req.name, "driver": req.driver, "pool": pool, "device": device});
    match &consumed {
        Some(c) => {
            let e = used.entry(key).or_default();
            for (k, v) in c {
                *e.0.entry(k.clone()).or_default() += v;
            }
            r["consumedCapacity"] = json!(
                c.iter()
                    .map(|(k, v)| (k.clone(), print_qty(*v)))
                    .collect::<BTreeMap<_, _>>()
            );
            r["shareID"] = json!(share_id);
        }
        None => {
            used.entry(key).or_default().1 = true;
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumption_rounds_to_the_step() {
        let cap = json!({"value": "16Gi", "requestPolicy": {"default": "16Gi",
            "validRange": {"min": "256Mi", "max": "16Gi", "step": "256Mi"}}});
        assert_eq!(consume(&cap, Some(1 << 30)), Some(1 << 30));
        assert_eq!(consume(&cap, Some(300 << 20)), Some(512 << 20));
        assert_eq!(consume(&cap, None), Some(16 << 30));
        assert_eq!(consume(&cap, Some(17 << 30)), None);
        assert_eq!(print_qty(1 << 30), "1Gi");
    }

    /// The rules of `DeviceToleration` (k8s.io/api resource/v1 types.go,
    /// v0.36): operator Equal by default, Exists matching any value (and
    /// any key when the key is empty), an empty effect matching all.
    #[test]
    fn taints_keep_devices_from_requests_that_do_not_tolerate_them() {
        let taint = json!({"key": "vcuda.tencent.com/unhealthy", "value": "xid-79",
            "effect": "NoSchedule"});
        let k = "vcuda.tencent.com/unhealthy";
        assert!(!tolerated(&taint, &[]));
        assert!(tolerated(
            &taint,
            &[json!({"key": k, "operator": "Exists"})]
        ));
        assert!(tolerated(&taint, &[json!({"operator": "Exists"})]));
        assert!(tolerated(&taint, &[json!({"key": k, "value": "xid-79"})]));
        assert!(!tolerated(&taint, &[json!({"key": k, "value": "xid-48"})]));
        assert!(!tolerated(
            &taint,
            &[json!({"key": k, "operator": "Exists", "effect": "NoExecute"})]
        ));
        assert!(tolerated(&json!({"key": k, "effect": "None"}), &[]));
    }
}
