//! A [`DisplaySource`] from a fixed description (or a JSON file re-read when
//! it changes): the display without a manager, for tests, benchmarks and the
//! `gpu-display-fixture` binary. Test support, kept out of the production
//! crate.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use gpu_display::{ContainerView, DisplaySource, GpuView};

/// Everything a [`StaticSource`] answers.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FixtureState {
    pub node: String,
    /// Graph text; rendered from `gpus` by [`render_graph`] when absent.
    #[serde(default)]
    pub graph: Option<String>,
    #[serde(default)]
    pub gpus: Vec<GpuView>,
    #[serde(default)]
    pub containers: Vec<ContainerView>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct StaticSource {
    state: RwLock<(FixtureState, Option<SystemTime>)>,
    file: Option<PathBuf>,
    /// What `/healthz` answers (a test makes it fail).
    health: RwLock<Option<String>>,
}

impl StaticSource {
    pub fn new(state: FixtureState) -> StaticSource {
        StaticSource {
            state: RwLock::new((state, None)),
            ..Default::default()
        }
    }

    /// Answers from the JSON `path` ([`FixtureState`]), re-read whenever its
    /// modification time changes, so a test can add containers and PIDs.
    pub fn from_file(path: &Path) -> std::io::Result<StaticSource> {
        let s = StaticSource {
            file: Some(path.to_path_buf()),
            ..Default::default()
        };
        s.reload()?;
        Ok(s)
    }

    /// Makes `/healthz` fail with `why` (`None`: healthy again).
    pub fn set_unhealthy(&self, why: Option<&str>) {
        *self.health.write().unwrap() = why.map(str::to_string);
    }

    pub fn set(&self, state: FixtureState) {
        self.state.write().unwrap().0 = state;
    }

    fn reload(&self) -> std::io::Result<()> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let mtime = std::fs::metadata(path)?.modified()?;
        if self.state.read().unwrap().1 == Some(mtime) {
            return Ok(());
        }
        let text = std::fs::read(path)?;
        let st: FixtureState = serde_json::from_slice(&text)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        *self.state.write().unwrap() = (st, Some(mtime));
        Ok(())
    }

    fn with<T>(&self, f: impl FnOnce(&FixtureState) -> T) -> T {
        if let Err(e) = self.reload() {
            tracing::warn!(error = %e, "reloading the fixture file; keeping the last state");
        }
        f(&self.state.read().unwrap().0)
    }
}

impl DisplaySource for StaticSource {
    fn node_name(&self) -> String {
        self.with(|s| s.node.clone())
    }

    fn health(&self) -> Result<(), gpu_display::Unhealthy> {
        match &*self.health.read().unwrap() {
            Some(why) => Err(gpu_display::Unhealthy {
                reason: why.clone(),
            }),
            None => Ok(()),
        }
    }

    fn graph_text(&self) -> String {
        self.with(|s| s.graph.clone().unwrap_or_else(|| render_graph(&s.gpus)))
    }

    fn gpus(&self) -> Vec<GpuView> {
        self.with(|s| s.gpus.clone())
    }

    fn containers(&self) -> Vec<ContainerView> {
        self.with(|s| s.containers.clone())
    }
}

/// A flat rendering of the GPUs with used/free cores and memory, for a
/// source that has no topology tree of its own.
pub fn render_graph(gpus: &[GpuView]) -> String {
    let mut out = String::new();
    for g in gpus {
        let mib = |b: u64| b >> 20;
        let _ = writeln!(
            out,
            "GPU{} {} {} cores {}/100 used ({} free), memory {}/{} MiB used ({} free), {} tenant(s){}",
            g.index,
            g.uuid,
            g.bus_id,
            g.allocated_cores,
            100u32.saturating_sub(g.allocated_cores),
            mib(g.allocated_memory_bytes),
            mib(g.memory_total_bytes),
            mib(g
                .memory_total_bytes
                .saturating_sub(g.allocated_memory_bytes)),
            g.tenants,
            if g.healthy { "" } else { ", UNHEALTHY" }
        );
    }
    out
}
