//! MIG as the node's driver reports it: which GPUs are in MIG mode and the
//! MIG devices (a compute instance inside a GPU instance) they hold. Both
//! daemons read it at start: a GPU in MIG mode has its SMs and memory in
//! hardware partitions, so it is offered neither for shares nor whole
//! (its inventory says so, for the extender and the webhook), and the
//! partitions found are reported as they are (vcuda does not change a
//! geometry it did not make: docs/mig.md).
//!
//! nvml-wrapper 0.13 has no call for a MIG device's instance ids: those
//! two go through its raw symbol table.

use std::path::{Path, PathBuf};

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};

/// One MIG device: the unit a pod is given (`NVIDIA_VISIBLE_DEVICES=MIG-…`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MigDevice {
    /// `MIG-…`.
    pub uuid: String,
    /// The profile, as the device's name ends: `1g.10gb`, `3g.40gb`,
    /// `1c.3g.40gb` for a compute instance smaller than its GPU instance.
    pub profile: String,
    pub gpu_instance: u32,
    pub compute_instance: u32,
    pub memory_bytes: u64,
    /// The compute instance's SMs (NVML's attributes of the MIG handle).
    pub multiprocessors: u32,
}

/// One GPU's MIG state (all false and empty on a GPU without MIG).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigGpu {
    /// It is in MIG mode now.
    pub enabled: bool,
    /// A mode change waits for a GPU reset.
    pub pending_change: bool,
    pub devices: Vec<MigDevice>,
}

#[derive(Debug, thiserror::Error)]
#[error("NVML, GPU {gpu}: {what}: {source}")]
pub struct MigReadError {
    pub gpu: usize,
    pub what: String,
    #[source]
    pub source: NvmlError,
}

/// The MIG state of each of `devices` (discovery's handles, by index).
pub fn read(nvml: &Nvml, devices: &[Device]) -> Result<Vec<MigGpu>, MigReadError> {
    devices
        .iter()
        .enumerate()
        .map(|(gpu, d)| read_gpu(nvml, gpu, d))
        .collect()
}

/// [`read`] of the node's first `count` GPUs, their handles taken again
/// (a daemon's periodic rescan, off its async threads); the error as text.
pub fn read_again(nvml: &Nvml, count: usize) -> Result<Vec<MigGpu>, String> {
    let devices = (0..count)
        .map(|i| nvml.device_by_index(i as u32))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("NVML device handles: {e}"))?;
    read(nvml, &devices).map_err(|e| e.to_string())
}

/// Reads the node's first `count` GPUs' MIG state every `period` (off the
/// async threads, [`read_again`]) until `cancel`, and hands it to `apply`
/// (a daemon's: its devices follow the instances an operator made or
/// destroyed meanwhile). A failure, read or apply, is logged once until
/// one succeeds; what was served stays.
pub fn spawn_rescan(
    period: std::time::Duration,
    nvml: std::sync::Arc<Nvml>,
    count: usize,
    cancel: tokio_util::sync::CancellationToken,
    mut apply: impl FnMut(Vec<MigGpu>) -> Result<(), String> + Send + 'static,
) {
    tokio::spawn(async move {
        let mut failures = FailureLog::default();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(period) => {}
            }
            let n = nvml.clone();
            let r = tokio::task::spawn_blocking(move || read_again(&n, count))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r)
                .and_then(&mut apply);
            failures.note(r, "reading the MIG instances again; kept what was served");
        }
    });
}

/// A periodic pass's failures, each logged once until a pass succeeds
/// (the MIG rescans of both daemons: a driver that fails every period
/// would flood the log with one line).
#[derive(Debug, Default)]
pub struct FailureLog {
    last: String,
}

impl FailureLog {
    /// The pass's value; its error logged as a warning with `what`
    /// unless it is the one logged last.
    pub fn note<T, E: std::fmt::Display>(&mut self, r: Result<T, E>, what: &str) -> Option<T> {
        match r {
            Ok(v) => {
                self.last.clear();
                Some(v)
            }
            Err(e) => {
                let e = e.to_string();
                if e != self.last {
                    tracing::warn!(error = %e, "{what}");
                    self.last = e;
                }
                None
            }
        }
    }
}

