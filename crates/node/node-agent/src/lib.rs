//! What a vcuda GPU node agent needs in either mode, the device plugins
//! (`gpu-manager`) or the DRA driver (`dra-driver`), which are thin
//! siblings on this crate:
//!
//! * [`config`]: the node's configuration (flags, `GPU_MANAGER_*`
//!   variables, the TOML file both modes read) and its defaults.
//! * [`nvml`]: GPU discovery (PCIe levels, NVLink) and the Xid watcher;
//!   [`health`]: the quiet-period rule over critical Xids.
//! * [`mirror_driver`]: the host's driver mirrored with the interposer.
//! * [`share`]: a container's or a claim's share, opened the same way by
//!   both modes, over [`vm`] (vm directories) and [`registry`] (`vcuda.sock`).
//! * [`edits`]: what a container holding GPUs gets (device nodes, mounts,
//!   env), rendered by each mode (Allocate response, CDI spec).
//! * [`mode`]: one mode per node; [`extra`]: extra devices;
//!   [`display`]: the display service's wiring; [`ledgers`]: the sealed
//!   ledgers, taken back after a restart.
//!
//! Logging, signals and the API server client are `daemon-kit`'s.

pub mod config;
pub mod display;
pub mod edits;
pub mod events;
pub mod extra;
pub mod geometry;
pub mod health;
pub mod in_use;
pub mod ledgers;
pub mod mig;
pub mod mig_nvml;
pub mod mode;
pub mod nvml;
pub mod registry;
pub mod share;
pub mod vm;

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The 16-byte `bus_id` field holds at most 15 characters: drop NVML's
/// 8-digit domain to the usual 4 ("0000:3B:00.0"), as `resource_data_t`
/// carries it.
pub fn short_bus_id(bus: &str) -> String {
    let b = bus.trim_end_matches('\0');
    if b.len() > 15 && b.starts_with("0000") {
        b[4..].to_string()
    } else {
        b.to_string()
    }
}

/// [`vdriver::mirror`], its error naming the host root and the destination.
pub fn mirror_driver(
    host_root: &Path,
    volumes: &vdriver::VolumeConfig,
    dest: &Path,
    interposer: Option<&Path>,
) -> anyhow::Result<vdriver::MirrorReport> {
    vdriver::mirror(host_root, volumes, dest, interposer).with_context(|| {
        format!(
            "mirroring the NVIDIA driver of host root {} into {}",
            host_root.display(),
            dest.display()
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn bus_ids_fit_resource_data() {
        assert_eq!(super::short_bus_id("00000000:3B:00.0\0"), "0000:3B:00.0");
        assert_eq!(super::short_bus_id("0000:3B:00.0"), "0000:3B:00.0");
    }
}
