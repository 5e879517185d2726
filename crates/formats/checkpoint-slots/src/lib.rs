//! A daemon's durable record in two slot files (the manager's allocations,
//! the DRA driver's prepared claims: docs/contracts.md).
//!
//! Each slot holds a fixed-size text header (generation, payload length,
//! CRC-32C of both and the payload), the JSON payload, and space padding to
//! the file's size. A write goes to the slot that does not hold the newest
//! good generation, in place: one `pwrite` and one `fdatasync`, no rename
//! and no directory fsync (except when a slot file is first created). Load
//! takes the newest slot whose checksum verifies and whose payload parses,
//! so a torn or failed write only ever damages the older slot and the
//! previous record stays intact. A slot that does not verify is ignored
//! with a warning; when none verifies the caller sets the files aside. The
//! single file of earlier versions is read when no slot file exists and
//! removed after the first slot write (migration) — or, for a record whose
//! earlier releases are still to be rolled back to ([`Layout::mirror`]),
//! kept written beside the slots.

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::Deserialize;

/// `vcuda-checkpoint v2 gen=<20 digits> len=<10 digits> crc32c=<8 hex>\n`
pub const MAGIC: &str = "vcuda-checkpoint v2";
/// Length of a slot's header line, newline included.
pub const HEADER_LEN: usize = MAGIC.len() + 5 + 20 + 5 + 10 + 8 + 8 + 1;
/// The part of the header the checksum covers (everything before ` crc32c=`).
const SUMMED_LEN: usize = MAGIC.len() + 5 + 20 + 5 + 10;
/// Smallest slot file; slots grow in powers of two.
pub const MIN_SLOT: usize = 4096;
/// Mode of the single file a [`Layout::mirror`] record keeps (root
/// writes, anyone reads, as before slots).
pub const MIRROR_MODE: u32 = 0o644;

/// Whose record it is: its file names and the payload version it reads.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// The two slot files.
    pub slots: [&'static str; 2],
    /// The single file of earlier versions (read once, migrated).
    pub legacy: &'static str,
    /// The payload's `version` field this build reads and writes; a slot
    /// with another is [`Error::OtherFormat`].
    pub version: u32,
    /// Keep the single file: each write also writes it whole (atomically,
    /// first), with the slot's generation as its `slotGeneration`, so a
    /// release that reads only it, rolled back to, finds the record; it is
    /// never removed. [`Slots::load`] reads it instead of the slots when
    /// it is newer: no `slotGeneration` (a release that writes only it
    /// wrote it since: a rolling update's other instance, a rollback's),
    /// or one past the newest good slot (a crash between the two writes).
    /// Several processes may write in turn (under the caller's lock): the
    /// slots are read again before each write.
    pub mirror: bool,
}

/// The single file's field that names the slot generation written with it
/// ([`Layout::mirror`]).
pub const MIRROR_GENERATION: &str = "slotGeneration";

/// Why the record cannot be read or written. `E`: why the caller's parse
/// refused the single file of earlier versions.
#[derive(Debug, thiserror::Error)]
pub enum Error<E = std::convert::Infallible> {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// No slot verifies and parses: why, slot by slot.
    #[error("{path}: {problem}")]
    Invalid { path: String, problem: String },
    /// A slot of another layout or payload version (an upgrade rolled
    /// back): neither slot is used.
    #[error("{path}: another format ({found})")]
    OtherFormat { path: String, found: String },
    /// The single file of earlier versions, refused by the caller's parse.
    #[error("{path}: {error}")]
    Legacy { path: String, error: E },
}

impl Error {
    /// The same error, for a load whose parse fails with `E`.
    pub fn cast<E>(self) -> Error<E> {
        match self {
            Error::Io { path, source } => Error::Io { path, source },
            Error::Invalid { path, problem } => Error::Invalid { path, problem },
            Error::OtherFormat { path, found } => Error::OtherFormat { path, found },
            Error::Legacy { error, .. } => match error {},
        }
    }
}

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

