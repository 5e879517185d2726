//! The manager's own record of its allocations: the one durable record,
//! written before an Allocate answers and read at start. Everything else
//! the manager writes (vm directories) can be rebuilt from it and from the
//! node.
//!
//! Format: two slot files, `gpu-manager.json.a` and `gpu-manager.json.b`.
//! Each holds a fixed-size text header (generation, payload length, CRC-32C
//! of both and the payload), the JSON payload, and space padding to the
//! file's size. A write goes to the slot that does not hold the newest good
//! generation, in place: one `pwrite` and one `fdatasync`, no rename and no
//! directory fsync (except when a slot file is first created). Load takes
//! the newest slot whose checksum verifies, so a torn or failed write only
//! ever damages the older slot and the previous record stays intact. A slot
//! that does not verify is ignored with a warning; when no slot verifies the
//! files are set aside and the allocations are rebuilt from the node. The
//! single-file format of earlier versions (`gpu-manager.json`) is read when
//! no slot file exists and removed after the first slot write (migration).

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::allocation::Allocation;
use crate::world::CheckpointStore;

/// The single-file checkpoint of earlier versions (read once, migrated).
pub const CHECKPOINT_FILE: &str = "gpu-manager.json";
/// The two slot files.
pub const SLOT_FILES: [&str; 2] = ["gpu-manager.json.a", "gpu-manager.json.b"];
/// Version of the JSON payload (unchanged by the slot format).
const VERSION: u32 = 1;
/// `vcuda-checkpoint v2 gen=<20 digits> len=<10 digits> crc32c=<8 hex>\n`
const MAGIC: &str = "vcuda-checkpoint v2";
const HEADER_LEN: usize = MAGIC.len() + 5 + 20 + 5 + 10 + 8 + 8 + 1;
/// The part of the header the checksum covers (everything before ` crc32c=`).
const SUMMED_LEN: usize = MAGIC.len() + 5 + 20 + 5 + 10;
/// Smallest slot file; slots grow in powers of two.
const MIN_SLOT: usize = 4096;

#[derive(Debug, Serialize, Deserialize)]
struct File {
    version: u32,
    /// GPU UUIDs by index when written: a checkpoint from another set of
    /// GPUs is not applied blindly.
    gpus: Vec<String>,
    allocations: Vec<Allocation>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path} is not valid: {problem}; move it away to start without it")]
    Invalid { path: String, problem: String },
    #[error(
        "checkpoint {path} was written by a gpu-manager of another format ({found}); this one \
         reads slot layout \"{MAGIC}\" with payload version {VERSION}"
    )]
    Version { path: String, found: String },
}

/// GPU UUIDs by index and the allocations, as saved.
pub type Saved = (Vec<String>, Vec<Allocation>);

/// Where the next write goes.
#[derive(Debug, Default)]
struct Cursor {
    /// The slot files were looked at (by `load` or the first `store`).
    scanned: bool,
    /// Slot the next write overwrites: never the one with the newest good
    /// generation. Stays the same after a failed write.
    target: usize,
    /// Generation of the next write.
    next_gen: u64,
    /// Which slot files exist (a missing one is created, then the
    /// directory is synced once).
    exists: [bool; 2],
    /// The old single file is still there: removed after the first good
    /// slot write.
    legacy: bool,
}

#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    cursor: Arc<Mutex<Cursor>>,
}

/// What one slot file holds.
#[derive(Debug)]
enum Slot {
    Missing,
    Bad(String),
    /// Written by a gpu-manager of another format (an upgrade rolled
    /// back): what it says it is.
    OtherVersion(String),
    Good {
        generation: u64,
        payload: Vec<u8>,
    },
}

/// Whether generation `a` is newer than `b`, with wrap-around (serial
/// number arithmetic: the two slots are always one write apart).
fn newer(a: u64, b: u64) -> bool {
    (a.wrapping_sub(b) as i64) > 0
}

