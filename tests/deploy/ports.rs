//! The chart's listeners: which of the daemons' ports leave the pod
//! (rendered with the real helm, as `helm.rs`).

use super::helm::{check_rendered, helm, manager_settings, template};
use super::kustomize::{self, find};
use serde_json::json;

/// By default the query port (/usage, /graph: every tenant's pods and
/// host PIDs) stays inside the pod: only the metrics and probe ports are
/// published, the Service and NetworkPolicy take the metrics port; a chart
/// whose query port is on the pod network (no metrics-port) still serves
/// Prometheus there, as before the metrics port existed.
#[test]
fn only_the_metrics_and_probe_ports_leave_the_pod() {
    let Some(helm) = helm() else { return };
    for (mode, name) in [("devicePlugin", "gpu-manager"), ("dra", "vcuda-dra-driver")] {
        for (sets, metrics, probes) in [
            (format!("mode={mode}"), 5680, json!("health")),
            (
                format!("mode={mode},config.query-addr=0.0.0.0,config.metrics-port=null"),
                5678,
                json!("health"),
            ),
            (
                format!(
                    "mode={mode},config.query-addr=0.0.0.0,config.metrics-port=null,config.health-port=null,config.metrics-addr=null"
                ),
                5678,
                json!("metrics"),
            ),
        ] {
            let objects = template(&helm, &["--set", &sets]);
            check_rendered(&sets, &objects);
            let text = find(&objects, "ConfigMap", "gpu-manager")["data"]["gpu-manager.toml"]
                .as_str()
                .unwrap();
            let http = manager_settings(&sets, text).http;
            let c = kustomize::container(find(&objects, "DaemonSet", name));
            let ports: Vec<(String, u64)> = c["ports"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p["name"].as_str().unwrap().to_string(),
                        p["containerPort"].as_u64().unwrap(),
                    )
                })
                .collect();
            assert_eq!(ports[0], ("metrics".into(), metrics), "{sets}: {ports:?}");
            assert_eq!(
                u64::from(http.metrics.unwrap_or(http.query).port()),
                metrics,
                "{sets}"
            );
            if http.metrics.is_some() {
                assert!(http.query.ip().is_loopback(), "{sets}: {http:?}");
                assert!(
                    ports
                        .iter()
                        .all(|(_, p)| *p != u64::from(http.query.port())),
                    "{sets}: the query port is published: {ports:?}"
                );
            }
            for probe in ["readinessProbe", "livenessProbe"] {
                if !c[probe].is_null() {
                    assert_eq!(c[probe]["httpGet"]["port"], probes, "{sets}: {probe}");
                }
            }
            // The DRA driver's Service comes with the ServiceMonitor only.
            let svc = objects.iter().find(|v| {
                v["kind"] == "Service" && v["metadata"]["name"] == format!("{name}-metrics")
            });
            assert!(svc.is_some() || mode == "dra", "{sets}: no metrics Service");
            if let Some(svc) = svc {
                assert_eq!(svc["spec"]["ports"][0]["port"], metrics, "{sets}");
                assert_eq!(
                    svc["metadata"]["annotations"]["prometheus.io/port"],
                    metrics.to_string(),
                    "{sets}"
                );
            }
            let policy = if mode == "dra" {
                "vcuda-dra-driver-query"
            } else {
                "gpu-manager-query"
            };
            let np = find(&objects, "NetworkPolicy", policy);
            assert_eq!(
                np["spec"]["ingress"][0]["ports"],
                json!([{"port": metrics, "protocol": "TCP"}]),
                "{sets}"
            );
        }
    }
}
