//! Pure decisions the manager takes over what it was told: no I/O here, so
//! each is tested on its evidence alone.

pub mod health;
pub mod ids;
pub mod node_status;
pub mod pods;
pub mod recovery;
pub mod response;
