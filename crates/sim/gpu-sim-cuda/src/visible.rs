//! Which devices a process sees, in ordinal order: whole GPUs, and on a GPU
//! in MIG mode its MIG devices (compute instances) instead.
//!
//! As NVIDIA's driver does (MIG User Guide, "Device Nodes and Capabilities"
//! and "CUDA Device Enumeration", docs.nvidia.com/datacenter/tesla/
//! mig-user-guide/): a GPU counts when its device node opens; on a GPU in
//! MIG mode the whole GPU is never a CUDA device, and a MIG device counts
//! when the process can open both its GPU instance's and its compute
//! instance's `access` capability nodes (`/dev/nvidia-caps/nvidia-cap<m>`).
//! The guide's two constraints on CUDA (11/R450 and 12/R525): "CUDA can
//! only enumerate a single compute instance" (the first one, in NVML's
//! order, or the first CUDA_VISIBLE_DEVICES names) and "CUDA will not
//! enumerate non-MIG GPU if any compute instance is enumerated on any
//! other GPU".
//!
//! CUDA_VISIBLE_DEVICES (CUDA Programming Guide, "CUDA Environment
//! Variables"): indices (of the GPUs, as nvidia-smi numbers them), "GPU-"
//! UUID prefixes, "MIG-<uuid>" (the UUIDs NVML reports for MIG devices, a
//! unique prefix allowed) and the older "MIG-GPU-<uuid>/<gi>/<ci>"; parsing
//! stops at the first entry that names no device.

use gpu_sim_core::mig::mig_uuid;
use gpu_sim_core::state::mig_caps;
use gpu_sim_core::{GpuSpec, SharedState};

/// A device this process sees: a GPU, or one MIG device on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Visible {
    pub gpu: usize,
    /// (GPU-instance id, compute-instance id) of a MIG device.
    pub mig: Option<(u32, u32)>,
}

fn opens(path: &std::path::Path) -> bool {
    std::fs::File::open(path).is_ok()
}

fn mig_enabled(state: &SharedState, gpu: usize) -> bool {
    state.mig_mode(gpu).is_ok_and(|(current, _)| current)
}

/// The MIG devices of `gpu` whose capability nodes this process can open.
fn accessible_migs(state: &SharedState, gpu: usize) -> Vec<(u32, u32)> {
    let minor = state.node().gpus[gpu].minor;
    let root = state.root();
    state
        .mig_devices(gpu)
        .into_iter()
        .map(|(g, c)| (g.id, c.id))
        .filter(|&(gi, ci)| {
            opens(&mig_caps::cap_node(root, mig_caps::gi_minor(minor, gi)))
                && opens(&mig_caps::cap_node(root, mig_caps::ci_minor(minor, gi, ci)))
        })
        .collect()
}

/// What a GPU contributes by itself: the GPU, or its first usable MIG
/// device; nothing when it is in MIG mode without one.
fn of_gpu(state: &SharedState, gpu: usize) -> Option<Visible> {
    if !mig_enabled(state, gpu) {
        return Some(Visible { gpu, mig: None });
    }
    let mig = accessible_migs(state, gpu).into_iter().next()?;
    Some(Visible {
        gpu,
        mig: Some(mig),
    })
}

/// The MIG device a "MIG-…" entry names among the present GPUs.
fn by_mig_name(state: &SharedState, present: &[usize], entry: &str) -> Option<Visible> {
    let gpus = &state.node().gpus;
    let want = entry.to_ascii_lowercase();
    let mut found = Vec::new();
    for &gpu in present.iter().filter(|&&g| mig_enabled(state, g)) {
        let uuid = &gpus[gpu].uuid;
        for (gi, ci) in accessible_migs(state, gpu) {
            let legacy = format!("MIG-{uuid}/{gi}/{ci}").to_ascii_lowercase();
            let named = mig_uuid(uuid, gi, ci).to_ascii_lowercase();
            if legacy == want || named.starts_with(&want) {
                found.push(Visible {
                    gpu,
                    mig: Some((gi, ci)),
                });
            }
        }
    }
    // An ambiguous prefix names nothing.
    (found.len() == 1).then(|| found[0])
}

fn by_entry(state: &SharedState, present: &[usize], entry: &str) -> Option<Visible> {
    let gpus = &state.node().gpus;
    if let Ok(i) = entry.parse::<usize>() {
        return of_gpu(state, *present.get(i)?);
    }
    if entry.len() > 4 && entry.starts_with("MIG-") {
        return by_mig_name(state, present, entry);
    }
    if entry.len() > 4 && entry.starts_with("GPU-") {
        let want = entry.to_ascii_lowercase();
        let matches: Vec<usize> = present
            .iter()
            .copied()
            .filter(|&g| gpus[g].uuid.to_ascii_lowercase().starts_with(&want))
            .collect();
        return match matches.as_slice() {
            [g] => of_gpu(state, *g),
            _ => None,
        };
    }
    None
}

/// Adds `v` unless it is a second MIG device (one MIG device per process:
/// later ones are not enumerated); `false` when `v`'s GPU is already in.
fn push(out: &mut Vec<Visible>, v: Visible) -> bool {
    if out.iter().any(|o| o.gpu == v.gpu) {
        return false;
    }
    if v.mig.is_none() || out.iter().all(|o| o.mig.is_none()) {
        out.push(v);
    }
    true
}

/// The devices this process sees, in ordinal order.
pub(crate) fn visible(state: &SharedState, env: Option<&str>) -> Vec<Visible> {
    let present = state.visible_gpus();
    let mut out = Vec::new();
    let Some(env) = env else {
        for v in present.iter().filter_map(|&g| of_gpu(state, g)) {
            push(&mut out, v);
        }
        return only_the_mig_device(out);
    };
    for entry in env.split(',').map(str::trim) {
        match by_entry(state, &present, entry) {
            Some(v) if push(&mut out, v) => {}
            _ => break,
        }
    }
    only_the_mig_device(out)
}

/// A MIG device, once enumerated, is the only device.
fn only_the_mig_device(out: Vec<Visible>) -> Vec<Visible> {
    match out.iter().find(|v| v.mig.is_some()) {
        Some(&m) => vec![m],
        None => out,
    }
}

/// The description of device `v`, for the process's life: a MIG device
/// takes its compute instance's SMs, its GPU instance's memory, the name
/// and UUID NVML reports for it (`gpu-sim-nvml`'s `mig_device.rs`), and
/// keeps the parent's PCI location and the rest.
pub(crate) fn spec_of(state: &SharedState, v: Visible) -> &'static GpuSpec {
    let parent = &state.node().gpus[v.gpu];
    let mut spec = parent.clone();
    let instance = v.mig.and_then(|(gi, ci)| {
        let devs = state.mig_devices(v.gpu);
        devs.into_iter().find(|(g, c)| (g.id, c.id) == (gi, ci))
    });
    if let Some((g, c)) = instance {
        spec.name = format!("{} MIG {}", parent.name, c.profile.device_name());
        spec.uuid = mig_uuid(&parent.uuid, g.id, c.id);
        spec.sm_count = c.profile.sms();
        spec.memory_mib = g.profile.memory_mib;
    }
    Box::leak(Box::new(spec))
}
