//! Waiting pods the scheduler keeps not placing here although an instance
//! they need stands free (pure): something else of this node does not fit
//! them (CPU, ports, a preferred spread), which [`super::fits`] does not
//! judge. Counted forever, such a pod would make an instance, see it
//! destroyed after the grace period and make it again, on every dynamic
//! node. So a pod that has waited longer than twice the grace period
//! while an instance of a profile it needs stood free here is passed over
//! for a while, then counted again. (Twice: the instance it frees is then
//! destroyed at once, and the scheduler has had the node's update long
//! enough that it will not bind the pod here in the same second.)

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::demand::Waiting;

/// How long a passed-over pod is not counted.
pub const PAUSE: Duration = Duration::from_secs(600);

/// Per waiting pod (UID): since when an instance it needs stood free, or
/// until when it is passed over.
#[derive(Debug, Default)]
pub struct PassedOver {
    free_since: BTreeMap<String, Instant>,
    until: BTreeMap<String, Instant>,
}

impl PassedOver {
    /// The `waiting` pods to count now, given how many instances of each
    /// profile stand free (`free`): one that waited beside a free instance
    /// longer than `patience` is passed over; those newly passed over are
    /// returned apart (for the log).
    pub fn retain(
        &mut self,
        waiting: Vec<Waiting>,
        free: &BTreeMap<String, usize>,
        now: Instant,
        patience: Duration,
    ) -> (Vec<Waiting>, Vec<Waiting>) {
        self.free_since
            .retain(|uid, _| waiting.iter().any(|w| w.uid == *uid));
        self.until
            .retain(|uid, t| *t > now && waiting.iter().any(|w| w.uid == *uid));
        let (mut counted, mut passed) = (Vec::new(), Vec::new());
        for w in waiting {
            if self.until.contains_key(&w.uid) {
                continue;
            }
            let stands_free = w.need.keys().any(|p| free.get(p).is_some_and(|n| *n > 0));
            if !stands_free {
                self.free_since.remove(&w.uid);
                counted.push(w);
                continue;
            }
            let since = *self.free_since.entry(w.uid.clone()).or_insert(now);
            if now.duration_since(since) > patience {
                self.free_since.remove(&w.uid);
                self.until.insert(w.uid.clone(), now + PAUSE);
                passed.push(w);
            } else {
                counted.push(w);
            }
        }
        (counted, passed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(uid: &str) -> Waiting {
        Waiting {
            uid: uid.into(),
            name: format!("ns/{uid}"),
            need: BTreeMap::from([("3g.40gb".to_string(), 1)]),
        }
    }

    fn uids(v: &[Waiting]) -> Vec<&str> {
        v.iter().map(|w| w.uid.as_str()).collect()
    }

    #[test]
    fn a_pod_waiting_beside_a_free_instance_past_the_grace_is_passed_over_then_counted_again() {
        let (mut p, t0, grace) = (
            PassedOver::default(),
            Instant::now(),
            Duration::from_secs(60),
        );
        let free = BTreeMap::from([("3g.40gb".to_string(), 1)]);
        let none = BTreeMap::new();
        // No instance free: counted however long it waits.
        let (c, _) = p.retain(vec![w("a")], &none, t0, grace);
        assert_eq!(uids(&c), ["a"]);
        let (c, _) = p.retain(vec![w("a")], &none, t0 + grace * 5, grace);
        assert_eq!(uids(&c), ["a"]);
        // Free from then on: counted through the grace, passed over after.
        let t1 = t0 + grace * 5;
        let (c, x) = p.retain(vec![w("a")], &free, t1, grace);
        assert_eq!((uids(&c), uids(&x)), (vec!["a"], vec![]));
        let (c, x) = p.retain(vec![w("a")], &free, t1 + grace, grace);
        assert_eq!((uids(&c), uids(&x)), (vec!["a"], vec![]));
        let t2 = t1 + grace + Duration::from_secs(1);
        let (c, x) = p.retain(vec![w("a"), w("b")], &free, t2, grace);
        assert_eq!((uids(&c), uids(&x)), (vec!["b"], vec!["a"]));
        // Not counted during the pause, even with nothing free.
        let (c, _) = p.retain(vec![w("a")], &none, t2 + PAUSE / 2, grace);
        assert!(c.is_empty());
        // Counted again after it.
        let (c, _) = p.retain(vec![w("a")], &none, t2 + PAUSE + grace, grace);
        assert_eq!(uids(&c), ["a"]);
    }

    #[test]
    fn the_free_time_restarts_when_nothing_stood_free_between() {
        let (mut p, t0, grace) = (
            PassedOver::default(),
            Instant::now(),
            Duration::from_secs(60),
        );
        let free = BTreeMap::from([("3g.40gb".to_string(), 1)]);
        p.retain(vec![w("a")], &free, t0, grace);
        p.retain(vec![w("a")], &BTreeMap::new(), t0 + grace / 2, grace);
        let (c, x) = p.retain(vec![w("a")], &free, t0 + grace * 3 / 2, grace);
        assert_eq!((uids(&c), x.len()), (vec!["a"], 0));
    }
}