impl Checkpoint {
    pub fn new(dir: &Path) -> Checkpoint {
        Checkpoint {
            dir: dir.to_path_buf(),
            cursor: Arc::new(Mutex::new(Cursor::default())),
        }
    }

    /// Where the next write goes. A panic during a write may have left it
    /// wrong: then the slots are scanned again before the next write.
    fn cursor(&self) -> std::sync::MutexGuard<'_, Cursor> {
        self.cursor.lock().unwrap_or_else(|p| {
            self.cursor.clear_poison();
            let mut c = p.into_inner();
            c.scanned = false;
            c
        })
    }

    /// The checkpoint directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn slot_path(&self, i: usize) -> PathBuf {
        self.dir.join(SLOT_FILES[i])
    }

    fn legacy_path(&self) -> PathBuf {
        self.dir.join(CHECKPOINT_FILE)
    }

    fn read_slot(&self, i: usize) -> Result<Slot, CheckpointError> {
        let path = self.slot_path(i);
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Slot::Missing),
            Err(source) => {
                return Err(CheckpointError::Io {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        let mut bytes = Vec::new();
        if let Err(e) = f.read_to_end(&mut bytes) {
            // Unreadable like a damaged slot: the other one may do.
            return Ok(Slot::Bad(format!("unreadable: {e}")));
        }
        if let Some(other) = other_slot_layout(&bytes) {
            return Ok(Slot::OtherVersion(other));
        }
        Ok(match decode_slot(&bytes) {
            Ok((generation, payload)) => match payload_version(payload) {
                Some(v) if v != VERSION => Slot::OtherVersion(format!("payload version {v}")),
                _ => Slot::Good {
                    generation,
                    payload: payload.to_vec(),
                },
            },
            Err(problem) => Slot::Bad(problem.to_string()),
        })
    }

    /// The saved allocations and the GPU UUIDs they were made on; none when
    /// there is no checkpoint. The newest slot that verifies wins; a slot
    /// that does not is ignored with a warning; none verifying is
    /// [`CheckpointError::Invalid`] (see [`Checkpoint::set_aside`]).
    pub fn load(&self) -> Result<Option<Saved>, CheckpointError> {
        let slots = [self.read_slot(0)?, self.read_slot(1)?];
        let legacy = self.legacy_path();
        let legacy_exists = legacy.exists();
        let mut cur = self.cursor();
        *cur = Cursor {
            scanned: true,
            target: 0,
            next_gen: 1,
            exists: [
                !matches!(slots[0], Slot::Missing),
                !matches!(slots[1], Slot::Missing),
            ],
            legacy: legacy_exists,
        };
        // Candidates, newest first; a payload that does not parse makes its
        // slot bad too.
        let mut good: Vec<(usize, u64, &[u8])> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Good {
                    generation,
                    payload,
                } => Some((i, *generation, payload.as_slice())),
                _ => None,
            })
            .collect();
        if good.len() == 2 && newer(good[1].1, good[0].1) {
            good.swap(0, 1);
        }
        // Another format in either slot: an upgrade was rolled back (or a
        // newer manager ran here). Its data is not this build's to read, and
        // the other slot, older, may be stale: neither is used.
        let other: Vec<String> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::OtherVersion(v) => Some(format!("{}: {v}", SLOT_FILES[i])),
                _ => None,
            })
            .collect();
        if !other.is_empty() {
            return Err(CheckpointError::Version {
                path: self.dir.display().to_string(),
                found: other.join("; "),
            });
        }
        let mut problems = Vec::new();
        for (i, s) in slots.iter().enumerate() {
            if let Slot::Bad(p) = s {
                problems.push(format!("{}: {p}", SLOT_FILES[i]));
            }
        }
        for (i, generation, payload) in good {
            match parse(payload) {
                Ok(saved) => {
                    for p in &problems {
                        tracing::warn!(
                            problem = %p, using = SLOT_FILES[i], generation,
                            "checkpoint slot ignored (torn or failed write?); using the other slot"
                        );
                    }
                    cur.target = 1 - i;
                    cur.next_gen = generation.wrapping_add(1);
                    return Ok(Some(saved));
                }
                Err(p) => problems.push(format!("{}: {p}", SLOT_FILES[i])),
            }
        }
        if !problems.is_empty() {
            return Err(CheckpointError::Invalid {
                path: self.dir.display().to_string(),
                problem: problems.join("; "),
            });
        }
        // No slot file: the single file of earlier versions, if any.
        let text = match std::fs::read(&legacy) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CheckpointError::Io {
                    path: legacy.display().to_string(),
                    source,
                });
            }
        };
        let saved = parse(&text).map_err(|problem| CheckpointError::Invalid {
            path: legacy.display().to_string(),
            problem: problem.to_string(),
        })?;
        tracing::info!(
            path = %legacy.display(),
            "single-file checkpoint of an earlier version read; the next write moves it to slot files"
        );
        Ok(Some(saved))
    }

    /// Records the allocations durably: the older slot is overwritten in
    /// place and synced once. On failure the newest good slot is untouched
    /// and the next store goes to the same slot again.
    pub fn store<'a>(
        &self,
        gpus: &[String],
        allocations: impl IntoIterator<Item = &'a Allocation>,
    ) -> Result<(), CheckpointError> {
        self.write(&encode(gpus, allocations))
    }

    /// [`Checkpoint::store`] of a payload made by [`encode`].
    fn write(&self, payload: &[u8]) -> Result<(), CheckpointError> {
        let mut cur = self.cursor();
        if !cur.scanned {
            drop(cur);
            // Sets the cursor; what it found does not matter here.
            let _ = self.load();
            cur = self.cursor();
            cur.scanned = true;
        }
        let i = cur.target;
        let path = self.slot_path(i);
        let err = |p: &Path| {
            let path = p.display().to_string();
            move |source| CheckpointError::Io { path, source }
        };
        let mut created = false;
        if !cur.exists[i] {
            std::fs::create_dir_all(&self.dir).map_err(err(&self.dir))?;
            created = true;
        }
        write_slot(&path, cur.next_gen, payload, &mut created).map_err(err(&path))?;
        if created {
            // The new name must survive a crash too (once per slot file).
            std::fs::File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(err(&self.dir))?;
        }
        cur.exists[i] = true;
        cur.target = 1 - i;
        cur.next_gen = cur.next_gen.wrapping_add(1);
        if cur.legacy {
            // The slot is durable: the old file is no longer needed (should
            // its removal be lost in a crash, a good slot still wins).
            let legacy = self.legacy_path();
            match std::fs::remove_file(&legacy) {
                Ok(()) => {
                    tracing::info!(path = %legacy.display(), "checkpoint migrated to slot files; old file removed")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %legacy.display(), error = %e, "removing the old checkpoint file")
                }
            }
            cur.legacy = false;
        }
        Ok(())
    }

    /// Moves unreadable checkpoint files (both slots, the old single file)
    /// out of the way, kept for inspection, and returns where they went.
    pub fn set_aside(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut moved = Vec::new();
        for from in [self.slot_path(0), self.slot_path(1), self.legacy_path()] {
            let name = from.file_name().unwrap_or_default().to_string_lossy();
            let to = from.with_file_name(format!("{name}.corrupt-{ts}"));
            match std::fs::rename(&from, &to) {
                Ok(()) => moved.push(to),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(CheckpointError::Io {
                        path: from.display().to_string(),
                        source,
                    });
                }
            }
        }
        *self.cursor() = Cursor {
            scanned: true,
            target: 0,
            next_gen: 1,
            exists: [false, false],
            legacy: false,
        };
        Ok(moved)
    }
}

