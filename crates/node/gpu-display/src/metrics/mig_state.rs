//! MIG families only a node with such state shows: devices whose
//! instance was destroyed under a holder, and dynamic MIG's demand and
//! changes (docs/mig.md).

use prometheus::Registry;
use prometheus::proto::MetricFamily;

use super::{counter, gauge};
use crate::source::{DynamicMigView, LostMigView};

/// What the source says of its MIG devices at a scrape.
#[derive(Debug, Default)]
pub(crate) struct MigState {
    pub(crate) lost: Vec<LostMigView>,
    pub(crate) dynamic: Option<DynamicMigView>,
}

impl MigState {
    pub(crate) fn families(&self, node: &str) -> Vec<MetricFamily> {
        let mut out = Vec::new();
        if !self.lost.is_empty() {
            out.extend(lost_family(node, &self.lost));
        }
        if let Some(d) = &self.dynamic {
            out.extend(dynamic_family(node, d));
        }
        out
    }
}

/// `vcuda_mig_device_lost`: 1 per MIG device whose instance was destroyed
/// while a pod or claim held it, until it is let go (only while one is).
fn lost_family(node: &str, lost: &[LostMigView]) -> Vec<MetricFamily> {
    let r = Registry::new();
    let g = gauge(
        &r,
        "vcuda_mig_device_lost",
        "A MIG device whose instance was destroyed while a pod or claim held it (1).",
        &["node", "gpu", "uuid", "holder"],
    );
    for l in lost {
        let gpu = l.gpu.to_string();
        g.with_label_values(&[node, gpu.as_str(), l.uuid.as_str(), l.holder.as_str()])
            .set(1.0);
    }
    r.gather()
}

/// `vcuda_mig_dynamic_unplaced` (per profile needed, 0 once placed) and
/// `vcuda_mig_dynamic_instances_total{action}`: a node that keeps MIG
/// devices pods need unplaced is one to look at.
fn dynamic_family(node: &str, d: &DynamicMigView) -> Vec<MetricFamily> {
    let r = Registry::new();
    let unplaced = gauge(
        &r,
        "vcuda_mig_dynamic_unplaced",
        "MIG devices pods need on this node that fit on none of its dynamic GPUs now.",
        &["node", "profile"],
    );
    for (profile, n) in &d.unplaced {
        unplaced
            .with_label_values(&[node, profile.as_str()])
            .set(*n as f64);
    }
    let changes = counter(
        &r,
        "vcuda_mig_dynamic_instances_total",
        "GPU instances dynamic MIG made (action=made) and destroyed (action=destroyed).",
        &["node", "action"],
    );
    changes
        .with_label_values(&[node, "made"])
        .inc_by(d.made as f64);
    changes
        .with_label_values(&[node, "destroyed"])
        .inc_by(d.destroyed as f64);
    r.gather()
}

#[cfg(test)]
mod tests {
    use super::super::MetricsRegistry;
    use super::*;
    use crate::sampler::{SamplerStats, Snapshot};

    fn render(mig: &MigState) -> String {
        let r = MetricsRegistry::new("0.0.0");
        let (snap, stats) = (Snapshot::default(), SamplerStats::default());
        r.render("n1", &[], &[], mig, &snap, &stats)
    }

    #[test]
    fn a_lost_mig_device_is_one_series_only_while_lost() {
        let lost = vec![LostMigView {
            gpu: 1,
            uuid: "MIG-x".into(),
            holder: "ns/claim".into(),
        }];
        let text = render(&MigState {
            lost,
            dynamic: None,
        });
        let line: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("vcuda_mig_device_lost{"))
            .collect();
        assert_eq!(line.len(), 1, "{text}");
        for part in [
            "gpu=\"1\"",
            "uuid=\"MIG-x\"",
            "holder=\"ns/claim\"",
            "node=\"n1\"",
        ] {
            assert!(line[0].contains(part), "{part} in {}", line[0]);
        }
        assert!(line[0].ends_with(" 1"), "{}", line[0]);
        let none = render(&MigState::default());
        assert!(!none.contains("vcuda_mig_device_lost"), "{none}");
        assert!(!none.contains("vcuda_mig_dynamic"), "{none}");
    }

    #[test]
    fn dynamic_mig_shows_what_waits_and_what_it_did() {
        let dynamic = DynamicMigView {
            unplaced: [("7g.80gb".to_string(), 1), ("3g.40gb".to_string(), 0)].into(),
            made: 3,
            destroyed: 2,
        };
        let text = render(&MigState {
            lost: Vec::new(),
            dynamic: Some(dynamic),
        });
        for want in [
            "vcuda_mig_dynamic_unplaced{node=\"n1\",profile=\"7g.80gb\"} 1",
            "vcuda_mig_dynamic_unplaced{node=\"n1\",profile=\"3g.40gb\"} 0",
            "vcuda_mig_dynamic_instances_total{action=\"made\",node=\"n1\"} 3",
            "vcuda_mig_dynamic_instances_total{action=\"destroyed\",node=\"n1\"} 2",
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
    }
}
