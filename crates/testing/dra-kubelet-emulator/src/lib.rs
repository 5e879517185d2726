//! The kubelet's side of Dynamic Resource Allocation, for tests:
//!
//! * [`plugin`]: finds a DRA driver's registration socket in a
//!   `plugins_registry` directory, runs the handshake (GetInfo, checks,
//!   NotifyRegistrationStatus) and calls NodePrepareResources /
//!   NodeUnprepareResources on the endpoint in the version the driver
//!   offers (v1 preferred, else v1beta1), over the real protobuf.
//! * [`allocator`]: what the scheduler does for a claim, small: first fit
//!   of each request's consumable capacity on the published devices, the
//!   allocation written to the claim's status (API server emulator);
//!   [`selector`]: the CEL selectors it understands (driver and attribute
//!   equalities); [`counters`]: shared counters of partitionable devices.
//! * [`cdi`]: resolves a CDI device ID against spec files the way a
//!   container runtime does, to the container edits it would apply.

pub mod allocator;
pub mod cdi;
pub mod counters;
pub mod plugin;
pub mod selector;