impl CheckpointStore for Checkpoint {
    fn location(&self) -> String {
        self.dir.display().to_string()
    }

    fn load(&self) -> Result<Option<Saved>, CheckpointError> {
        Checkpoint::load(self)
    }

    fn store(&self, gpus: &[String], allocations: &[Allocation]) -> Result<(), CheckpointError> {
        Checkpoint::store(self, gpus, allocations)
    }

    fn set_aside(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        Checkpoint::set_aside(self)
    }
}

/// The JSON payload of a checkpoint: with [`parse`], the one place the
/// record's format is known (every [`CheckpointStore`] goes through both).
pub fn encode<'a>(
    gpus: &[String],
    allocations: impl IntoIterator<Item = &'a Allocation>,
) -> Vec<u8> {
    let f = File {
        version: VERSION,
        gpus: gpus.to_vec(),
        allocations: allocations.into_iter().cloned().collect(),
    };
    // Compact JSON: the record is rewritten on every allocation.
    serde_json::to_vec(&f).expect("serialisable")
}

/// The version a payload says it has, read before anything else of it (a
/// later format may change every other field).
fn payload_version(payload: &[u8]) -> Option<u32> {
    #[derive(Deserialize)]
    struct Head {
        version: u32,
    }
    serde_json::from_slice::<Head>(payload)
        .ok()
        .map(|h| h.version)
}

