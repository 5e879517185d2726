//! The mapped file's layout, and making (`install`) and mapping (`open`) it.
//!
//! Several processes map this file at once, each built from this crate at
//! possibly different commits: field order, sizes and offsets are the
//! contract (`LAYOUT_VERSION`), pinned by the assertions below.

use super::{SharedState, SimRoot, StateError, io_err};
use crate::node::{MAX_GPUS, NodeSpec};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64};

/// Process slots in the shared table.
pub const MAX_PROCS: usize = 256;
/// Kernel intervals remembered per GPU for utilization sampling.
pub const RING: usize = 16384;
/// Xid events remembered.
pub const XID_RING: usize = 64;
/// Preemptions remembered per GPU (`slice.rs`): a process resolves the
/// times of its queued work against these.
pub const SHIFTS: usize = 128;

const MAGIC: [u8; 8] = *b"GPUSIM\0\x01";
/// 2: a `MigBlock` per GPU after the process table (MIG mode and
/// instances). 3: then, on a node with a MIG-capable GPU, each process
/// slot's MIG binding per GPU and a `DeviceBlock` per GPU instance id of
/// each GPU (its memory and timeline). 4: a `SliceBlock` ends each
/// `DeviceBlock` (time-slicing between processes' contexts).
const LAYOUT_VERSION: u32 = 4;

// ---- shared layout -------------------------------------------------------

#[repr(C)]
pub(super) struct Header {
    pub(super) magic: [u8; 8],
    pub(super) layout_version: u32,
    pub(super) gpu_count: u32,
    pub(super) node_hash: u64,
    pub(super) xid_head: AtomicU64,
    _pad: [u8; 4096 - 32 - XID_RING * 32],
    pub(super) xids: [XidSlot; XID_RING],
}

#[repr(C)]
pub(super) struct XidSlot {
    pub(super) seq: AtomicU64,
    pub(super) gpu: AtomicU32,
    pub(super) code: AtomicU32,
    pub(super) time_ns: AtomicU64,
    /// The MIG instance the Xid names: 0 for none, else
    /// `(GI + 1) << 32 | (CI + 1)` (a zeroed slot reads as none).
    pub(super) instance: AtomicU64,
}

#[repr(C)]
pub(super) struct DeviceBlock {
    pub(super) used: AtomicU64,
    pub(super) busy_until: AtomicU64,
    pub(super) ring_head: AtomicU64,
    /// Owner of the last kernel queued (whose context the device holds).
    pub(super) last_owner: AtomicU64,
    /// Start of the last kernel queued in order, and the device capacity
    /// (of `timeline::FULL`) it and the kernels beside it leave free.
    pub(super) group_start: AtomicU64,
    pub(super) group_room: AtomicU64,
    _pad: [u64; 2],
    pub(super) ring: [Interval; RING],
    pub(super) slices: SliceBlock,
}

/// A device's time-slicing state (`slice.rs`).
#[repr(C)]
pub(super) struct SliceBlock {
    /// 1 while a process places a preempting kernel.
    pub(super) lock: AtomicU64,
    /// The latest run of preempting work: its process, start and end.
    pub(super) seg_owner: AtomicU64,
    pub(super) seg_start: AtomicU64,
    pub(super) seg_end: AtomicU64,
    /// Shifts written so far.
    pub(super) head: AtomicU64,
    /// The largest `old_busy` of any shift: later times never move.
    pub(super) max_old_busy: AtomicU64,
    _pad: [u64; 2],
    pub(super) shifts: [Shift; SHIFTS],
}

/// Work queued in (`at`, `old_busy`] when the shift was made moved
/// `amount` later: another process's kernel ran at `at`.
#[repr(C)]
pub(super) struct Shift {
    /// Index + 1 of the shift; 0 while being written.
    pub(super) seq: AtomicU64,
    pub(super) at: AtomicU64,
    pub(super) old_busy: AtomicU64,
    pub(super) amount: AtomicU64,
    /// The preempting process (its own work did not move, unless
    /// [`MOVES_OWN`] is set).
    pub(super) owner: AtomicU64,
    pub(super) flags: AtomicU64,
    _pad: [u64; 2],
}

/// `Shift::flags`: the owner's own queued work moved too (a kernel of a
/// higher-priority stream went ahead of it).
pub(super) const MOVES_OWN: u64 = 1;

#[repr(C)]
pub(super) struct Interval {
    /// Index + 1 of the launch that wrote it; 0 while being written.
    pub(super) seq: AtomicU64,
    pub(super) start: AtomicU64,
    pub(super) end: AtomicU64,
    /// Owner: slot index in the low 16 bits, slot generation above.
    pub(super) owner: AtomicU64,
}

