//! Start, run, hand over, stop: what keeps one manager serving a node.

pub mod daemon;
pub mod dynamic_mig;
pub mod handover;
pub mod owner;
pub mod supervise;
pub mod tasks;
pub mod uninstall;
