//! Node descriptions: the TOML file that says which GPUs a simulated node has
//! and how they are connected.
//!
//! ```toml
//! name = "sim-1gpu"
//! driver_version = "550.54.15"
//! cuda_version = "12.4"
//!
//! [[gpu]]
//! name = "NVIDIA A100-SXM4-40GB"
//! uuid = "GPU-5f4bd4a4-2bd1-4c0e-9a9b-0d3c8e1f0001"
//! memory_mib = 40960
//! sm_count = 108
//! max_threads_per_sm = 2048
//! compute_capability = "8.0"
//! pci_bus_id = "00000000:07:00.0"
//! minor = 0
//! numa_node = 0
//! context_overhead_mib = 415   # device memory each context takes (default 0)
//! mig = "a100-40gb"        # optional: MIG-capable, with this model's MIG
//!                          # profiles (`mig::MODELS`: a100-40gb, a100-80gb,
//!                          # h100-80gb, h200-141gb); without it NVML's MIG
//!                          # calls answer NOT_SUPPORTED, as on a GPU
//!                          # without MIG. MIG starts disabled.
//!
//! # optional, top level: kernel_wave_ns (block time of kernels that declare
//! # no law, see `law`; default 10 µs), context_switch_ns (idle device time
//! # when contexts of two processes take turns; default 20 µs),
//! # timeslice_ns (how long a context keeps the device while another
//! # process waits; default 2 ms, 0: contexts run in the order their work
//! # was queued, never preempted), and an [nvml_sampling] table (see
//! # `NvmlSampling`)
//!
//! [[link]]                 # optional; pairs not listed are NODE (same NUMA
//! gpus = [0, 1]            # node) or SYS (different NUMA nodes)
//! pcie = "PIX"             # PIX | PXB | PHB | NODE | SYS
//! nvlink = 12              # NVLink links between the two (0 = none)
//! ```

use serde::Deserialize;
use std::fmt;
use std::path::Path;
use thiserror::Error;

/// Most GPUs one node description may hold (sizes the shared state).
pub const MAX_GPUS: usize = 32;

/// Default block time of the default kernel law (see [`crate::law`]).
pub const DEFAULT_WAVE_NS: u64 = 10_000;

/// Default device time lost when the device switches from one process's
/// context to another's while both have work (time-slicing, no MPS).
pub const DEFAULT_SWITCH_NS: u64 = 20_000;

/// Default timeslice: how long a context holding the device keeps it while
/// another process's work waits (NVIDIA's scheduler preempts at its end).
pub const DEFAULT_TIMESLICE_NS: u64 = 2_000_000;

#[derive(Debug, Error)]
pub enum NodeError {
    #[error("cannot read node description {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Syntax errors, unknown keys, wrong types: toml's message names the
    /// line, column and key.
    #[error("node description {path}: {message}")]
    Parse { path: String, message: String },
    /// A value that parses but makes no sense.
    #[error("node description {path}, line {line}: {field}: {message}")]
    Invalid {
        path: String,
        line: usize,
        field: String,
        message: String,
    },
}

/// PCIe relationship between two GPUs, as NVML's `nvmlGpuTopologyLevel_t`
/// names them (the discriminants are NVML's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[repr(u32)]
pub enum PcieLevel {
    /// Same board (two dies on one card).
    #[serde(rename = "INTERNAL")]
    Internal = 0,
    /// Behind one PCIe switch.
    #[serde(rename = "PIX")]
    Single = 10,
    /// Behind several PCIe switches, no host bridge in between.
    #[serde(rename = "PXB")]
    Multiple = 20,
    /// Through a PCIe host bridge.
    #[serde(rename = "PHB")]
    HostBridge = 30,
    /// Across host bridges within one NUMA node.
    #[serde(rename = "NODE")]
    Node = 40,
    /// Across NUMA nodes (SMP interconnect).
    #[serde(rename = "SYS")]
    System = 50,
}

