//! The `usage` table.

use std::fmt::Write as _;

use vcuda_api::display::UsageResponse;

/// One line per container, sorted by namespace, pod and container:
/// GPUs it holds, cores used against its quota, memory used against its quota.
/// `wide`: the pod UID too. A manager older than the `pod_name` / `namespace`
/// fields answers neither: the pod column shows the UID and the namespace
/// comes from `project`.
pub fn usage_table(u: &UsageResponse, wide: bool) -> String {
    let mut rows: Vec<Vec<String>> = Vec::new();
    for (uid, pod) in &u.usage {
        let namespace = if pod.namespace.is_empty() {
            &pod.project
        } else {
            &pod.namespace
        };
        let pod_name = if pod.pod_name.is_empty() {
            uid
        } else {
            &pod.pod_name
        };
        let mut names: Vec<&String> = pod.stat.keys().chain(pod.spec.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let devs = pod.stat.get(name).map(|d| d.dev.as_slice()).unwrap_or(&[]);
            let spec = pod.spec.get(name);
            let gpus = if devs.is_empty() {
                "-".to_string()
            } else {
                devs.iter()
                    .map(|d| d.card_idx.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let util: f32 = devs.iter().map(|d| d.gpu).sum();
            let mem: f32 = devs.iter().map(|d| d.mem).sum();
            let mut pids: Vec<i32> = devs.iter().flat_map(|d| d.pids.iter().copied()).collect();
            pids.sort_unstable();
            pids.dedup();
            let mut row = vec![namespace.clone(), pod_name.clone()];
            if wide {
                row.push(uid.clone());
            }
            row.extend([
                name.clone(),
                gpus,
                format!(
                    "{util:.1}% / {}",
                    spec.map_or("-".into(), |s| format!("{}%", s.gpu))
                ),
                format!(
                    "{mem:.0} / {} MiB",
                    spec.map_or("-".into(), |s| format!("{:.0}", s.mem))
                ),
                if pids.is_empty() {
                    "-".into()
                } else {
                    pids.iter()
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                },
            ]);
            rows.push(row);
        }
    }
    rows.sort();
    let mut header = vec!["NAMESPACE", "POD"];
    if wide {
        header.push("POD UID");
    }
    header.extend([
        "CONTAINER",
        "GPU",
        "CORES USED / QUOTA",
        "MEMORY USED / QUOTA",
        "PIDS",
    ]);
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[&str]| {
        let mut l = String::new();
        for (i, (c, w)) in cells.iter().zip(&width).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                let _ = write!(l, "{c:<w$}  ");
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&header);
    for r in &rows {
        let cells: Vec<&str> = r.iter().map(String::as_str).collect();
        line(&cells);
    }
    if rows.is_empty() {
        out.push_str("(no containers hold a GPU)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use vcuda_api::display::{ContainerStat, DeviceInfo, Devices, Spec};

    #[test]
    fn one_row_per_container_with_use_and_quota() {
        let mut u = UsageResponse::default();
        let mut st = ContainerStat {
            project: "team-a".into(),
            pod_name: "trainer-0".into(),
            namespace: "team-a".into(),
            ..Default::default()
        };
        st.stat.insert(
            "train".into(),
            Devices {
                dev: vec![DeviceInfo {
                    id: "00000000:07:00.0".into(),
                    card_idx: "0".into(),
                    gpu: 27.5,
                    mem: 512.0,
                    pids: vec![4242, 4241],
                    device_mem: 40960.0,
                }],
            },
        );
        st.spec.insert(
            "train".into(),
            Spec {
                gpu: 30.0,
                mem: 2048.0,
            },
        );
        u.usage.insert("uid-1".into(), st);
        let t = usage_table(&u, false);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NAMESPACE  POD "), "{t}");
        assert!(!lines[0].contains("UID"), "{t}");
        assert!(lines[1].starts_with("team-a     trainer-0  train "), "{t}");
        assert!(!lines[1].contains("uid-1"), "{t}");
        assert!(lines[1].contains("27.5% / 30%"), "{t}");
        assert!(lines[1].contains("512 / 2048 MiB"), "{t}");
        assert!(lines[1].ends_with("4241,4242"), "{t}");

        let t = usage_table(&u, true);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("NAMESPACE  POD        POD UID  CONTAINER"),
            "{t}"
        );
        assert!(
            lines[1].starts_with("team-a     trainer-0  uid-1    train "),
            "{t}"
        );
        assert!(lines[1].ends_with("4241,4242"), "{t}");
    }

    #[test]
    fn an_older_manager_without_names_shows_the_uid_and_project() {
        let mut u = UsageResponse::default();
        let st = ContainerStat {
            project: "team-b".into(),
            spec: [(
                "main".to_string(),
                Spec {
                    gpu: 10.0,
                    mem: 256.0,
                },
            )]
            .into(),
            ..Default::default()
        };
        u.usage.insert("uid-9".into(), st);
        let t = usage_table(&u, false);
        let row = t.lines().nth(1).unwrap();
        assert!(row.starts_with("team-b     uid-9  main "), "{t}");
        assert!(row.contains("0.0% / 10%") && row.ends_with('-'), "{t}");
    }

    #[test]
    fn empty() {
        for wide in [false, true] {
            assert!(usage_table(&UsageResponse::default(), wide).contains("no containers"));
        }
    }
}
