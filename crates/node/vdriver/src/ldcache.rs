//! A reader for glibc's `ld.so.cache`, pure (bytes in, entries out).
//!
//! Two layouts exist in the wild:
//! - new: header `glibc-ld.so.cache` `1.1` at offset 0 (glibc >= 2.32 writes only this);
//! - compat: the old `ld.so-1.7.0` table, then the new header at the next 8-byte boundary.
//!
//! In both, string offsets of the new entries are relative to the start of the new header.

/// Where a library belongs in the vdriver tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LibClass {
    /// 32-bit (i386): `lib/`.
    Lib32,
    /// 64-bit: `lib64/`.
    Lib64,
}

impl LibClass {
    pub fn dir(self) -> &'static str {
        match self {
            LibClass::Lib32 => "lib",
            LibClass::Lib64 => "lib64",
        }
    }
}

/// One entry: `key` is the library name (usually its soname), `value` the path ldconfig saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    pub flags: i32,
    pub key: String,
    pub value: String,
    pub hwcap: u64,
}

impl CacheEntry {
    /// The vdriver directory this entry belongs in, or None for an ABI we do not mirror
    /// (non-ELF, libc5, x32, other architectures' 32-bit ABIs).
    pub fn class(&self) -> Option<LibClass> {
        if self.flags & FLAG_TYPE_MASK & FLAG_ELF == 0 {
            return None;
        }
        match self.flags & FLAG_ARCH_MASK {
            FLAG_ARCH_I386 => Some(LibClass::Lib32),
            FLAG_X8664_LIB64 | FLAG_POWERPC_LIB64 | FLAG_AARCH64_LIB64 => Some(LibClass::Lib64),
            _ => None,
        }
    }
}

pub const OLD_MAGIC: &[u8] = b"ld.so-1.7.0\0";
pub const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache";
pub const NEW_VERSION: &[u8] = b"1.1";

pub const FLAG_TYPE_MASK: i32 = 0x00ff;
pub const FLAG_ELF: i32 = 0x0001;
pub const FLAG_ELF_LIBC6: i32 = 0x0003;
pub const FLAG_ARCH_MASK: i32 = 0xff00;
pub const FLAG_ARCH_I386: i32 = 0x0000;
pub const FLAG_X8664_LIB64: i32 = 0x0300;
pub const FLAG_POWERPC_LIB64: i32 = 0x0500;
pub const FLAG_X8664_LIBX32: i32 = 0x0800;
pub const FLAG_AARCH64_LIB64: i32 = 0x0a00;

/// Old header: magic (12) + nlibs (4); old entry: flags, key, value (3 x 4).
const OLD_HEADER_LEN: usize = 16;
const OLD_ENTRY_LEN: usize = 12;
/// New header: magic (17) + version (3) + nlibs + len_strings + flags/padding +
/// extension_offset + unused[3] = 48; new entry: flags, key, value, osversion (4 x 4) + hwcap (8).
const NEW_HEADER_LEN: usize = 48;
const NEW_ENTRY_LEN: usize = 24;
/// `struct cache_file_new` is 8-byte aligned (its entries hold a u64).
const NEW_ALIGN: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("file too short ({0} bytes)")]
    TooShort(usize),
    #[error("unknown magic (neither ld.so-1.7.0 nor glibc-ld.so.cache)")]
    BadMagic,
    #[error(
        "old-format cache without the new format appended (written by glibc < 2.2); not supported"
    )]
    OldOnly,
    #[error("unsupported cache version {0:?}")]
    BadVersion(String),
    #[error("{0} entries do not fit in the file")]
    Truncated(u32),
}

fn u32_at(data: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(data[off..off + 4].try_into().expect("4 bytes"))
}

fn u64_at(data: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(data[off..off + 8].try_into().expect("8 bytes"))
}

/// NUL-terminated string at `off`, or None when out of range / unterminated / not UTF-8.
fn cstr_at(data: &[u8], off: usize) -> Option<&str> {
    let tail = data.get(off..)?;
    let end = tail.iter().position(|&b| b == 0)?;
    std::str::from_utf8(&tail[..end]).ok()
}

