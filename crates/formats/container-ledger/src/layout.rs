//! The mapped file's layout: sizes, offsets of the header's fields and of a
//! slot's fields. Fixed for layout [`VERSION`]; the crate docs describe it.

/// File name of the ledger in a container's vm directory (host side).
pub const LEDGER_FILE: &str = "ledger";
/// `b"VCUDALDG"`.
pub const MAGIC: [u8; 8] = *b"VCUDALDG";
/// Layout version.
pub const VERSION: u32 = 1;
/// Header size; slots start here.
pub const HEADER_SIZE: usize = 4096;
/// Number of process slots.
pub const SLOTS: usize = 1024;
/// Size of one slot.
pub const SLOT_SIZE: usize = 64;
/// Size of the whole file.
pub const FILE_SIZE: usize = HEADER_SIZE + SLOTS * SLOT_SIZE;
/// Offset of the compute controller's area in the header.
pub const COMPUTE_OFFSET: usize = 1024;
/// Number of 64-bit words in the compute controller's area.
pub const COMPUTE_WORDS: usize = (HEADER_SIZE - COMPUTE_OFFSET) / 8;
/// Offset of the container's throttled-time counter (u64 ns) in the header.
/// Public because the interposer also reaches it through its long-lived
/// second mapping of the header page (the one that holds the compute
/// words), not only through a [`Ledger`](crate::Ledger).
pub const THROTTLED_NS_OFFSET: usize = 56;
/// Offset of the container's refused-allocations counter (u64) in the header.
pub const REFUSED_ALLOCATIONS_OFFSET: usize = 64;
/// Offset of the compute controller's attribution flag (u64) in the header
/// (see [`Ledger::compute_unattributed`](crate::Ledger::compute_unattributed)); in the compute area's page, which
/// the interposer keeps mapped.
pub const COMPUTE_UNATTRIBUTED_OFFSET: usize = 72;
/// Offset of the container's batch-held counter (u64 ns: its batch-tier
/// launches waited for a latency-tier tenant; docs/qos.md) in the header.
pub const QOS_HELD_NS_OFFSET: usize = 80;
/// Offset of the container's batch-holds counter (u64: its batch-tier
/// launches that waited) in the header; 0 in ledgers of releases before it.
pub const QOS_HOLDS_OFFSET: usize = 88;
const _: () = assert!(
    THROTTLED_NS_OFFSET / 4096 == COMPUTE_OFFSET / 4096,
    "the throttled counter shares the compute area's page"
);

// Header fields.
pub(crate) const OFF_MAGIC: usize = 0;
pub(crate) const OFF_VERSION: usize = 8;
pub(crate) const OFF_HEADER_SIZE: usize = 12;
pub(crate) const OFF_SLOTS: usize = 16;
pub(crate) const OFF_SLOT_SIZE: usize = 20;
pub(crate) const OFF_QUOTA: usize = 24;
pub(crate) const OFF_USED: usize = 32;
pub(crate) const OFF_PEAK: usize = 40;
pub(crate) const OFF_GENERATION: usize = 48;
// Slot fields.
pub(crate) const SLOT_PID: usize = 0;
pub(crate) const SLOT_USED: usize = 8;
pub(crate) const SLOT_PEAK: usize = 16;
/// The process's PID in its own PID namespace (i32; 0 = not yet written).
pub(crate) const SLOT_LOCAL_PID: usize = 24;