impl PcieLevel {
    /// The abbreviation `nvidia-smi topo -m` prints.
    pub fn short_name(self) -> &'static str {
        match self {
            PcieLevel::Internal => "X",
            PcieLevel::Single => "PIX",
            PcieLevel::Multiple => "PXB",
            PcieLevel::HostBridge => "PHB",
            PcieLevel::Node => "NODE",
            PcieLevel::System => "SYS",
        }
    }
}

impl fmt::Display for PcieLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    pub name: String,
    pub uuid: String,
    pub memory_mib: u64,
    pub sm_count: u32,
    #[serde(default = "default_max_threads_per_sm")]
    pub max_threads_per_sm: u32,
    /// "major.minor", e.g. "8.0".
    #[serde(default = "default_compute_capability")]
    pub compute_capability: String,
    /// Extended form "DDDDDDDD:BB:DD.F", as NVML prints it.
    pub pci_bus_id: String,
    /// N in /dev/nvidiaN.
    pub minor: u32,
    #[serde(default)]
    pub numa_node: i32,
    /// Board power limit in watts (shown by nvidia-smi).
    #[serde(default = "default_power_w")]
    pub power_limit_w: u32,
    /// Device memory a context takes while it lives (the real driver's
    /// code, stacks and internal buffers: hundreds of MiB on big GPUs).
    #[serde(default)]
    pub context_overhead_mib: u64,
    /// Key of the GPU's MIG geometry in [`crate::mig::MODELS`]; `None`: the
    /// GPU is not MIG-capable.
    #[serde(default)]
    pub mig: Option<String>,
}

fn default_max_threads_per_sm() -> u32 {
    2048
}
fn default_compute_capability() -> String {
    "8.0".into()
}
fn default_power_w() -> u32 {
    400
}

impl GpuSpec {
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }

    /// Device memory one context takes while it lives.
    pub fn context_overhead_bytes(&self) -> u64 {
        self.context_overhead_mib * 1024 * 1024
    }

    /// (major, minor) of the compute capability; validated at parse time.
    pub fn compute_capability(&self) -> (i32, i32) {
        parse_cc(&self.compute_capability).unwrap_or((8, 0))
    }

    /// The GPU's MIG geometry, when it is MIG-capable; validated at parse time.
    pub fn mig_model(&self) -> Option<&'static crate::mig::MigModel> {
        crate::mig::model(self.mig.as_deref()?)
    }

    /// PCI (domain, bus, device, function) from `pci_bus_id`; validated at parse time.
    pub fn pci_location(&self) -> (u32, u32, u32, u32) {
        parse_bus_id(&self.pci_bus_id).unwrap_or_default()
    }
}

/// How the simulated NVML takes and publishes per-process utilization
/// samples (`[nvml_sampling]`; all 0 by default: on a 100 ms grid, at once,
/// none skipped). A real driver's wander, come late and skip a period now
/// and then (`config/nodes/sim-1gpu-driver-sampling.toml`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlSampling {
    /// Most a period's end comes after its nominal time, ns (below 50 ms).
    #[serde(default)]
    pub wander_ns: u64,
    /// Most a sample is published after its period ends, ns (below 1 s).
    #[serde(default)]
    pub late_ns: u64,
    /// One period in this many is skipped, its time folded into the next
    /// sample (0: never).
    #[serde(default)]
    pub skip_one_in: u64,
    /// Device utilization (`nvmlDeviceGetUtilizationRates`) is the busy
    /// share of the last period of this length that ended and was
    /// published (half of `late_ns` after its end), as NVML documents it
    /// ("over the past sample period", 1/6 s to 1 s by product); 0: the
    /// last second up to now.
    #[serde(default)]
    pub device_period_ns: u64,
}