/// Parses a whole cache file. Entries whose strings point outside the file are skipped,
/// as glibc itself would never find them.
pub fn parse(data: &[u8]) -> Result<Vec<CacheEntry>, ParseError> {
    let new_start = if data.starts_with(OLD_MAGIC) {
        if data.len() < OLD_HEADER_LEN {
            return Err(ParseError::TooShort(data.len()));
        }
        let nlibs = u32_at(data, OLD_MAGIC.len());
        let end = (nlibs as usize)
            .checked_mul(OLD_ENTRY_LEN)
            .and_then(|n| n.checked_add(OLD_HEADER_LEN))
            .ok_or(ParseError::Truncated(nlibs))?;
        let aligned = end.div_ceil(NEW_ALIGN) * NEW_ALIGN;
        if aligned > data.len() {
            return Err(ParseError::Truncated(nlibs));
        }
        if !data[aligned..].starts_with(NEW_MAGIC) {
            return Err(ParseError::OldOnly);
        }
        aligned
    } else if data.starts_with(NEW_MAGIC) {
        0
    } else if data.len() < NEW_MAGIC.len() {
        return Err(ParseError::TooShort(data.len()));
    } else {
        return Err(ParseError::BadMagic);
    };

    let new = &data[new_start..];
    if new.len() < NEW_HEADER_LEN {
        return Err(ParseError::TooShort(data.len()));
    }
    let version = &new[NEW_MAGIC.len()..NEW_MAGIC.len() + NEW_VERSION.len()];
    if version != NEW_VERSION {
        return Err(ParseError::BadVersion(
            String::from_utf8_lossy(version).into_owned(),
        ));
    }
    let nlibs = u32_at(new, 20);
    let table_end = (nlibs as usize)
        .checked_mul(NEW_ENTRY_LEN)
        .and_then(|n| n.checked_add(NEW_HEADER_LEN))
        .filter(|&end| end <= new.len())
        .ok_or(ParseError::Truncated(nlibs))?;

    let entries = new[NEW_HEADER_LEN..table_end]
        .chunks_exact(NEW_ENTRY_LEN)
        .filter_map(|e| {
            let flags = u32_at(e, 0) as i32;
            let key = cstr_at(new, u32_at(e, 4) as usize)?;
            let value = cstr_at(new, u32_at(e, 8) as usize)?;
            Some(CacheEntry {
                flags,
                key: key.to_owned(),
                value: value.to_owned(),
                hwcap: u64_at(e, 16),
            })
        })
        .collect();
    Ok(entries)
}

/// Entries whose key starts with one of `prefixes`, per class, in cache order (which is
/// ldconfig's preference order), each class's values deduplicated.
pub fn lookup<'a>(
    entries: &'a [CacheEntry],
    prefixes: &[String],
) -> Vec<(LibClass, &'a CacheEntry)> {
    let mut seen = std::collections::HashSet::new();
    entries
        .iter()
        .filter(|e| prefixes.iter().any(|p| e.key.starts_with(p.as_str())))
        .filter_map(|e| e.class().map(|c| (c, e)))
        .filter(|(c, e)| seen.insert((*c, e.value.as_str())))
        .collect()
}

#[cfg(test)]
pub(crate) mod build {
    //! Hand-built caches in both layouts, for tests.
    use super::*;