/// `Some(what it says)` for a slot of another layout: the header's magic
/// with another version ("vcuda-checkpoint v3 ...").
fn other_slot_layout(bytes: &[u8]) -> Option<String> {
    const STEM: &[u8] = b"vcuda-checkpoint v";
    let rest = bytes.strip_prefix(STEM)?;
    let v: String = rest
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .map(|&b| b as char)
        .collect();
    (!v.is_empty() && format!("vcuda-checkpoint v{v}") != MAGIC)
        .then(|| format!("slot layout \"vcuda-checkpoint v{v}\""))
}

/// Why a payload is not one [`encode`] made.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("version {0} (this build writes {VERSION})")]
    Version(u32),
}

/// A payload made by [`encode`], or why it is not one.
pub fn parse(payload: &[u8]) -> Result<Saved, PayloadError> {
    let f: File = serde_json::from_slice(payload)?;
    if f.version != VERSION {
        return Err(PayloadError::Version(f.version));
    }
    Ok((f.gpus, f.allocations))
}

/// Why a slot's bytes do not verify.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum SlotError {
    #[error("empty")]
    Empty,
    #[error("{0} bytes, shorter than the header")]
    Short(usize),
    #[error("header is not text")]
    HeaderNotText,
    #[error("not a vcuda checkpoint slot (bad header)")]
    BadHeader,
    #[error("header has no {0} field")]
    NoField(&'static str),
    #[error("header field {0} is cut")]
    FieldCut(&'static str),
    #[error("bad {0}")]
    BadField(&'static str),
    #[error("payload of {len} bytes cut short at {have} (torn write?)")]
    Cut { len: usize, have: usize },
    #[error("checksum {sum:08x} does not match {crc:08x} (torn write?)")]
    Checksum { sum: u32, crc: u32 },
}

fn summed_header(generation: u64, len: usize) -> String {
    format!("{MAGIC} gen={generation:020} len={len:010}")
}

/// A slot's bytes: header, payload, a newline, spaces to `size` (at least
/// what the content needs), a final newline.
fn encode_slot(generation: u64, payload: &[u8], size: usize) -> Vec<u8> {
    let head = summed_header(generation, payload.len());
    debug_assert_eq!(head.len(), SUMMED_LEN);
    let mut crc = crc32c(0, head.as_bytes());
    crc = crc32c(crc, payload);
    let mut out = Vec::with_capacity(size.max(HEADER_LEN + payload.len() + 1));
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(format!(" crc32c={crc:08x}\n").as_bytes());
    debug_assert_eq!(out.len(), HEADER_LEN);
    out.extend_from_slice(payload);
    out.push(b'\n');
    if out.len() < size {
        out.resize(size - 1, b' ');
        out.push(b'\n');
    }
    out
}

/// The generation and payload of a slot, or why it does not verify.
fn decode_slot(bytes: &[u8]) -> Result<(u64, &[u8]), SlotError> {
    if bytes.is_empty() {
        return Err(SlotError::Empty);
    }
    if bytes.len() < HEADER_LEN {
        return Err(SlotError::Short(bytes.len()));
    }
    let head = std::str::from_utf8(&bytes[..HEADER_LEN]).map_err(|_| SlotError::HeaderNotText)?;
    let field = |name: &'static str, at: usize, width: usize| -> Result<&str, SlotError> {
        let key = format!(" {name}=");
        if head.get(at..at + key.len()) != Some(key.as_str()) {
            return Err(SlotError::NoField(name));
        }
        head.get(at + key.len()..at + key.len() + width)
            .ok_or(SlotError::FieldCut(name))
    };
    if !head.starts_with(MAGIC) || !head.ends_with('\n') {
        return Err(SlotError::BadHeader);
    }
    let mut at = MAGIC.len();
    let generation: u64 = field("gen", at, 20)?
        .parse()
        .map_err(|_| SlotError::BadField("generation"))?;
    at += 5 + 20;
    let len: usize = field("len", at, 10)?
        .parse()
        .map_err(|_| SlotError::BadField("length"))?;
    at += 5 + 10;
    let crc = u32::from_str_radix(field("crc32c", at, 8)?, 16)
        .map_err(|_| SlotError::BadField("checksum field"))?;
    let Some(payload) = bytes.get(HEADER_LEN..HEADER_LEN + len) else {
        return Err(SlotError::Cut {
            len,
            have: bytes.len() - HEADER_LEN,
        });
    };
    let sum = crc32c(crc32c(0, &bytes[..SUMMED_LEN]), payload);
    if sum != crc {
        return Err(SlotError::Checksum { sum, crc });
    }
    Ok((generation, payload))
}

/// Overwrites the slot file at `path` in place and syncs its data once.
/// `created` says the file may not exist yet (it is created) and comes back
/// true when it was.
fn write_slot(
    path: &Path,
    generation: u64,
    payload: &[u8],
    created: &mut bool,
) -> std::io::Result<()> {
    let open = |create: bool| {
        OpenOptions::new()
            .write(true)
            .create(create)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
    };
    // Opened for every write (not kept): a directory made read-only since
    // is noticed, and no descriptor outlives the manager's use of it.
    let mut f = match open(*created) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !*created => {
            *created = true;
            open(true)?
        }
        r => r?,
    };
    let size = f.seek(SeekFrom::End(0))? as usize;
    let need = HEADER_LEN + payload.len() + 1;
    let fit = need.next_power_of_two().max(MIN_SLOT);
    // The file keeps its size (an overwrite needs no metadata change, so
    // fdatasync writes only data) unless it is too small or far too big.
    let target = if size >= need && size <= 4 * fit {
        size
    } else {
        fit
    };
    if target < size {
        f.set_len(target as u64)?;
    }
    f.write_all_at(&encode_slot(generation, payload, target), 0)?;
    f.sync_data()
}

/// CRC-32C (Castagnoli), continuing from `crc` (0 to start).
pub fn crc32c(crc: u32, bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !crc;
    for &b in bytes {
        c = TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// A 30-core, 4-unit share on `gpu`, unverified: the allocation the unit
/// tests of this crate start from.
#[cfg(test)]
pub(crate) fn sample_share(uid: &str, gpu: usize) -> Allocation {
    Allocation {
        pod_uid: uid.into(),
        namespace: "ns".into(),
        pod_name: "p".into(),
        container: "c".into(),
        container_index: 0,
        cores: 30,
        memory_units: 4,
        memory_limit: 4,
        placement: crate::allocation::PlacementRecord::Share {
            gpu,
            cores: 30,
            memory_units: 4,
        },
        soft_limit: None,
        tier: Default::default(),
        memory_ceiling: None,
        vcore_ids: vec!["vcore-0-00".into()],
        vmemory_ids: vec![],
        verified: false,
        created: 1,
    }
}

#[cfg(test)]
mod tests;