/// The two slot files of one record, and where the next write goes.
#[derive(Debug, Clone)]
pub struct Slots {
    dir: PathBuf,
    layout: Layout,
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

impl Slots {
    /// The slot files of `layout` in `dir` (nothing is read yet).
    pub fn new(dir: &Path, layout: Layout) -> Slots {
        Slots {
            dir: dir.to_path_buf(),
            layout,
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

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Slot file `i` (0 or 1).
    pub fn slot_path(&self, i: usize) -> PathBuf {
        self.dir.join(self.layout.slots[i])
    }

    /// The single file of earlier versions.
    pub fn legacy_path(&self) -> PathBuf {
        self.dir.join(self.layout.legacy)
    }

    fn read_slot(&self, i: usize) -> Result<Slot, Error> {
        let path = self.slot_path(i);
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Slot::Missing),
            Err(source) => {
                return Err(Error::Io {
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
                Some(v) if v != self.layout.version => {
                    Slot::OtherVersion(format!("payload version {v}"))
                }
                _ => Slot::Good {
                    generation,
                    payload: payload.to_vec(),
                },
            },
            Err(problem) => Slot::Bad(problem.to_string()),
        })
    }

    /// The record: the newest slot that verifies and that `parse` takes;
    /// none when there is no file. A slot that does not is ignored with a
    /// warning; none verifying is [`Error::Invalid`] (see
    /// [`Slots::set_aside`]); either slot of another layout or payload
    /// version, [`Error::OtherFormat`]. With no slot file, the single file
    /// of earlier versions, whose `parse` failure is [`Error::Legacy`].
    pub fn load<T, E: std::fmt::Display>(
        &self,
        parse: impl Fn(&[u8]) -> Result<T, E>,
    ) -> Result<Option<T>, Error<E>> {
        let slots = [
            self.read_slot(0).map_err(Error::cast)?,
            self.read_slot(1).map_err(Error::cast)?,
        ];
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
                Slot::OtherVersion(v) => Some(format!("{}: {v}", self.layout.slots[i])),
                _ => None,
            })
            .collect();
        if !other.is_empty() {
            return Err(Error::OtherFormat {
                path: self.dir.display().to_string(),
                found: other.join("; "),
            });
        }
        let mut problems = Vec::new();
        for (i, s) in slots.iter().enumerate() {
            if let Slot::Bad(p) = s {
                problems.push(format!("{}: {p}", self.layout.slots[i]));
            }
        }
        if self.layout.mirror && legacy_exists {
            if let Some((i, generation, _)) = good.first() {
                // Where the next write goes, whichever record is read.
                cur.target = 1 - i;
                cur.next_gen = generation.wrapping_add(1);
            }
            let newest = good.first().map(|g| g.1);
            if let Some(saved) = self.newer_mirror(newest, &parse)? {
                return Ok(Some(saved));
            }
        }
        for (i, generation, payload) in good {
            match parse(payload) {
                Ok(saved) => {
                    for p in &problems {
                        tracing::warn!(
                            problem = %p, using = self.layout.slots[i], generation,
                            "checkpoint slot ignored (torn or failed write?); using the other slot"
                        );
                    }
                    cur.target = 1 - i;
                    cur.next_gen = generation.wrapping_add(1);
                    return Ok(Some(saved));
                }
                Err(p) => problems.push(format!("{}: {p}", self.layout.slots[i])),
            }
        }
        if !problems.is_empty() {
            return Err(Error::Invalid {
                path: self.dir.display().to_string(),
                problem: problems.join("; "),
            });
        }
        // No slot file: the single file of earlier versions, if any.
        let Some(text) = self.read_legacy()? else {
            return Ok(None);
        };
        let saved = parse(&text).map_err(|error| Error::Legacy {
            path: legacy.display().to_string(),
            error,
        })?;
        tracing::info!(
            path = %legacy.display(),
            "single-file checkpoint of an earlier version read; the next write moves it to slot files"
        );
        Ok(Some(saved))
    }