fn read_gpu(nvml: &Nvml, gpu: usize, d: &Device) -> Result<MigGpu, MigReadError> {
    let err = |what: &str| {
        let what = what.to_string();
        move |source| MigReadError { gpu, what, source }
    };
    let mode = match d.mig_mode() {
        Ok(m) => m,
        // Not a MIG-capable GPU (or a driver without MIG): nothing to read.
        Err(NvmlError::NotSupported) => return Ok(MigGpu::default()),
        Err(e) => return Err(err("MIG mode")(e)),
    };
    let enabled = mode.current == 1;
    let mut out = MigGpu {
        enabled,
        pending_change: mode.pending != mode.current,
        devices: Vec::new(),
    };
    if !enabled {
        return Ok(out);
    }
    let max = d.mig_device_count().map_err(err("MIG device count"))?;
    for i in 0..max {
        let m = match d.mig_device_by_index(i) {
            Ok(m) => m,
            // Indices past the last instance, or between destroyed ones.
            Err(NvmlError::NotFound) => continue,
            Err(e) => return Err(err(&format!("MIG device {i}"))(e)),
        };
        let name = m.name().map_err(err(&format!("MIG device {i} name")))?;
        out.devices.push(MigDevice {
            uuid: m.uuid().map_err(err(&format!("MIG device {i} UUID")))?,
            profile: profile_of(&name),
            gpu_instance: instance_id(nvml, &m, Which::Gpu)
                .map_err(err(&format!("MIG device {i} GPU instance")))?,
            compute_instance: instance_id(nvml, &m, Which::Compute)
                .map_err(err(&format!("MIG device {i} compute instance")))?,
            memory_bytes: m
                .memory_info()
                .map_err(err(&format!("MIG device {i} memory")))?
                .total,
            multiprocessors: m
                .attributes()
                .map_err(err(&format!("MIG device {i} attributes")))?
                .multiprocessor_count,
        });
    }
    Ok(out)
}

/// Logs each GPU in MIG mode and its MIG devices (both daemons, at start).
pub fn log(gpus: &[MigGpu]) {
    for (gpu, m) in gpus.iter().enumerate() {
        if m.pending_change {
            tracing::warn!(
                gpu,
                enabled = m.enabled,
                "MIG mode change pending a GPU reset: the GPU is served as it is now"
            );
        }
        if !m.enabled {
            continue;
        }
        tracing::info!(
            gpu,
            devices = m.devices.len(),
            "GPU in MIG mode: not offered for shares or whole"
        );
        for d in &m.devices {
            tracing::info!(
                gpu, uuid = %d.uuid, profile = %d.profile, gpu_instance = d.gpu_instance,
                compute_instance = d.compute_instance, memory_mib = d.memory_bytes >> 20, "MIG device"
            );
        }
    }
}

/// `NVIDIA H100 80GB HBM3 MIG 1g.10gb` → `1g.10gb` (the driver names MIG
/// devices so; anything else is kept whole).
pub fn profile_of(name: &str) -> String {
    match name.rsplit_once(" MIG ") {
        Some((_, p)) => p.trim().to_string(),
        None => name.trim().to_string(),
    }
}

enum Which {
    Gpu,
    Compute,
}

fn instance_id(nvml: &Nvml, d: &Device, which: Which) -> Result<u32, NvmlError> {
    let lib = nvml.lib();
    let sym = match which {
        Which::Gpu => nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())?,
        Which::Compute => nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())?,
    };
    let mut id = 0u32;
    // SAFETY: `d` is a live handle of `nvml` (it borrows it), and `id` is
    // a valid place for the one unsigned int the call writes.
    let r = unsafe { sym(d.handle(), &mut id) };
    nvml_try(r)?;
    Ok(id)
}

/// The minors of the two capability nodes a process must open to use a
/// MIG device (`/dev/nvidia-caps/nvidia-cap<m>`): its GPU instance's and
/// its compute instance's `access`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccessCaps {
    pub gpu_instance: u32,
    pub compute_instance: u32,
}

