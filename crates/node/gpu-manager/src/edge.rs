//! The protocol edges: what kubelet and the display service speak. Typed
//! refusals from the decisions are rendered to the wire here.

pub mod display;
pub mod plugin;
pub mod served;