impl NvmlSampling {
    /// The window `nvmlDeviceGetUtilizationRates` reports at `now`
    /// (CLOCK_MONOTONIC ns). NVML documents it as "the past sample period",
    /// between 1/6 s and 1 s by product (`nvmlUtilization_t` in the NVML API
    /// reference): with a `device_period_ns`, the last period of that grid
    /// whose value is published (half the node's lateness after its end);
    /// without, the last second up to `now`.
    pub fn device_window(&self, now: u64) -> (u64, u64) {
        let d = self.device_period_ns;
        if d == 0 {
            return (now.saturating_sub(1_000_000_000), now);
        }
        let k = now.saturating_sub(self.late_ns / 2) / d;
        (k.saturating_sub(1) * d, k * d)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Indices into the `[[gpu]]` list.
    pub gpus: [usize; 2],
    pub pcie: Option<PcieLevel>,
    #[serde(default)]
    pub nvlink: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: String,
    driver_version: String,
    cuda_version: String,
    #[serde(default = "default_wave_ns")]
    kernel_wave_ns: u64,
    #[serde(default = "default_switch_ns")]
    context_switch_ns: u64,
    #[serde(default = "default_timeslice_ns")]
    timeslice_ns: u64,
    #[serde(default)]
    nvml_sampling: NvmlSampling,
    #[serde(default)]
    gpu: Vec<toml::Spanned<GpuSpec>>,
    #[serde(default)]
    link: Vec<toml::Spanned<LinkSpec>>,
}

fn default_wave_ns() -> u64 {
    DEFAULT_WAVE_NS
}
fn default_switch_ns() -> u64 {
    DEFAULT_SWITCH_NS
}
fn default_timeslice_ns() -> u64 {
    DEFAULT_TIMESLICE_NS
}

/// A parsed and validated node description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub name: String,
    /// e.g. "550.54.15"; the libraries are installed as `lib*.so.<this>`.
    pub driver_version: String,
    /// CUDA driver API version as cuDriverGetVersion reports it, e.g. 12040.
    pub cuda_version: i32,
    /// Block time of the law of kernels that declare none
    /// ([`crate::law::Law::default_for`]).
    pub kernel_wave_ns: u64,
    /// Idle device time of a switch between processes' contexts.
    pub context_switch_ns: u64,
    /// How long a context keeps the device while another process waits;
    /// 0: never preempted.
    pub timeslice_ns: u64,
    pub nvml_sampling: NvmlSampling,
    pub gpus: Vec<GpuSpec>,
    /// `pcie[i][j]`: PCIe level between GPU i and j.
    pcie: Vec<Vec<PcieLevel>>,
    /// `nvlink[i][j]`: NVLink links between GPU i and j.
    nvlink: Vec<Vec<u32>>,
    /// The text it was parsed from, so installs can copy it verbatim.
    pub source: String,
}

impl NodeSpec {
    pub fn load(path: &Path) -> Result<NodeSpec, NodeError> {
        let text = std::fs::read_to_string(path).map_err(|source| NodeError::Read {
            path: path.display().to_string(),
            source,
        })?;
        NodeSpec::parse(&text, &path.display().to_string())
    }

