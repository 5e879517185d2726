//! The demo's checks and what it prints: the memory refusal, the measured
//! GPU time against the quotas, the graph, the usage table and metrics.

use super::*;

impl Session<'_> {
    /// "refused allocation": a workload asked past its memory quota and the
    /// interposer said CUDA_ERROR_OUT_OF_MEMORY exactly where the quota ends:
    /// at the first step past what `cuMemGetInfo` showed free beside the
    /// workload's own context (which the quota pays for too).
    pub(crate) fn check_refusal(&mut self) {
        let mut seen = Vec::new();
        let mut wrong = Vec::new();
        for s in &self.started {
            let logs = self.runtime.logs(s);
            let Some(line) = logs.lines().find(|l| l.starts_with("refused ")) else {
                continue;
            };
            let kv = |k: &str| -> Option<String> {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(k).map(str::to_string))
            };
            let at_mib: u64 = kv("at_mib=").and_then(|v| v.parse().ok()).unwrap_or(0);
            let step: u64 = kv("request_mib=").and_then(|v| v.parse().ok()).unwrap_or(0);
            let error = kv("error=").unwrap_or_default();
            let seen_at_start = |key: &str| -> u64 {
                logs.lines()
                    .find(|l| l.starts_with("visible "))
                    .and_then(|l| {
                        l.split_whitespace()
                            .find_map(|w| w.strip_prefix(key))
                            .and_then(|v| v.parse().ok())
                    })
                    .unwrap_or(0)
            };
            let (visible, free) = (seen_at_start("total_mib="), seen_at_start("free_mib="));
            let quota_mib = self
                .admitted
                .iter()
                .find(|a| a.key() == s.key)
                .map_or(0, |a| a.adm.memory_bytes() >> 20);
            let msg = format!(
                "{}: cuMemAlloc refused with {error} after {at_mib} MiB of {free} MiB free (quota {quota_mib} MiB; cuMemGetInfo showed a {visible} MiB card)",
                s.key
            );
            self.p.say(&msg);
            let at_the_quota = at_mib <= free && at_mib + step > free && free <= quota_mib;
            if error == "CUDA_ERROR_OUT_OF_MEMORY"
                && at_the_quota
                && visible == quota_mib
                && quota_mib > 0
            {
                seen.push(msg);
            } else {
                wrong.push(msg);
            }
        }
        let ok = !seen.is_empty() && wrong.is_empty();
        let detail = match (seen.is_empty(), wrong.is_empty()) {
            (false, true) => seen.join("; "),
            (true, true) => "no workload reported a refused allocation".into(),
            _ => format!("not at the quota: {}", wrong.join("; ")),
        };
        self.check("refused allocation", ok, detail);
    }

    pub(crate) fn measured_over(&self, from: u64, to: u64) -> Vec<Measured> {
        let driver = self.driver.as_ref().unwrap();
        self.admitted
            .iter()
            .map(|a| {
                let pids: Vec<u32> = self
                    .started
                    .iter()
                    .filter(|s| s.key == a.key())
                    .map(|s| s.host_pid)
                    .collect();
                Measured {
                    key: a.key(),
                    uses: a
                        .gpus
                        .iter()
                        .map(|&g| (g, driver.usage(g, &pids, from, to)))
                        .collect(),
                }
            })
            .collect()
    }

    pub(crate) fn measure(&mut self) -> Result<Vec<Measured>, DemoError> {
        let total = self.opts.measure;
        let tick = Duration::from_secs(2).min(total);
        self.p.say(format!(
            "measuring for {} s: GPU time per container from the driver's timeline",
            total.as_secs_f64()
        ));
        let t0 = Driver::now();
        let start = Instant::now();
        let mut last = t0;
        while start.elapsed() < total {
            nap(tick.min(total.saturating_sub(start.elapsed())))?;
            let now = Driver::now();
            let m = self.measured_over(last, now);
            last = now;
            let parts: Vec<String> = m
                .iter()
                .zip(&self.admitted)
                .map(|(m, a)| {
                    let u: Vec<String> = m
                        .uses
                        .iter()
                        .map(|(_, u)| format!("{:.0}%", u.util))
                        .collect();
                    if a.shared() {
                        format!("{} {} (quota {}%)", m.key, u.join("+"), a.cores)
                    } else {
                        format!("{} {}", m.key, u.join("+"))
                    }
                })
                .collect();
            self.p.say(format!("  {}", parts.join(" | ")));
        }
        let m = self.measured_over(t0, Driver::now());
        if let Some(mgr) = self.manager.as_mut()
            && let Ok(Some(st)) = mgr.child.try_wait()
        {
            return Err(DemoError::Setup(format!(
                "gpu-manager exited while the workloads ran ({st}); log: {}",
                self.layout.manager_log.display()
            )));
        }
        self.check_quotas(&m);
        Ok(m)
    }

    pub(crate) fn check_quotas(&mut self, measured: &[Measured]) {
        let mut held = Vec::new();
        let mut over = Vec::new();
        let mut idle = Vec::new();
        for (m, a) in measured.iter().zip(&self.admitted) {
            let computes = a.argv.first().is_some_and(|c| c.ends_with("compute_loop"));
            for (g, u) in &m.uses {
                if computes && u.util < 5.0 {
                    idle.push(format!("{} got {:.1}% of GPU{g}", m.key, u.util));
                }
                if !a.shared() {
                    continue;
                }
                let quota = a.adm.memory_bytes();
                let text = format!(
                    "{} {:.1}% of GPU{g} (quota {}%), {} of {} MiB",
                    m.key,
                    u.util,
                    a.cores,
                    u.memory_bytes >> 20,
                    quota >> 20
                );
                if u.util > a.cores as f64 + QUOTA_TOLERANCE || u.memory_bytes > quota {
                    over.push(text);
                } else {
                    held.push(text);
                }
            }
        }
        let detail = if over.is_empty() {
            format!("{} (tolerance {QUOTA_TOLERANCE} points)", held.join("; "))
        } else {
            format!(
                "over quota: {} (tolerance {QUOTA_TOLERANCE} points); held: {}",
                over.join("; "),
                if held.is_empty() {
                    "none".into()
                } else {
                    held.join("; ")
                }
            )
        };
        self.check("quotas held", over.is_empty() && !held.is_empty(), detail);
        self.check(
            "workloads ran",
            idle.is_empty(),
            if idle.is_empty() {
                format!("{} containers ran their workloads", self.started.len())
            } else {
                format!("compute loops without GPU time: {}", idle.join("; "))
            },
        );
    }

    pub(crate) fn report(&self, measured: &[Measured]) {
        let port = self.manager.as_ref().map_or(0, |m| m.query_port);
        section("GPU graph (GET /graph on the manager's query port)");
        match http::get(port, "/graph") {
            Ok((200, body)) => print!("{body}"),
            other => {
                let printed = startup_tree(&self.layout);
                if printed.contains("GPU0") {
                    println!(
                        "{}; the tree the manager printed at startup:",
                        unavailable("/graph", &other)
                    );
                    print!("{printed}");
                } else {
                    println!("{}", unavailable("/graph", &other));
                }
            }
        }

        section(&format!(
            "Usage over the last {} s (the simulated driver's accounting)",
            self.opts.measure.as_secs_f64()
        ));
        let mut rows = vec![[
            "POD".to_string(),
            "CONTAINER".into(),
            "GPU".into(),
            "CORES".into(),
            "GPU TIME".into(),
            "MEMORY USED".into(),
            "MEMORY QUOTA".into(),
        ]];
        for (m, a) in measured.iter().zip(&self.admitted) {
            for (g, u) in &m.uses {
                rows.push([
                    a.pod.name.clone(),
                    a.container.clone(),
                    format!("GPU{g}"),
                    if a.shared() {
                        a.cores.to_string()
                    } else {
                        "whole".into()
                    },
                    format!("{:.1}%", u.util),
                    format!("{} MiB", u.memory_bytes >> 20),
                    if a.shared() {
                        format!("{} MiB", a.adm.memory_bytes() >> 20)
                    } else {
                        "-".into()
                    },
                ]);
            }
        }
        print!("{}", table(&rows));

        section("Metrics excerpt (GET /metrics)");
        match http::get(port, "/metrics") {
            Ok((200, body)) => {
                let pods: Vec<String> = self
                    .admitted
                    .iter()
                    .map(|a| format!("pod=\"{}\"", a.pod.name))
                    .collect();
                let lines: Vec<&str> = body
                    .lines()
                    .filter(|l| {
                        (l.starts_with("vcuda_container_gpu_utilization_ratio")
                            || l.starts_with("vcuda_container_gpu_memory_used_bytes")
                            || l.starts_with("vcuda_container_allocations_refused_total"))
                            && pods.iter().any(|p| l.contains(p.as_str()))
                            || l.starts_with("vcuda_gpu_utilization_ratio")
                    })
                    .take(20)
                    .collect();
                if lines.is_empty() {
                    println!("(no vcuda_* series for the demo pods yet)");
                }
                for l in lines {
                    println!("{l}");
                }
            }
            other => println!("{}", unavailable("/metrics", &other)),
        }
        println!();
    }
}

fn unavailable(path: &str, got: &std::io::Result<(u16, String)>) -> String {
    match got {
        Ok((code, _)) => format!("(GET {path} answered {code})"),
        Err(e) => format!("(GET {path}: {e}: this gpu-manager build serves no query port yet)"),
    }
}

fn table(rows: &[[String; 7]]) -> String {
    let mut widths = [0usize; 7];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}
