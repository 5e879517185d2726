//! `gpu-sim mig`: MIG set-up from the command line, as `nvidia-smi -mig 1`
//! then `nvidia-smi mig -cgi <ids> -C` do on a real node: enable MIG mode
//! on a GPU, create GPU instances by profile id, each with one compute
//! instance spanning it, and print the MIG devices with their UUIDs.

use anyhow::{Context, Result, anyhow, bail};
use gpu_sim_core::SharedState;
use gpu_sim_core::mig::mig_uuid;
use gpu_sim_core::state::Activation;

/// Runs `gpu-sim mig` on `gpu`: `enable`, then one GPU instance (with a
/// full compute instance) per id of `create`; lists the MIG devices.
pub fn run(state: &SharedState, gpu: usize, enable: bool, create: &[u32]) -> Result<()> {
    if gpu >= state.gpu_count() {
        bail!("--gpu {gpu}: the node has {} GPUs", state.gpu_count());
    }
    if enable {
        let done = state
            .set_mig_mode(gpu, true)
            .with_context(|| format!("enabling MIG on GPU {gpu}"))?;
        if done == Activation::PendingInUse {
            bail!("GPU {gpu} is in use: MIG mode stays pending until it is idle");
        }
        println!("Enabled MIG Mode for GPU {gpu}");
    }
    for &id in create {
        let g = state
            .create_gpu_instance(gpu, id, None)
            .with_context(|| format!("creating a GPU instance of profile {id} on GPU {gpu}"))?;
        let whole = g
            .profile
            .ci_profiles()
            .find(|c| c.slices == g.profile.slices)
            .ok_or_else(|| anyhow!("profile {id} has no full compute instance"))?;
        let c = state
            .create_compute_instance(gpu, g.id, whole.index, None)
            .with_context(|| format!("creating a compute instance in GPU instance {}", g.id))?;
        println!(
            "Created GPU instance ID {:2} on GPU {gpu} using profile MIG {} (ID {id}), compute instance ID {}",
            g.id, g.profile.name, c.id
        );
    }
    let uuid = &state.node().gpus[gpu].uuid;
    for (g, c) in state.mig_devices(gpu) {
        println!(
            "  MIG {} gi {} ci {} (UUID: {})",
            c.profile.device_name(),
            g.id,
            c.id,
            mig_uuid(uuid, g.id, c.id)
        );
    }
    Ok(())
}