    /// Parses `text`; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<NodeSpec, NodeError> {
        let raw: RawNode = toml::from_str(text).map_err(|e| NodeError::Parse {
            path: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
        let src = Source { text, origin };
        let cuda_version = src.check_node(&raw)?;
        let mut gpus: Vec<GpuSpec> = Vec::with_capacity(raw.gpu.len());
        for (i, g) in raw.gpu.iter().enumerate() {
            src.check_gpu(i, g, &gpus)?;
            gpus.push(g.get_ref().clone());
        }
        let (pcie, nvlink) = src.topology(&gpus, &raw.link)?;
        Ok(NodeSpec {
            name: raw.name,
            driver_version: raw.driver_version,
            cuda_version,
            kernel_wave_ns: raw.kernel_wave_ns,
            context_switch_ns: raw.context_switch_ns,
            timeslice_ns: raw.timeslice_ns,
            nvml_sampling: raw.nvml_sampling,
            gpus,
            pcie,
            nvlink,
            source: text.to_string(),
        })
    }

    /// PCIe level between two GPUs (by index).
    pub fn pcie_level(&self, a: usize, b: usize) -> PcieLevel {
        self.pcie[a][b]
    }

    /// NVLink links between two GPUs (by index).
    pub fn nvlink_count(&self, a: usize, b: usize) -> u32 {
        self.nvlink[a][b]
    }

    /// Whether GPU `a` can map GPU `b`'s memory (peer access): over NVLink,
    /// or over PCIe without a host bridge between NUMA nodes' root
    /// complexes in the way (PIX, PXB, PHB), as the driver reports through
    /// `cuDeviceCanAccessPeer`. Never a GPU with itself.
    pub fn peer_capable(&self, a: usize, b: usize) -> bool {
        a != b
            && (self.nvlink[a][b] > 0
                || matches!(
                    self.pcie[a][b],
                    PcieLevel::Internal
                        | PcieLevel::Single
                        | PcieLevel::Multiple
                        | PcieLevel::HostBridge
                ))
    }

    /// Index of the GPU with this minor number.
    pub fn gpu_by_minor(&self, minor: u32) -> Option<usize> {
        self.gpus.iter().position(|g| g.minor == minor)
    }

    /// "12.4" for 12040.
    pub fn cuda_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.cuda_version / 1000,
            (self.cuda_version % 1000) / 10
        )
    }
}

fn parse_cuda_version(s: &str) -> Option<i32> {
    let (major, minor) = s.split_once('.')?;
    let major: i32 = major.parse().ok()?;
    let minor: i32 = minor.parse().ok()?;
    ((1..=99).contains(&major) && (0..=99).contains(&minor)).then_some(major * 1000 + minor * 10)
}