pub(super) const SLOT_FREE: u32 = 0;
pub(super) const SLOT_LIVE: u32 = 1;

#[repr(C)]
pub(super) struct ProcSlot {
    pub(super) state: AtomicU32,
    pub(super) generation: AtomicU32,
    /// PID in the initial namespace; 0 until known.
    pub(super) host_pid: AtomicI32,
    /// PID in the process's own namespace.
    pub(super) ns_pid: AtomicI32,
    pub(super) pidns_ino: AtomicU64,
    /// Bit i: the process has a context on GPU i.
    pub(super) active: AtomicU64,
    pub(super) comm: [AtomicU64; 4],
    pub(super) used: [AtomicU64; MAX_GPUS],
}

/// A GPU's MIG state (see `mig`): mode, and one word per GPU-instance id.
#[repr(C)]
pub(super) struct MigBlock {
    /// Bit 0: current mode, bit 1: pending mode (1 = enabled).
    pub(super) mode: AtomicU64,
    /// By GPU-instance id (`mig::gi_id_of`): 0 = none; else the low byte is
    /// the GI profile index + 1 and byte k + 1 is compute instance k (0 =
    /// none; else low nibble = CI profile index + 1, high nibble = start).
    pub(super) gis: [AtomicU64; crate::mig::MAX_GI_IDS],
}

/// Per process slot and GPU: the MIG device the process uses there, 0 for
/// the whole GPU, else `(gi + 1) | (ci + 1) << 8` (see `mig_use`).
pub(super) type MigBinding = [AtomicU32; MAX_GPUS];

const HEADER_SIZE: usize = std::mem::size_of::<Header>();
const DEVICE_SIZE: usize = std::mem::size_of::<DeviceBlock>();
const SLOT_SIZE: usize = std::mem::size_of::<ProcSlot>();
const MIG_SIZE: usize = std::mem::size_of::<MigBlock>();

const BINDING_SIZE: usize = std::mem::size_of::<MigBinding>();

/// End of the version-2 part; the MIG usage part follows on MIG nodes.
fn base_len(gpus: usize) -> usize {
    HEADER_SIZE + gpus * DEVICE_SIZE + MAX_PROCS * SLOT_SIZE + gpus * MIG_SIZE
}

/// Bytes of the state of a node with `gpus` GPUs; `mig`: one of them is
/// MIG-capable (the GPU-instance blocks are 7.5 MiB a GPU, sparse).
fn layout_len(gpus: usize, mig: bool) -> usize {
    let mig_part = MAX_PROCS * BINDING_SIZE + gpus * crate::mig::MAX_GI_IDS * DEVICE_SIZE;
    base_len(gpus) + if mig { mig_part } else { 0 }
}

fn has_mig(node: &NodeSpec) -> bool {
    node.gpus.iter().any(|g| g.mig_model().is_some())
}

// The layout every mapping process agrees on (LAYOUT_VERSION 2).
const _: () = assert!(HEADER_SIZE == 4096);
const _: () = assert!(std::mem::size_of::<XidSlot>() == 32);
const _: () = assert!(std::mem::offset_of!(Header, xid_head) == 24);
const _: () = assert!(std::mem::offset_of!(Header, xids) == 4096 - XID_RING * 32);
const _: () = assert!(std::mem::size_of::<Interval>() == 32);
const _: () = assert!(std::mem::offset_of!(DeviceBlock, ring) == 64);
const _: () = assert!(std::mem::size_of::<Shift>() == 64);
const _: () = assert!(std::mem::offset_of!(SliceBlock, shifts) == 64);
const _: () = assert!(DEVICE_SIZE == 64 + RING * 32 + 64 + SHIFTS * 64);
const _: () = assert!(std::mem::offset_of!(ProcSlot, comm) == 32);
const _: () = assert!(std::mem::offset_of!(ProcSlot, used) == 64);
const _: () = assert!(SLOT_SIZE == 64 + MAX_GPUS * 8);
const _: () = assert!(std::mem::offset_of!(MigBlock, gis) == 8);
const _: () = assert!(MIG_SIZE == 8 + 15 * 8);
const _: () = assert!(BINDING_SIZE == MAX_GPUS * 4);
// Seven compute instances (bytes 1..=7) fill a GI word.
const _: () = assert!(crate::mig::MAX_CIS == 7);

