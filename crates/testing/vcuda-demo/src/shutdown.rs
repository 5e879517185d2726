//! Stopping everything the demo started, in reverse order, and the "clean
//! shutdown" check (no workload, GPU or child process left; work dir removed).

use super::*;

impl Session<'_> {
    /// Stops and removes everything, in reverse order of starting; records
    /// the "clean shutdown" check.
    pub(crate) fn shutdown(&mut self, work: Option<tempfile::TempDir>) {
        let mut problems = Vec::new();
        if !self.started.is_empty() {
            self.p.say(format!(
                "stopping {} containers (SIGTERM)",
                self.started.len()
            ));
            problems.extend(
                self.runtime
                    .stop_all(&mut self.started, Duration::from_secs(5)),
            );
            for s in &self.started {
                if let Some(l) = self
                    .runtime
                    .logs(s)
                    .lines()
                    .rev()
                    .find(|l| l.starts_with("done"))
                {
                    self.p.say(format!("  {}: {l}", s.key));
                }
            }
        }
        if let Some(em) = &self.emulators {
            for pod in &self.pods {
                em.delete_pod(pod);
            }
            if !self.pods.is_empty() && self.manager.is_some() {
                let t = Instant::now();
                let dirs: Vec<PathBuf> = self
                    .pods
                    .iter()
                    .map(|p| self.layout.vm.join(&p.uid))
                    .collect();
                while dirs.iter().any(|d| d.exists()) && t.elapsed() < Duration::from_secs(5) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let kept = dirs.iter().filter(|d| d.exists()).count();
                if kept == 0 {
                    self.p.say(format!(
                        "pods deleted; the manager released their allocations in {:.1} s",
                        t.elapsed().as_secs_f64()
                    ));
                } else {
                    problems.push(format!("the manager kept {kept} vm dirs of deleted pods"));
                }
            }
        }
        let mut manager_exit = String::from("not started");
        if let Some(m) = self.manager.as_mut() {
            let (clean, how) = m.stop(Duration::from_secs(10));
            self.p.say(format!("gpu-manager {how}"));
            if !clean {
                problems.push(format!("gpu-manager {how}"));
            }
            manager_exit = how;
        }
        if let Some(d) = &self.driver {
            let live = d.live_processes();
            if !live.is_empty() {
                problems.push(format!("processes still on the GPUs: {}", live.join(", ")));
            }
        }
        self.driver = None;
        if let Some(em) = self.emulators.take() {
            em.stop();
            self.p.say("emulators stopped");
        }
        let leftovers = self.runtime.leftovers(&mut self.started);
        if !leftovers.is_empty() {
            problems.push(format!("containers left: {}", leftovers.join(", ")));
        }
        let children = child_processes();
        if !children.is_empty() {
            problems.push(format!("child processes left: {}", children.join(", ")));
        }
        match work {
            Some(w) => {
                let path = w.path().to_path_buf();
                if let Err(e) = w.close() {
                    problems.push(format!("removing {}: {e}", path.display()));
                } else if path.exists() {
                    problems.push(format!("{} still exists", path.display()));
                } else {
                    self.p.say(format!("removed {}", path.display()));
                }
            }
            None => {
                self.p
                    .say(format!("kept {} (--keep)", self.layout.work.display()));
            }
        }
        let what = match &self.runtime {
            Runtime::Docker(_) => {
                format!("no container labelled {}={}", runtime::LABEL, self.run_id)
            }
            Runtime::Namespaces { .. } => "no workload process".into(),
        };
        self.check(
            "clean shutdown",
            problems.is_empty(),
            if problems.is_empty() {
                format!(
                    "{what}, gpu-manager {manager_exit}, emulators stopped, no GPU process, no child process, work dir removed"
                )
            } else {
                problems.join("; ")
            },
        );
    }
}

/// Processes whose parent is this one (none may be left at the end).
fn child_processes() -> Vec<String> {
    let me = std::process::id().to_string();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().into_owned();
            pid.parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // pid (comm) state ppid ...: comm may hold spaces, so split after ')'.
            let (comm_part, rest) = stat.rsplit_once(')')?;
            let ppid = rest.split_whitespace().nth(1)?;
            let comm = comm_part.split_once('(').map_or("", |x| x.1);
            (ppid == me).then(|| format!("{pid} ({comm})"))
        })
        .collect()
}