    /// A new-format cache (string offsets relative to its own start).
    pub fn new_format(entries: &[(i32, &str, &str)]) -> Vec<u8> {
        let strings_at = NEW_HEADER_LEN + entries.len() * NEW_ENTRY_LEN;
        let mut strings = Vec::new();
        let mut table = Vec::new();
        for &(flags, key, value) in entries {
            let k = strings_at + strings.len();
            strings.extend_from_slice(key.as_bytes());
            strings.push(0);
            let v = strings_at + strings.len();
            strings.extend_from_slice(value.as_bytes());
            strings.push(0);
            table.extend_from_slice(&flags.to_le_bytes());
            table.extend_from_slice(&(k as u32).to_le_bytes());
            table.extend_from_slice(&(v as u32).to_le_bytes());
            table.extend_from_slice(&0u32.to_le_bytes()); // osversion
            table.extend_from_slice(&0u64.to_le_bytes()); // hwcap
        }
        let mut out = Vec::new();
        out.extend_from_slice(NEW_MAGIC);
        out.extend_from_slice(NEW_VERSION);
        out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]); // flags + padding
        out.extend_from_slice(&0u32.to_le_bytes()); // extension_offset
        out.extend_from_slice(&[0u8; 12]); // unused
        assert_eq!(out.len(), NEW_HEADER_LEN);
        out.extend_from_slice(&table);
        out.extend_from_slice(&strings);
        out
    }

    /// The compat layout glibc < 2.32 wrote: old table (offsets relative to the end of the
    /// old table plus padding, i.e. the new header), then the new cache.
    pub fn compat_format(entries: &[(i32, &str, &str)]) -> Vec<u8> {
        let new = new_format(entries);
        let old_end = OLD_HEADER_LEN + entries.len() * OLD_ENTRY_LEN;
        let pad = old_end.div_ceil(NEW_ALIGN) * NEW_ALIGN - old_end;
        let mut out = Vec::new();
        out.extend_from_slice(OLD_MAGIC);
        out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        for (i, &(flags, _, _)) in entries.iter().enumerate() {
            // Reuse the new entries' string offsets: they share the string table.
            let e = &new[NEW_HEADER_LEN + i * NEW_ENTRY_LEN..];
            out.extend_from_slice(&flags.to_le_bytes());
            out.extend_from_slice(&e[4..12]);
        }
        out.extend(std::iter::repeat_n(0u8, pad));
        out.extend_from_slice(&new);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::build::*;
    use super::*;

    const X64: i32 = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64;
    const I386: i32 = FLAG_ELF_LIBC6;

    fn sample() -> Vec<(i32, &'static str, &'static str)> {
        vec![
            (
                X64,
                "libcuda.so.1",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            ),
            (I386, "libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1"),
            (X64, "libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
            (
                FLAG_ELF_LIBC6 | FLAG_X8664_LIBX32,
                "libcuda.so.1",
                "/usr/libx32/libcuda.so.1",
            ),
            (
                X64,
                "libnvidia-ml.so.1",
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            ),
        ]
    }

    fn check(entries: &[CacheEntry]) {
        assert_eq!(entries.len(), 5);
        assert_eq!(entries[0].key, "libcuda.so.1");
        assert_eq!(entries[0].value, "/usr/lib/x86_64-linux-gnu/libcuda.so.1");
        assert_eq!(entries[0].class(), Some(LibClass::Lib64));
        assert_eq!(entries[1].class(), Some(LibClass::Lib32));
        assert_eq!(entries[3].class(), None, "x32 is not mirrored");
        let hits = lookup(entries, &["libcuda.so".into(), "libnvidia-ml.so".into()]);
        let got: Vec<_> = hits.iter().map(|(c, e)| (*c, e.value.as_str())).collect();
        assert_eq!(
            got,
            [
                (LibClass::Lib64, "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
                (LibClass::Lib32, "/usr/lib/i386-linux-gnu/libcuda.so.1"),
                (
                    LibClass::Lib64,
                    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
                ),
            ]
        );
    }

    #[test]
    fn parses_new_format() {
        check(&parse(&new_format(&sample())).unwrap());
    }

    #[test]
    fn parses_old_format_with_new_appended() {
        for n in 1..=5 {
            // Different entry counts exercise the padding before the new header.
            let entries = &sample()[..n];
            let data = compat_format(entries);
            assert!(data.starts_with(OLD_MAGIC));
            let parsed = parse(&data).unwrap();
            assert_eq!(parsed.len(), n);
            assert_eq!(parsed[n - 1].key, entries[n - 1].1);
            assert_eq!(parsed[n - 1].value, entries[n - 1].2);
        }
        check(&parse(&compat_format(&sample())).unwrap());
    }

    #[test]
    fn plain_elf_flag_counts_as_a_library() {
        // ldconfig marks libraries without a libc dependency as plain ELF (0x0001).
        let e = CacheEntry {
            flags: FLAG_ELF,
            key: "libx.so".into(),
            value: "/x".into(),
            hwcap: 0,
        };
        assert_eq!(e.class(), Some(LibClass::Lib32));
        let libc5 = CacheEntry { flags: 0x0002, ..e };
        assert_eq!(libc5.class(), None);
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(parse(b"hello"), Err(ParseError::TooShort(5)));
        assert_eq!(parse(&[b'x'; 64]), Err(ParseError::BadMagic));
        let mut only_old = OLD_MAGIC.to_vec();
        only_old.extend_from_slice(&0u32.to_le_bytes());
        only_old.extend_from_slice(&[0u8; 32]);
        assert_eq!(parse(&only_old), Err(ParseError::OldOnly));
        let mut lying = new_format(&sample());
        lying[20..24].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(parse(&lying), Err(ParseError::Truncated(1000)));
        let mut version = new_format(&sample());
        version[17..20].copy_from_slice(b"2.0");
        assert!(matches!(parse(&version), Err(ParseError::BadVersion(_))));
    }

    #[test]
    fn out_of_range_strings_are_skipped() {
        let mut data = new_format(&sample());
        // Point the first entry's value far past the end.
        data[NEW_HEADER_LEN + 8..NEW_HEADER_LEN + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        let parsed = parse(&data).unwrap();
        assert_eq!(parsed.len(), 4);
        assert_eq!(parsed[0].value, "/usr/lib/i386-linux-gnu/libcuda.so.1");
    }

    #[test]
    fn parses_a_cache_written_by_this_machines_ldconfig() {
        // The system cache is whatever glibc wrote; it must parse and contain libc.
        let Ok(data) = std::fs::read("/etc/ld.so.cache") else {
            return;
        };
        let entries = parse(&data).unwrap();
        assert!(entries.iter().any(|e| e.key.starts_with("libc.so")));
    }
}