fn is_driver_version(s: &str) -> bool {
    let parts: Vec<&str> = s.split('.').collect();
    (2..=3).contains(&parts.len())
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

fn parse_cc(s: &str) -> Option<(i32, i32)> {
    let (a, b) = s.split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Parses "DDDDDDDD:BB:DD.F" (the domain may be 4 or 8 hex digits).
pub fn parse_bus_id(s: &str) -> Option<(u32, u32, u32, u32)> {
    let mut it = s.split(':');
    let domain = it.next()?;
    let bus = it.next()?;
    let rest = it.next()?;
    if it.next().is_some() || !(domain.len() == 4 || domain.len() == 8) || bus.len() != 2 {
        return None;
    }
    let (dev, func) = rest.split_once('.')?;
    if dev.len() != 2 || func.len() != 1 {
        return None;
    }
    Some((
        u32::from_str_radix(domain, 16).ok()?,
        u32::from_str_radix(bus, 16).ok()?,
        u32::from_str_radix(dev, 16).ok()?,
        u32::from_str_radix(func, 16).ok()?,
    ))
}

/// The text a node file was parsed from, for errors that name the line.
struct Source<'a> {
    text: &'a str,
    origin: &'a str,
}

impl Source<'_> {
    fn invalid(&self, offset: usize, field: &str, message: String) -> NodeError {
        let text = self.text;
        NodeError::Invalid {
            path: self.origin.to_string(),
            line: text[..offset.min(text.len())].matches('\n').count() + 1,
            field: field.to_string(),
            message,
        }
    }

    /// The node-wide keys; returns the CUDA version.
    fn check_node(&self, raw: &RawNode) -> Result<i32, NodeError> {
        let (text, invalid) = (self.text, |o, f: &str, m| self.invalid(o, f, m));
        let cuda_version = parse_cuda_version(&raw.cuda_version).ok_or_else(|| {
            let at = text.find("cuda_version").unwrap_or(0);
            invalid(
                at,
                "cuda_version",
                format!("{:?} is not MAJOR.MINOR (e.g. \"12.4\")", raw.cuda_version),
            )
        })?;
        if !is_driver_version(&raw.driver_version) {
            let at = text.find("driver_version").unwrap_or(0);
            return Err(invalid(
                at,
                "driver_version",
                format!(
                    "{:?} is not a dotted driver version (e.g. \"550.54.15\")",
                    raw.driver_version
                ),
            ));
        }
        if raw.gpu.is_empty() {
            return Err(invalid(
                0,
                "gpu",
                "at least one [[gpu]] table is required".into(),
            ));
        }
        if raw.gpu.len() > MAX_GPUS {
            return Err(invalid(
                raw.gpu[MAX_GPUS].span().start,
                "gpu",
                format!(
                    "{} GPUs; the simulator supports at most {MAX_GPUS}",
                    raw.gpu.len()
                ),
            ));
        }
        let ns = raw.nvml_sampling;
        if ns.wander_ns >= 50_000_000
            || ns.late_ns >= 1_000_000_000
            || ns.device_period_ns > 1_000_000_000
        {
            let at = text.find("nvml_sampling").unwrap_or(0);
            return Err(invalid(
                at,
                "nvml_sampling",
                "wander_ns must be below 50 ms, late_ns below 1 s, device_period_ns at most 1 s"
                    .into(),
            ));
        }
        if raw.kernel_wave_ns == 0 {
            let at = text.find("kernel_wave_ns").unwrap_or(0);
            return Err(invalid(at, "kernel_wave_ns", "must be above 0".into()));
        }
        Ok(cuda_version)
    }

    /// One `[[gpu]]` table, against those before it.
    fn check_gpu(
        &self,
        i: usize,
        g: &toml::Spanned<GpuSpec>,
        gpus: &[GpuSpec],
    ) -> Result<(), NodeError> {
        let (text, invalid) = (self.text, |o, f: &str, m| self.invalid(o, f, m));
        let spec = g.get_ref();
        let field = |f: &str| format!("gpu[{i}].{f}");
        // Point at the offending key's own line when it is written out.
        let span = g.span();
        // The span may cover only the `[[gpu]]` header: the table runs
        // to the next header.
        let rest = &text[span.start.min(text.len())..];
        let table = &rest[..rest[1..].find("\n[").map_or(rest.len(), |e| e + 1)];
        let key_at = |key: &str| {
            table
                .match_indices(key)
                .find(|(k, _)| table[k + key.len()..].trim_start().starts_with('='))
                .map_or(span.start, |(k, _)| span.start + k)
        };
        if spec.memory_mib == 0 {
            return Err(invalid(
                key_at("memory_mib"),
                &field("memory_mib"),
                "must be above 0".into(),
            ));
        }
        if spec.context_overhead_mib >= spec.memory_mib {
            return Err(invalid(
                key_at("context_overhead_mib"),
                &field("context_overhead_mib"),
                format!("must be below memory_mib ({})", spec.memory_mib),
            ));
        }
        if spec.sm_count == 0 {
            return Err(invalid(
                key_at("sm_count"),
                &field("sm_count"),
                "must be above 0".into(),
            ));
        }
        if spec.max_threads_per_sm == 0 {
            return Err(invalid(
                key_at("max_threads_per_sm"),
                &field("max_threads_per_sm"),
                "must be above 0".into(),
            ));
        }
        if parse_cc(&spec.compute_capability).is_none() {
            return Err(invalid(
                key_at("compute_capability"),
                &field("compute_capability"),
                format!("{:?} is not MAJOR.MINOR", spec.compute_capability),
            ));
        }
        if parse_bus_id(&spec.pci_bus_id).is_none() {
            return Err(invalid(
                key_at("pci_bus_id"),
                &field("pci_bus_id"),
                format!("{:?} is not DDDDDDDD:BB:DD.F", spec.pci_bus_id),
            ));
        }
        if !spec.uuid.starts_with("GPU-") || spec.uuid.len() > 80 {
            return Err(invalid(
                key_at("uuid"),
                &field("uuid"),
                format!("{:?} must look like GPU-xxxxxxxx-xxxx-...", spec.uuid),
            ));
        }
        if let Some(key) = &spec.mig
            && crate::mig::model(key).is_none()
        {
            let known: Vec<&str> = crate::mig::MODELS.iter().map(|m| m.key).collect();
            return Err(invalid(
                key_at("mig"),
                &field("mig"),
                format!("{key:?} is not a MIG model (one of {})", known.join(", ")),
            ));
        }
        if spec.name.len() >= 96 {
            return Err(invalid(
                key_at("name"),
                &field("name"),
                "longer than 95 bytes".into(),
            ));
        }
        for (j, other) in gpus.iter().enumerate() {
            let other: &GpuSpec = other;
            if other.uuid == spec.uuid {
                return Err(invalid(
                    key_at("uuid"),
                    &field("uuid"),
                    format!("same as gpu[{j}]"),
                ));
            }
            if other.minor == spec.minor {
                return Err(invalid(
                    key_at("minor"),
                    &field("minor"),
                    format!("same as gpu[{j}]"),
                ));
            }
            if other.pci_bus_id.eq_ignore_ascii_case(&spec.pci_bus_id) {
                return Err(invalid(
                    key_at("pci_bus_id"),
                    &field("pci_bus_id"),
                    format!("same as gpu[{j}]"),
                ));
            }
        }
        Ok(())
    }

    /// PCIe levels from NUMA nodes and `[[link]]`s; NVLink bandwidths.
    #[allow(clippy::type_complexity)]
    fn topology(
        &self,
        gpus: &[GpuSpec],
        links: &[toml::Spanned<LinkSpec>],
    ) -> Result<(Vec<Vec<PcieLevel>>, Vec<Vec<u32>>), NodeError> {
        let n = gpus.len();
        let mut pcie = vec![vec![PcieLevel::System; n]; n];
        let mut nvlink = vec![vec![0u32; n]; n];
        for i in 0..n {
            for j in 0..n {
                pcie[i][j] = if i == j {
                    PcieLevel::Internal
                } else if gpus[i].numa_node == gpus[j].numa_node {
                    PcieLevel::Node
                } else {
                    PcieLevel::System
                };
            }
        }
        for (k, l) in links.iter().enumerate() {
            let at = l.span().start;
            let link = l.get_ref();
            let [a, b] = link.gpus;
            if a >= n || b >= n || a == b {
                return Err(self.invalid(
                    at,
                    &format!("link[{k}].gpus"),
                    format!("[{a}, {b}] must name two different GPUs below {n}"),
                ));
            }
            if let Some(level) = link.pcie {
                pcie[a][b] = level;
                pcie[b][a] = level;
            }
            nvlink[a][b] = link.nvlink;
            nvlink[b][a] = link.nvlink;
        }
        Ok((pcie, nvlink))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"
name = "t"
driver_version = "550.54.15"
cuda_version = "12.4"

[[gpu]]
name = "NVIDIA A100"
uuid = "GPU-00000000-0000-0000-0000-000000000000"
memory_mib = 1024
sm_count = 4
pci_bus_id = "00000000:07:00.0"
minor = 0

[[gpu]]
name = "NVIDIA A100"
uuid = "GPU-00000000-0000-0000-0000-000000000001"
memory_mib = 1024
sm_count = 4
pci_bus_id = "00000000:08:00.0"
minor = 1
numa_node = 1

[[link]]
gpus = [0, 1]
nvlink = 4
"#;

    #[test]
    fn parses_and_derives_topology() {
        let n = NodeSpec::parse(TWO, "two.toml").unwrap();
        assert_eq!(n.cuda_version, 12040);
        assert_eq!(n.cuda_version_string(), "12.4");
        assert_eq!(n.gpus.len(), 2);
        assert_eq!(
            n.pcie_level(0, 1),
            PcieLevel::System,
            "different NUMA nodes default to SYS"
        );
        assert_eq!(n.pcie_level(1, 1), PcieLevel::Internal);
        assert_eq!(n.nvlink_count(1, 0), 4);
        assert_eq!(n.gpus[0].pci_location(), (0, 7, 0, 0));
        assert_eq!(n.gpu_by_minor(1), Some(1));
        assert!(n.peer_capable(0, 1), "NVLink joins them across NUMA nodes");
        assert!(!n.peer_capable(1, 1), "never a GPU with itself");
        let pcie_only = NodeSpec::parse(&TWO.replace("nvlink = 4", "nvlink = 0"), "t").unwrap();
        assert!(!pcie_only.peer_capable(0, 1), "SYS: no PCIe peer access");
        let switch = NodeSpec::parse(&TWO.replace("nvlink = 4", "pcie = \"PIX\""), "t").unwrap();
        assert!(switch.peer_capable(1, 0), "one PCIe switch");
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let text = TWO.replace(
            "sm_count = 4\npci_bus_id = \"00000000:08",
            "sm_cont = 4\npci_bus_id = \"00000000:08",
        );
        let err = NodeSpec::parse(&text, "bad.toml").unwrap_err().to_string();
        assert!(err.contains("sm_cont"), "{err}");
        assert!(err.contains("line"), "{err}");
        assert!(err.contains("bad.toml"), "{err}");
    }

    #[test]
    fn invalid_value_names_field_and_line() {
        let text = TWO.replace("\"00000000:08:00.0\"", "\"8:00.0\"");
        let err = NodeSpec::parse(&text, "bad.toml").unwrap_err();
        match &err {
            NodeError::Invalid { line, field, .. } => {
                assert_eq!(field, "gpu[1].pci_bus_id");
                assert_eq!(*line, 19, "{err}");
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn duplicate_minor_is_refused() {
        let text = TWO.replace("minor = 1", "minor = 0");
        let err = NodeSpec::parse(&text, "x").unwrap_err().to_string();
        assert!(
            err.contains("gpu[1].minor") && err.contains("same as gpu[0]"),
            "{err}"
        );
    }

    #[test]
    fn context_overhead_defaults_to_zero_and_must_fit_the_card() {
        let n = NodeSpec::parse(TWO, "x").unwrap();
        assert_eq!(n.gpus[0].context_overhead_bytes(), 0);
        let text = TWO.replacen("minor = 0", "minor = 0\ncontext_overhead_mib = 300", 1);
        let n = NodeSpec::parse(&text, "x").unwrap();
        assert_eq!(n.gpus[0].context_overhead_bytes(), 300 << 20);
        let text = TWO.replacen("minor = 0", "minor = 0\ncontext_overhead_mib = 1024", 1);
        let err = NodeSpec::parse(&text, "x").unwrap_err().to_string();
        assert!(
            err.contains("gpu[0].context_overhead_mib") && err.contains("below memory_mib"),
            "{err}"
        );
    }

    #[test]
    fn mig_key_names_a_known_model() {
        let n = NodeSpec::parse(TWO, "x").unwrap();
        assert!(
            n.gpus[0].mig_model().is_none(),
            "not MIG-capable by default"
        );
        let text = TWO.replacen("minor = 0", "minor = 0\nmig = \"h100-80gb\"", 1);
        let n = NodeSpec::parse(&text, "x").unwrap();
        assert_eq!(n.gpus[0].mig_model().unwrap().key, "h100-80gb");
        let text = TWO.replacen("minor = 0", "minor = 0\nmig = \"v100\"", 1);
        let err = NodeSpec::parse(&text, "x").unwrap_err().to_string();
        assert!(
            err.contains("gpu[0].mig") && err.contains("h100-80gb"),
            "{err}"
        );
    }

    #[test]
    fn bad_link_is_refused() {
        let text = TWO.replace("gpus = [0, 1]", "gpus = [0, 5]");
        let err = NodeSpec::parse(&text, "x").unwrap_err().to_string();
        assert!(err.contains("link[0].gpus"), "{err}");
    }

    #[test]
    fn bus_ids() {
        assert_eq!(parse_bus_id("0000:3b:00.0"), Some((0, 0x3b, 0, 0)));
        assert_eq!(parse_bus_id("00000000:3B:00.1"), Some((0, 0x3b, 0, 1)));
        assert_eq!(parse_bus_id("3B:00.0"), None);
    }
}
