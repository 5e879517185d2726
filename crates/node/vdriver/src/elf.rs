//! What the mirror needs to know about a shared object, read with goblin, and the
//! original's blacklist rules. Pure: bytes in.

use goblin::elf::Elf;
use goblin::elf::header::ET_DYN;
use goblin::elf::note::NT_GNU_ABI_TAG;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfInfo {
    pub is_64: bool,
    /// DT_SONAME, if the object has one.
    pub soname: Option<String>,
    /// DT_NEEDED entries.
    pub needed: Vec<String>,
    /// The GNU ABI tag note: (os, major, minor, patch).
    pub abi_tag: Option<[u32; 4]>,
}

/// Reads an ELF shared object. The error says why it is not one.
pub fn inspect(bytes: &[u8]) -> Result<ElfInfo, String> {
    let elf = Elf::parse(bytes).map_err(|e| e.to_string())?;
    if elf.header.e_type != ET_DYN {
        return Err(format!(
            "ELF type {} is not a shared object",
            elf.header.e_type
        ));
    }
    Ok(ElfInfo {
        is_64: elf.is_64,
        soname: elf.soname.map(str::to_owned),
        needed: elf.libraries.iter().map(|s| (*s).to_owned()).collect(),
        abi_tag: abi_tag(&elf, bytes),
    })
}

fn abi_tag(elf: &Elf, bytes: &[u8]) -> Option<[u32; 4]> {
    // Prefer the PT_NOTE segments (always present in a loadable object); fall back to the
    // section for objects whose program headers lack it.
    let from = |notes: goblin::elf::note::NoteIterator| {
        notes
            .filter_map(Result::ok)
            .find(|n| n.n_type == NT_GNU_ABI_TAG && n.name == "GNU" && n.desc.len() >= 16)
            .map(|n| {
                let w = |i: usize| {
                    let b: [u8; 4] = n.desc[i * 4..i * 4 + 4].try_into().expect("4 bytes");
                    if elf.little_endian {
                        u32::from_le_bytes(b)
                    } else {
                        u32::from_be_bytes(b)
                    }
                };
                [w(0), w(1), w(2), w(3)]
            })
    };
    elf.iter_note_headers(bytes).and_then(from).or_else(|| {
        elf.iter_note_sections(bytes, Some(".note.ABI-tag"))
            .and_then(from)
    })
}

/// The part of `libfoo-bar.so.1.2` between `lib` and `.so`, as the original's rules match it.
fn lib_stem(file_name: &str) -> Option<&str> {
    let rest = file_name.strip_prefix("lib")?;
    let (stem, tail) = rest.split_once(".so")?;
    tail.chars()
        .all(|c| c.is_ascii_digit() || c == '.')
        .then_some(stem)
}

/// The TLS ABI the current `libnvidia-tls` variant is built for (glibc 2.3.99).
const TLS_ABI: [u32; 3] = [2, 3, 99];

/// Why the original would leave this library out, if it would:
/// - `libEGL`/`libGL`/`libGLESv1_CM`/`libGLESv2` from another vendor (Mesa): they link
///   neither NVIDIA's GL core nor GLVND's dispatcher;
/// - a `libnvidia-tls` built for the old TLS ABI (not 2.3.99).
pub fn blacklist_reason(file_name: &str, info: &ElfInfo) -> Option<&'static str> {
    match lib_stem(file_name)? {
        "EGL" | "GL" | "GLESv1_CM" | "GLESv2" => {
            let nvidia_or_glvnd = info.needed.iter().any(|d| {
                d.starts_with("libnvidia-glcore.so")
                    || d.starts_with("libnvidia-eglcore.so")
                    || d.starts_with("libGLdispatch.so")
            });
            (!nvidia_or_glvnd).then_some("a GL library of another vendor")
        }
        "nvidia-tls" => match info.abi_tag {
            Some([_, major, minor, patch]) if [major, minor, patch] != TLS_ABI => {
                Some("the nvidia-tls variant for the old TLS ABI")
            }
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(needed: &[&str], abi: Option<[u32; 4]>) -> ElfInfo {
        ElfInfo {
            is_64: true,
            soname: None,
            needed: needed.iter().map(|s| s.to_string()).collect(),
            abi_tag: abi,
        }
    }

    #[test]
    fn stems() {
        assert_eq!(lib_stem("libGL.so.1.7.0"), Some("GL"));
        assert_eq!(lib_stem("libGLESv2.so"), Some("GLESv2"));
        assert_eq!(lib_stem("libnvidia-tls.so.550.54.15"), Some("nvidia-tls"));
        assert_eq!(lib_stem("libGL.so.1.debug"), None);
        assert_eq!(lib_stem("nvidia-smi"), None);
    }

    #[test]
    fn gl_of_other_vendors_is_blacklisted() {
        let mesa = info(&["libglapi.so.0", "libc.so.6"], None);
        let glvnd = info(&["libGLdispatch.so.0", "libGLX.so.0"], None);
        let legacy = info(&["libnvidia-glcore.so.550.54.15"], None);
        assert!(blacklist_reason("libGL.so.1.2.0", &mesa).is_some());
        assert!(blacklist_reason("libEGL.so.1", &mesa).is_some());
        assert!(blacklist_reason("libGL.so.1.7.0", &glvnd).is_none());
        assert!(blacklist_reason("libGL.so.550.54.15", &legacy).is_none());
        assert!(blacklist_reason("libEGL_nvidia.so.0", &mesa).is_none());
        assert!(blacklist_reason("libcuda.so.550.54.15", &mesa).is_none());
    }

    #[test]
    fn tls_variant() {
        let new = info(&[], Some([0, 2, 3, 99]));
        let old = info(&[], Some([0, 2, 2, 5]));
        assert!(blacklist_reason("libnvidia-tls.so.550.54.15", &new).is_none());
        assert!(blacklist_reason("libnvidia-tls.so.390.1", &old).is_some());
        // No ABI note: nothing says it is the wrong one.
        assert!(blacklist_reason("libnvidia-tls.so.550.54.15", &info(&[], None)).is_none());
    }

    #[test]
    fn reads_the_running_libc() {
        // A real shared object from this machine: has a soname and an ABI tag.
        let Ok(bytes) = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        let i = inspect(&bytes).unwrap();
        assert!(i.is_64);
        assert_eq!(i.soname.as_deref(), Some("libc.so.6"));
        assert!(i.needed.iter().any(|n| n.starts_with("ld-linux")));
        assert_eq!(i.abi_tag.map(|t| t[0]), Some(0), "Linux ABI tag");
    }

    #[test]
    fn rejects_non_elf() {
        assert!(inspect(b"not an elf file at all, sorry").is_err());
    }
}
