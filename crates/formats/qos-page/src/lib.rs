//! The per-GPU QoS page and the latency flags (docs/qos.md, docs/contracts.md).
//!
//! Why pages and not messages: a batch tenant must know, at every kernel
//! launch and within nanoseconds, whether a latency tenant on its GPU has
//! work in flight. Why two kinds: what one tenant writes must never hold
//! another unless that tenant is a latency process, so nothing a batch
//! process maps is writable by it.
//!
//! - **The GPU's page** ([`QosPage`]): one 4 KiB page per GPU (or MIG
//!   device) in a memfd the node agent writes alone: sealed against
//!   resizing and, once the agent has mapped it, against writing
//!   (`F_SEAL_FUTURE_WRITE`), so every tenant maps it read-only. Handed to
//!   batch processes at registration.
//! - **A latency flag** ([`Flag`], [`FlagView`]): one page per latency
//!   process and GPU, made by the node agent and handed to that process
//!   alone, which maps it writable and then seals it against writing
//!   (`F_SEAL_FUTURE_WRITE`, seals sealed). Only flags so sealed are handed
//!   on to the GPU's batch processes, which map them read-only.
//!
//! GPU page, layout version 2 (native endian, 64-bit words):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `VCUDAQOS` |
//! | 8 | version (u32), then 0 |
//! | 16 | latency processes registered on the GPU |
//! | 24 | generation: bumped when one registers or goes |
//! | 1024 + 8i | slot i's host PID, 0 when free |
//!
//! Flag, layout version 1: magic `VCUDAQFL` at 0, version at 8, and at 16
//! the deadline: CLOCK_MONOTONIC ns until which the process's work counts
//! as in flight (0: none). Set by the latency process when it launches,
//! cleared when it synchronises; the deadline bounds how long it counts if
//! it never does. The agent drops a gone process's flag.

mod flag;
mod page;

pub use flag::{Flag, FlagView, make_flag};
pub use page::{Holder, QosError, QosPage};

/// `b"VCUDAQOS"`.
pub const MAGIC: [u8; 8] = *b"VCUDAQOS";
/// The GPU page's layout.
pub const VERSION: u32 = 2;
/// `b"VCUDAQFL"`.
pub const FLAG_MAGIC: [u8; 8] = *b"VCUDAQFL";
/// The flag's layout.
pub const FLAG_VERSION: u32 = 1;
pub const PAGE_SIZE: usize = 4096;
/// Latency slots per GPU.
pub const SLOTS: usize = 64;
/// Name prefix of the page's memfd (`vcuda-qos.<gpu>`).
pub const MEMFD_PREFIX: &str = "vcuda-qos";
/// Name prefix of a flag's memfd (`vcuda-qos-flag.<gpu>.<slot>`).
pub const FLAG_MEMFD_PREFIX: &str = "vcuda-qos-flag";

/// A share's compute tier (docs/qos.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum Tier {
    /// Neither: a plain share, which the page does not concern.
    #[default]
    Plain,
    /// Holds batch launches on its GPU while it has work in flight.
    Latency,
    /// Holds its launches while a latency tenant of the GPU has work.
    Batch,
}

impl Tier {
    pub fn is_plain(&self) -> bool {
        *self == Tier::Plain
    }

    /// The name operators write (annotation, claim config).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Plain => "plain",
            Tier::Latency => "latency",
            Tier::Batch => "batch",
        }
    }

    /// Its number in the registration reply (`QosTier` of
    /// proto/vcuda/registration.proto).
    pub fn wire(self) -> i32 {
        match self {
            Tier::Plain => 0,
            Tier::Latency => 1,
            Tier::Batch => 2,
        }
    }

    /// The tier a reply names; a number of a later release reads as plain.
    pub fn from_wire(n: i32) -> Tier {
        match n {
            1 => Tier::Latency,
            2 => Tier::Batch,
            _ => Tier::Plain,
        }
    }

    pub fn parse(s: &str) -> Result<Tier, QosError> {
        match s {
            "latency" => Ok(Tier::Latency),
            "batch" => Ok(Tier::Batch),
            "plain" | "" => Ok(Tier::Plain),
            other => Err(QosError::Tier(other.chars().take(64).collect())),
        }
    }
}