impl AccessCaps {
    /// Both nodes' paths, GPU instance first.
    pub fn node_paths(&self) -> [String; 2] {
        [self.gpu_instance, self.compute_instance]
            .map(|m| format!("/dev/nvidia-caps/nvidia-cap{m}"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CapError {
    #[error("reading {}: {source} (was the MIG device's instance destroyed?)", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: no 'DeviceFileMinor: <n>' line in {text:?}", path.display())]
    Format { path: PathBuf, text: String },
}

/// Where the driver lists its capabilities: under the host root where
/// it is mounted there, else this process's own `/proc` (the driver's
/// proc files are the same in every mount namespace).
fn capabilities_dir(host_root: &Path) -> PathBuf {
    const DIR: &str = "proc/driver/nvidia/capabilities";
    let under = host_root.join(DIR);
    if under.is_dir() {
        under
    } else {
        Path::new("/").join(DIR)
    }
}

/// The access capabilities of `d` on the GPU whose device minor is
/// `gpu_minor`, from the driver's files (`gpu<minor>/mig/gi<G>/access`
/// and `…/ci<C>/access`, each "DeviceFileMinor: <m>"), as NVIDIA's
/// container toolkit reads them.
pub fn access_caps(
    host_root: &Path,
    gpu_minor: u32,
    d: &MigDevice,
) -> Result<AccessCaps, CapError> {
    let gi = capabilities_dir(host_root).join(format!("gpu{gpu_minor}/mig/gi{}", d.gpu_instance));
    let ci = gi.join(format!("ci{}", d.compute_instance));
    Ok(AccessCaps {
        gpu_instance: read_minor(gi.join("access"))?,
        compute_instance: read_minor(ci.join("access"))?,
    })
}

fn read_minor(path: PathBuf) -> Result<u32, CapError> {
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(source) => return Err(CapError::Read { path, source }),
    };
    let minor = text.lines().find_map(|l| {
        l.strip_prefix("DeviceFileMinor:")
            .and_then(|v| v.trim().parse().ok())
    });
    minor.ok_or(CapError::Format { path, text })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_from_device_names() {
        assert_eq!(profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), "1g.10gb");
        assert_eq!(
            profile_of("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb"),
            "1c.3g.20gb"
        );
        assert_eq!(profile_of("NVIDIA H100"), "NVIDIA H100");
    }

    fn device(gi: u32, ci: u32) -> MigDevice {
        MigDevice {
            uuid: "MIG-x".into(),
            profile: "1g.10gb".into(),
            gpu_instance: gi,
            compute_instance: ci,
            memory_bytes: 10 << 30,
            multiprocessors: 16,
        }
    }

    /// The files as open-gpu-kernel-modules' nv_cap_procfs_read prints
    /// them (kernel-open/nvidia/nv-caps.c).
    #[test]
    fn access_caps_from_the_drivers_files() {
        let root = tempfile::tempdir().unwrap();
        let gi = root
            .path()
            .join("proc/driver/nvidia/capabilities/gpu3/mig/gi2");
        std::fs::create_dir_all(gi.join("ci0")).unwrap();
        let file =
            |m: u32| format!("DeviceFileMinor: {m}\nDeviceFileMode: 292\nDeviceFileModify: 1\n");
        std::fs::write(gi.join("access"), file(426)).unwrap();
        std::fs::write(gi.join("ci0/access"), file(427)).unwrap();
        let caps = access_caps(root.path(), 3, &device(2, 0)).unwrap();
        assert_eq!(
            caps.node_paths(),
            [
                "/dev/nvidia-caps/nvidia-cap426",
                "/dev/nvidia-caps/nvidia-cap427"
            ]
        );
        let gone = access_caps(root.path(), 3, &device(2, 1)).unwrap_err();
        assert!(gone.to_string().contains("gi2/ci1/access"), "{gone}");
        std::fs::write(gi.join("ci0/access"), "DeviceFileMode: 292\n").unwrap();
        let bad = access_caps(root.path(), 3, &device(2, 0)).unwrap_err();
        assert!(matches!(bad, CapError::Format { .. }), "{bad}");
    }
}
