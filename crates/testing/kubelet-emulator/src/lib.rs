//! An emulated kubelet device manager, faithful enough for device plugins to
//! run against it unchanged: it speaks `deviceplugin/v1beta1` (Registration
//! server, DevicePlugin client) and serves `podresources/v1`, chooses device
//! IDs like kubelet, writes kubelet's checkpoint, and on [`KubeletEmulator::restart`]
//! deletes every socket in the dir as kubelet does when it starts.

pub mod checkpoint;
pub mod demo;
mod emulator;

pub use emulator::{
    CHECKPOINT_FILE, DeviceState, EmulatorError, KubeletEmulator, PodRef, ResourceView, View,
};
