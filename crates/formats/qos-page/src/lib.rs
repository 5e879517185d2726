//! The per-GPU QoS page (docs/qos.md, docs/contracts.md).
//!
//! Why a page and not a message: a batch tenant must know, at every kernel
//! launch and within nanoseconds, whether a latency tenant on its GPU has
//! work in flight. So the node agent keeps one 4 KiB page per GPU in a
//! sealed memfd (its size can never change, so no holder can make another's
//! mapping fault) and hands it, at registration, to every share process on
//! that GPU; latency-tier processes also get a slot in it.
//!
//! Layout (version 1, native endian, every field a 64-bit word):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `VCUDAQOS` |
//! | 8 | version (u32), then 0 |
//! | 16 | latency processes registered on the GPU (the node agent's count) |
//! | 24 | active: bit i set while latency slot i has work in flight |
//! | 32 | batch launch time held, ns, all batch processes of the GPU |
//! | 40 | holds: batch launches that waited |
//! | 512 + 8i | slot i's deadline: CLOCK_MONOTONIC ns after which its bit no longer counts |
//! | 1024 + 8i | slot i's host PID, 0 when free (the node agent's) |
//!
//! The bit is set by a latency process when it launches and cleared when
//! it synchronises; the deadline bounds how long a bit counts if it never
//! does (or dies first: the node agent also clears a dead process's slot).

mod page;

pub use page::{ACTIVE_OFF, Holder, QosError, QosPage};

/// `b"VCUDAQOS"`.
pub const MAGIC: [u8; 8] = *b"VCUDAQOS";
pub const VERSION: u32 = 1;
pub const PAGE_SIZE: usize = 4096;
/// Latency slots per GPU (bits of the active word).
pub const SLOTS: usize = 64;
/// Name prefix of the page's memfd (`vcuda-qos.<gpu>`).
pub const MEMFD_PREFIX: &str = "vcuda-qos";

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