    /// The single file's bytes; `None` when there is none.
    fn read_legacy<E>(&self) -> Result<Option<Vec<u8>>, Error<E>> {
        let legacy = self.legacy_path();
        match std::fs::read(&legacy) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Error::Io {
                path: legacy.display().to_string(),
                source,
            }),
        }
    }

    /// With [`Layout::mirror`]: the single file, parsed, when it is newer
    /// than the slots' newest good generation `newest`; `None` when the
    /// slots are as new (the same record).
    fn newer_mirror<T, E: std::fmt::Display>(
        &self,
        newest: Option<u64>,
        parse: &impl Fn(&[u8]) -> Result<T, E>,
    ) -> Result<Option<T>, Error<E>> {
        let legacy = self.legacy_path();
        let Some(text) = self.read_legacy()? else {
            return Ok(None);
        };
        let marked = serde_json::from_slice::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get(MIRROR_GENERATION)?.as_u64());
        let newer = match (marked, newest) {
            (_, None) => true,
            (None, Some(_)) => true,
            (Some(m), Some(n)) => newer(m, n),
        };
        if !newer {
            return Ok(None);
        }
        let saved = parse(&text).map_err(|error| Error::Legacy {
            path: legacy.display().to_string(),
            error,
        })?;
        if newest.is_some() {
            tracing::info!(
                path = %legacy.display(),
                generation = ?marked,
                slots = ?newest,
                "the single-file checkpoint is newer than the slot files (written by an earlier release, or the slot write was lost): using it"
            );
        }
        Ok(Some(saved))
    }

    /// With [`Layout::mirror`]: `payload` with the generation `generation`
    /// as its [`MIRROR_GENERATION`], written whole over the single file.
    fn write_mirror(&self, payload: &[u8], generation: u64) -> Result<(), Error> {
        let path = self.legacy_path();
        let io = |source| Error::Io {
            path: path.display().to_string(),
            source,
        };
        let mut v: serde_json::Value =
            serde_json::from_slice(payload).map_err(|e| io(std::io::Error::other(e)))?;
        let obj = v
            .as_object_mut()
            .ok_or_else(|| io(std::io::Error::other("the payload is not a JSON object")))?;
        obj.insert(MIRROR_GENERATION.into(), generation.into());
        let body = serde_json::to_vec_pretty(&v).map_err(|e| io(std::io::Error::other(e)))?;
        std::fs::create_dir_all(&self.dir).map_err(|source| Error::Io {
            path: self.dir.display().to_string(),
            source,
        })?;
        quota_config::write_atomic(&path, &body, MIRROR_MODE, quota_config::Durability::Durable)
            .map_err(|e| io(e.source))
    }

    /// Records `payload` (JSON with the layout's `version`) durably: the
    /// older slot is overwritten in place and synced once. On failure the
    /// newest good slot is untouched and the next write goes to the same
    /// slot again. With [`Layout::mirror`], the single file first.
    pub fn write(&self, payload: &[u8]) -> Result<(), Error> {
        let mut cur = self.cursor();
        if self.layout.mirror {
            // Another process may have written since: where the next
            // write goes is read from the files.
            cur.scanned = false;
        }
        if !cur.scanned {
            drop(cur);
            // Sets the cursor; what it found does not matter here.
            let _ = self.load(|_| Ok::<(), std::convert::Infallible>(()));
            cur = self.cursor();
            cur.scanned = true;
        }
        if self.layout.mirror {
            self.write_mirror(payload, cur.next_gen)?;
        }
        let i = cur.target;
        let path = self.slot_path(i);
        let err = |p: &Path| {
            let path = p.display().to_string();
            move |source| Error::Io { path, source }
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
        if cur.legacy && !self.layout.mirror {
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
    pub fn set_aside(&self) -> Result<Vec<PathBuf>, Error> {
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
                    return Err(Error::Io {
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

/// A slot's bytes (for tests and tools): header, payload, a newline, spaces to `size` (at least
/// what the content needs), a final newline.
pub fn encode_slot(generation: u64, payload: &[u8], size: usize) -> Vec<u8> {
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

#[cfg(test)]
mod tests;
