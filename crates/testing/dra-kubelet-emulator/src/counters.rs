//! Shared counters (KEP-4815, partitionable devices) for the allocator:
//! a pool's slices declare counter sets (`spec.sharedCounters`), its
//! devices what they consume of them (`consumesCounters`); a device is
//! allocatable only while every counter it consumes keeps room for it
//! after what the devices already allocated consume, which is how the
//! scheduler's allocator (k8s.io/dynamic-resource-allocation
//! `structured`) keeps overlapping partitions of one GPU apart.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::allocator::{DeviceKey, qty};

/// (driver, pool, counter set, counter).
type CounterKey = (String, String, String, String);

/// The counters of the node's pools and what allocated devices use.
#[derive(Debug, Default)]
pub struct Room {
    total: BTreeMap<CounterKey, u128>,
    used: BTreeMap<CounterKey, u128>,
    /// What each device consumes, from its slice.
    consumes: BTreeMap<DeviceKey, Vec<(CounterKey, u128)>>,
}

fn field<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// `{name: {value: q}}` as (name, q).
fn values(v: Option<&Value>) -> Vec<(String, u128)> {
    let m = v.and_then(Value::as_object).into_iter().flatten();
    m.map(|(k, c)| (k.clone(), c.get("value").and_then(qty).unwrap_or(0)))
        .collect()
}

fn items<'a>(v: &'a Value, pointer: &str) -> impl Iterator<Item = &'a Value> {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

impl Room {
    /// The counters `slices` declare, less what the devices `allocated`
    /// consume.
    pub fn new<'a>(slices: &[Value], allocated: impl Iterator<Item = &'a DeviceKey>) -> Room {
        let mut r = Room::default();
        for s in slices {
            let (driver, pool) = (field(s, "/spec/driver"), field(s, "/spec/pool/name"));
            let key = |set: &str, c: &str| (driver.into(), pool.into(), set.into(), c.into());
            for set in items(s, "/spec/sharedCounters") {
                let name = field(set, "/name");
                for (c, q) in values(set.get("counters")) {
                    r.total.insert(key(name, &c), q);
                }
            }
            for d in items(s, "/spec/devices") {
                let mut uses = Vec::new();
                for c in items(d, "/consumesCounters") {
                    let set = field(c, "/counterSet");
                    uses.extend(
                        values(c.get("counters"))
                            .into_iter()
                            .map(|(n, q)| (key(set, &n), q)),
                    );
                }
                let device = (driver.into(), pool.into(), field(d, "/name").into());
                r.consumes.insert(device, uses);
            }
        }
        for d in allocated {
            r.book(d);
        }
        r
    }

    /// Counts what `device` consumes as used.
    pub fn book(&mut self, device: &DeviceKey) {
        for (k, q) in self.consumes.get(device).into_iter().flatten() {
            *self.used.entry(k.clone()).or_default() += q;
        }
    }

    /// Whether device `d` of `driver`'s `pool` fits what is left: every
    /// counter it consumes exists (a device naming a counter no slice
    /// declares is never allocatable) and has room.
    pub fn fits(&self, driver: &str, pool: &str, d: &Value) -> bool {
        let key = (driver.into(), pool.into(), field(d, "/name").to_string());
        self.consumes.get(&key).into_iter().flatten().all(|(k, q)| {
            let used = self.used.get(k).copied().unwrap_or(0);
            self.total.get(k).is_some_and(|&t| used + q <= t)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Two memory slices; a device on each and one over both.
    fn slices() -> Vec<Value> {
        let uses = |cs: &[&str]| {
            let m: serde_json::Map<String, Value> = cs
                .iter()
                .map(|c| (c.to_string(), json!({"value": "1"})))
                .collect();
            json!([{"counterSet": "gpu-0-mig", "counters": m}])
        };
        vec![
            json!({"spec": {"driver": "d", "pool": {"name": "n"}, "sharedCounters": [
                {"name": "gpu-0-mig", "counters": {"s0": {"value": "1"}, "s1": {"value": "1"}}}]}}),
            json!({"spec": {"driver": "d", "pool": {"name": "n"}, "devices": [
                {"name": "a", "consumesCounters": uses(&["s0"])},
                {"name": "b", "consumesCounters": uses(&["s1"])},
                {"name": "ab", "consumesCounters": uses(&["s0", "s1"])},
                {"name": "plain"},
                {"name": "ghost", "consumesCounters": [{"counterSet": "other",
                    "counters": {"x": {"value": "1"}}}]}]}}),
        ]
    }

    fn dev(name: &str) -> Value {
        json!({"name": name})
    }

    fn key(name: &str) -> DeviceKey {
        ("d".into(), "n".into(), name.into())
    }

    #[test]
    fn overlapping_devices_exclude_each_other_through_their_counters() {
        let s = slices();
        let fits = |r: &Room, n: &str| r.fits("d", "n", &dev(n));
        let free = Room::new(&s, std::iter::empty());
        assert!(fits(&free, "a") && fits(&free, "b") && fits(&free, "ab"));
        assert!(fits(&free, "plain"), "consumes nothing");
        assert!(!fits(&free, "ghost"), "an undeclared counter");
        let a = [key("a")];
        let mut r = Room::new(&s, a.iter());
        assert!(!fits(&r, "ab") && fits(&r, "b"));
        r.book(&key("b"));
        assert!(!fits(&r, "b") && fits(&r, "plain"));
        let r = Room::new(&s, [key("ab")].iter());
        assert!(!fits(&r, "a") && !fits(&r, "b"));
    }
}
