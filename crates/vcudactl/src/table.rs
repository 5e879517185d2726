//! The `usage` table.

use std::fmt::Write as _;

use vcuda_api::display::UsageResponse;

/// One line per container, sorted by namespace, pod and container:
/// GPUs it holds, cores used against its quota, memory used against its quota.
pub fn usage_table(u: &UsageResponse) -> String {
    let mut rows: Vec<[String; 7]> = Vec::new();
    for (uid, pod) in &u.usage {
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
            rows.push([
                pod.project.clone(),
                uid.clone(),
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
        }
    }
    rows.sort();
    let header = [
        "NAMESPACE",
        "POD UID",
        "CONTAINER",
        "GPU",
        "CORES USED / QUOTA",
        "MEMORY USED / QUOTA",
        "PIDS",
    ];
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
        let t = usage_table(&u);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NAMESPACE"));
        assert!(lines[1].contains("team-a"), "{t}");
        assert!(lines[1].contains("27.5% / 30%"), "{t}");
        assert!(lines[1].contains("512 / 2048 MiB"), "{t}");
        assert!(lines[1].ends_with("4241,4242"), "{t}");
    }

    #[test]
    fn empty() {
        assert!(usage_table(&UsageResponse::default()).contains("no containers"));
    }
}