/// What `install` did with the state file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstallOutcome {
    Created,
    /// Same node description: the live state (allocations, timeline) was kept.
    Kept,
    /// The node description changed: a fresh state file replaced the old one.
    Replaced,
}

impl SharedState {
    /// Writes the node description and a state file for it under `root`.
    /// Keeps an existing state made for the same description, so installing
    /// twice does not disturb running processes.
    pub fn install(root: &SimRoot, node: &NodeSpec) -> Result<InstallOutcome, StateError> {
        let dir = root.state_dir();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let hash = crate::fnv1a(node.source.as_bytes());
        let state_path = root.state_file();
        let outcome = match Self::read_header(&state_path) {
            Ok(Some((h, count))) if h == hash && count == node.gpus.len() => InstallOutcome::Kept,
            Ok(Some(_)) | Err(_) => InstallOutcome::Replaced,
            Ok(None) => InstallOutcome::Created,
        };
        if outcome != InstallOutcome::Kept {
            // New inode: processes still mapping the old state are unaffected.
            let tmp = dir.join(".state.tmp");
            let f = File::create(&tmp).map_err(io_err(&tmp))?;
            f.set_len(layout_len(node.gpus.len(), has_mig(node)) as u64)
                .map_err(io_err(&tmp))?;
            let mut header = vec![0u8; 24];
            header[..8].copy_from_slice(&MAGIC);
            header[8..12].copy_from_slice(&LAYOUT_VERSION.to_ne_bytes());
            header[12..16].copy_from_slice(&(node.gpus.len() as u32).to_ne_bytes());
            header[16..24].copy_from_slice(&hash.to_ne_bytes());
            (&f).write_all(&header).map_err(io_err(&tmp))?;
            f.sync_all().map_err(io_err(&tmp))?;
            fs::rename(&tmp, &state_path).map_err(io_err(&state_path))?;
        }
        write_atomic(&root.node_file(), node.source.as_bytes())?;
        let lock = root.lock_file();
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&lock)
            .map_err(io_err(&lock))?;
        // Containers run as other users too; the state is a device, not a secret.
        for p in [&dir, &state_path, &root.node_file(), &lock] {
            let mode = if p.is_dir() { 0o777 } else { 0o666 };
            let _ = fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode));
        }
        Ok(outcome)
    }

    fn read_header(path: &Path) -> Result<Option<(u64, usize)>, StateError> {
        // The header alone: a MIG node's file is tens of MiB (sparse).
        let mut bytes = Vec::with_capacity(24);
        let file_len = match File::open(path) {
            Ok(f) => {
                let len = f.metadata().map_err(io_err(path))?.len() as usize;
                std::io::Read::take(f, 24)
                    .read_to_end(&mut bytes)
                    .map_err(io_err(path))?;
                len
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(path)(e)),
        };
        let corrupt = |m: &str| StateError::Corrupt {
            path: path.display().to_string(),
            message: m.to_string(),
        };
        if bytes.len() < 24 || bytes[..8] != MAGIC {
            return Err(corrupt(
                "not a gpu-sim state file (bad magic); re-run gpu-sim install",
            ));
        }
        let version = u32::from_ne_bytes(bytes[8..12].try_into().unwrap());
        if version != LAYOUT_VERSION {
            return Err(corrupt(&format!(
                "layout version {version}, this build reads {LAYOUT_VERSION}; re-run gpu-sim install"
            )));
        }
        let count = u32::from_ne_bytes(bytes[12..16].try_into().unwrap()) as usize;
        if count == 0 || count > MAX_GPUS || file_len < base_len(count) {
            return Err(corrupt("truncated or inconsistent; re-run gpu-sim install"));
        }
        Ok(Some((
            u64::from_ne_bytes(bytes[16..24].try_into().unwrap()),
            count,
        )))
    }

    /// Maps the state of an installed root.
    pub fn open(root: &SimRoot) -> Result<SharedState, StateError> {
        let node = NodeSpec::load(&root.node_file())?;
        let path = root.state_file();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err(&path))?;
        let len = layout_len(node.gpus.len(), has_mig(&node));
        let actual = file.metadata().map_err(io_err(&path))?.len() as usize;
        let corrupt = |message: String| StateError::Corrupt {
            path: path.display().to_string(),
            message,
        };
        if actual < len {
            return Err(corrupt(format!(
                "{actual} bytes, expected {len} for {} GPUs; re-run gpu-sim install",
                node.gpus.len()
            )));
        }
        // SAFETY: mapping a regular file we opened read-write.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io_err(&path)(std::io::Error::last_os_error()));
        }
        let lock_path = root.lock_file();
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        let state = SharedState {
            root: root.clone(),
            node,
            base: base.cast(),
            len,
            lock: OwnedFd::from(lock),
            own_slot: AtomicI64::new(-1),
            stamps: super::slice::Stamps::new(),
        };
        let h = state.header();
        if h.magic != MAGIC || h.layout_version != LAYOUT_VERSION {
            return Err(corrupt(
                "bad magic or layout version; re-run gpu-sim install".into(),
            ));
        }
        if h.gpu_count as usize != state.node.gpus.len()
            || h.node_hash != crate::fnv1a(state.node.source.as_bytes())
        {
            return Err(corrupt(
                "was made for another node description; re-run gpu-sim install".into(),
            ));
        }
        Ok(state)
    }

    pub(super) fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_SIZE long and page aligned.
        unsafe { &*(self.base as *const Header) }
    }
    pub(super) fn device(&self, gpu: usize) -> &DeviceBlock {
        assert!(gpu < self.gpu_count());
        // SAFETY: in bounds by layout_len.
        unsafe { &*(self.base.add(HEADER_SIZE + gpu * DEVICE_SIZE) as *const DeviceBlock) }
    }
    pub(super) fn slot(&self, i: usize) -> &ProcSlot {
        assert!(i < MAX_PROCS);
        let off = HEADER_SIZE + self.gpu_count() * DEVICE_SIZE + i * SLOT_SIZE;
        // SAFETY: in bounds by layout_len.
        unsafe { &*(self.base.add(off) as *const ProcSlot) }
    }
    pub(super) fn mig_block(&self, gpu: usize) -> &MigBlock {
        assert!(gpu < self.gpu_count());
        let off =
            HEADER_SIZE + self.gpu_count() * DEVICE_SIZE + MAX_PROCS * SLOT_SIZE + gpu * MIG_SIZE;
        // SAFETY: in bounds by layout_len; 8-aligned (every block before it is).
        unsafe { &*(self.base.add(off) as *const MigBlock) }
    }
    /// Slot `i`'s MIG bindings; `None` on a node without MIG.
    pub(super) fn mig_binding(&self, i: usize) -> Option<&MigBinding> {
        assert!(i < MAX_PROCS);
        let off = base_len(self.gpu_count()) + i * BINDING_SIZE;
        // SAFETY: in bounds by layout_len when the node has MIG (checked by
        // the length); 4-aligned after 8-aligned blocks.
        (self.len >= layout_len(self.gpu_count(), true))
            .then(|| unsafe { &*(self.base.add(off) as *const MigBinding) })
    }
    /// The memory and timeline of GPU instance `gi` of `gpu` (MIG nodes).
    pub(super) fn gi_block(&self, gpu: usize, gi: u32) -> Option<&DeviceBlock> {
        assert!(gpu < self.gpu_count() && (gi as usize) < crate::mig::MAX_GI_IDS);
        let n = self.gpu_count();
        let off = base_len(n)
            + MAX_PROCS * BINDING_SIZE
            + (gpu * crate::mig::MAX_GI_IDS + gi as usize) * DEVICE_SIZE;
        // SAFETY: in bounds by layout_len on a MIG node (checked by the
        // length); 8-aligned (the bindings part is a multiple of 8).
        (self.len >= layout_len(n, true))
            .then(|| unsafe { &*(self.base.add(off) as *const DeviceBlock) })
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::{NODE, installed};

    #[test]
    fn install_is_idempotent_and_replaces_on_change() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let me = s.attach().unwrap();
        s.try_alloc(me, 0, 4096).unwrap();
        let node = NodeSpec::parse(NODE, "t").unwrap();
        assert_eq!(
            SharedState::install(&root, &node).unwrap(),
            InstallOutcome::Kept
        );
        assert_eq!(
            SharedState::open(&root).unwrap().memory_used(0),
            4096,
            "kept live state"
        );
        let changed =
            NodeSpec::parse(&NODE.replace("memory_mib = 1", "memory_mib = 2"), "t").unwrap();
        assert_eq!(
            SharedState::install(&root, &changed).unwrap(),
            InstallOutcome::Replaced
        );
        assert_eq!(SharedState::open(&root).unwrap().memory_used(0), 0);
    }

    #[test]
    fn corrupt_state_is_reported() {
        let (_d, root) = installed();
        fs::write(root.state_file(), b"garbage").unwrap();
        let err = SharedState::open(&root).err().unwrap().to_string();
        assert!(err.contains("re-run gpu-sim install"), "{err}");
    }
}
