//! Shareable VMM handles and access to them: `cuMemExportToShareableHandle`
//! / `cuMemImportFromShareableHandle` for the two kinds Linux programs use,
//! `cuMemRetainAllocationHandle`, `cuMemGetAllocationPropertiesFromHandle`,
//! and `cuMemSetAccess` as the node's topology allows.
//!
//! - `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: the handle's memory is a
//!   memfd named `gpu-sim-vmm:<GPU index | h>`; the export is a new fd of
//!   it, which programs pass over a unix socket (SCM_RIGHTS, as NCCL and
//!   PyTorch do); the importer reads where it lives from the fd's name.
//! - `CU_MEM_HANDLE_TYPE_FABRIC`: the memory is a file in the node's
//!   `run/gpu-sim/ipc/` (`ipc.rs`) that the 64-byte handle names; offered
//!   where NVLink joins the GPU to another, as fabric handles need.
//!
//! Imported memory is counted once, for the process that created it (what
//! the driver attributes to each process), never for the importer.

use crate::ipc::{self, FABRIC};
use crate::vmm::{AllocProp, LOCATION_DEVICE, LOCATION_HOST, Phys, phys};
use crate::{Driver, R, drv, lock, put};
use cuda_abi::*;
use std::ffi::c_void;
use std::os::fd::IntoRawFd;

/// `CUmemAllocationHandleType`.
const POSIX_FD: u32 = 1;
const FABRIC_HANDLE: u32 = 8;
const FABRIC_MAGIC: &[u8; 8] = b"SIMFAB01";
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`.
pub(crate) const ATTR_FABRIC_SUPPORTED: i32 = 128;

/// Whether `gpu` offers fabric handles: NVLink joins it to another GPU.
pub(crate) fn fabric_supported(d: &Driver, gpu: usize) -> bool {
    (0..d.node().gpus.len()).any(|o| o != gpu && d.node().nvlink_count(gpu, o) > 0)
}

/// The handle types `cuMemCreate` may be asked for here.
pub(crate) fn check_types(d: &Driver, gpu: Option<usize>, types: u32) -> R {
    if types & !(POSIX_FD | FABRIC_HANDLE) != 0 {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    if types & FABRIC_HANDLE != 0 && !gpu.is_some_and(|g| fabric_supported(d, g)) {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    Ok(())
}

fn loc_name(loc: Option<usize>) -> String {
    loc.map_or("h".into(), |g| g.to_string())
}

/// The memory of a new handle: a memfd, or the fabric file (and its name)
/// when a fabric handle may be exported.
pub(crate) fn backing(
    d: &Driver,
    loc: Option<usize>,
    size: usize,
    types: u32,
) -> R<(i32, Option<String>)> {
    if types & FABRIC_HANDLE != 0 {
        let name = ipc::name(FABRIC, ipc::new_id(d), &format!(".{}", loc_name(loc)));
        let f = ipc::create(d, &name, size)?;
        return Ok((f.into_raw_fd(), Some(name)));
    }
    let label = std::ffi::CString::new(format!("gpu-sim-vmm:{}", loc_name(loc))).unwrap();
    // SAFETY: a NUL-terminated name; plain syscall, no memory handed over.
    let fd = unsafe { libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC) };
    // SAFETY: `fd` is the memfd just created (checked >= 0 first).
    if fd < 0 || unsafe { libc::ftruncate(fd, size as i64) } != 0 {
        if fd >= 0 {
            // SAFETY: our own memfd, closed once, on this failure path only.
            unsafe { libc::close(fd) };
        }
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok((fd, None))
}

/// Where the memory behind an imported fd lives, from the fd's name: a
/// memfd `gpu-sim-vmm:<loc>` or a fabric file `f-<id>.<loc>`; INVALID_VALUE
/// for an fd that is neither.
fn fd_location(fd: i32) -> R<Option<usize>> {
    let link =
        std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let link = link.to_string_lossy();
    let file = link
        .trim_end_matches(" (deleted)")
        .rsplit('/')
        .next()
        .unwrap_or("");
    let loc = if let Some(l) = file.strip_prefix("memfd:gpu-sim-vmm:") {
        l
    } else if file.starts_with("f-") {
        file.rsplit('.').next().unwrap_or("")
    } else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    match loc {
        "h" => Ok(None),
        n => n.parse().map(Some).map_err(|_| CUDA_ERROR_INVALID_VALUE),
    }
}

/// A handle for memory another process (or this one) exported.
fn import_fd(fd: i32, loc: Option<usize>, types: u32) -> R<u64> {
    // SAFETY: fstat of an fd of this process into our own local.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_size <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: duplicating an fd the caller lends us; the copy is the handle's own.
    let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if own < 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(Phys::leak(None, loc, st.st_size as usize, own, types))
}

fn export(out: *mut c_void, h: u64, kind: u32, flags: u64) -> R {
    // SAFETY: `h` is our caller's handle; `phys` checks its magic.
    let p = unsafe { phys(h) }?;
    if out.is_null() || flags != 0 || p.types & kind == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match kind {
        POSIX_FD => {
            // SAFETY: a new fd of the handle's memory, handed to the caller to own.
            let fd = unsafe { libc::dup(p.fd) };
            if fd < 0 {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
            put(out as *mut i32, fd)
        }
        FABRIC_HANDLE => {
            let name = p.fabric.as_deref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let mut b = [0u8; 64];
            b[..8].copy_from_slice(FABRIC_MAGIC);
            b[8..8 + name.len().min(48)].copy_from_slice(&name.as_bytes()[..name.len().min(48)]);
            put(out as *mut [u8; 64], b)
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

fn import(d: &Driver, os: *mut c_void, kind: u32) -> R<u64> {
    match kind {
        POSIX_FD => {
            let fd = os as usize as i32;
            import_fd(fd, fd_location(fd)?, POSIX_FD)
        }
        FABRIC_HANDLE => {
            let b = crate::get(os as *const [u8; 64])?;
            if &b[..8] != FABRIC_MAGIC {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let name = std::str::from_utf8(&b[8..])
                .map_err(|_| CUDA_ERROR_INVALID_VALUE)?
                .trim_end_matches('\0');
            if !name.starts_with("f-") || name.contains('/') {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let f = ipc::open(d, name)?;
            let fd = f.into_raw_fd();
            let r = fd_location(fd).and_then(|loc| import_fd(fd, loc, FABRIC_HANDLE));
            // SAFETY: our own fd from `open`; import_fd kept a copy of it.
            unsafe { libc::close(fd) };
            r
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// The handle mapped at `ptr`, with the start and length of its mapping.
fn mapping_at(d: &Driver, ptr: u64) -> R<(u64, usize, u64)> {
    let m = lock(&d.mem.mapped);
    let (&base, &(len, h)) = m
        .range(..=ptr)
        .next_back()
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if ptr >= base + len as u64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok((base, len, h))
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AccessDesc {
    location_type: u32,
    location_id: i32,
    flags: u32,
}

/// cuMemSetAccess: each device named must be the memory's own or one that
/// may access it as a peer (the node's topology); INVALID_DEVICE otherwise.
/// The range may span several mappings (all of them checked).
fn set_access(d: &Driver, ptr: u64, size: usize, desc: *const AccessDesc, count: usize) -> R {
    if desc.is_null() || count == 0 || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let end = ptr
        .checked_add(size as u64)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let handles = d
        .mem
        .mapped_cover(ptr, end)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // SAFETY: the caller's array of `count` descriptors (CUDA ABI), non-NULL (checked above).
    let descs = unsafe { std::slice::from_raw_parts(desc, count) };
    for h in handles {
        // SAFETY: a handle recorded in `mapped` is live while mapped.
        let home = unsafe { phys(h) }?.loc;
        for a in descs {
            if a.flags > 3 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            if a.location_type == LOCATION_DEVICE {
                let g = d.device(a.location_id)?.gpu;
                if home.is_some_and(|home| home != g && !d.node().peer_capable(home, g)) {
                    return Err(CUDA_ERROR_INVALID_DEVICE);
                }
            } else if !LOCATION_HOST.contains(&a.location_type) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
    }
    Ok(())
}

/// The properties a handle was made with (`CUmemAllocationProp`, 32 bytes).
fn properties(d: &Driver, out: *mut AllocProp, h: u64) -> R {
    // SAFETY: `h` is our caller's handle; `phys` checks its magic.
    let p = unsafe { phys(h) }?;
    let (location_type, location_id) = match p.loc {
        Some(g) => {
            let ordinal = d
                .devices
                .iter()
                .find(|x| x.gpu == g)
                .map_or(g as i32, |x| x.ordinal);
            (LOCATION_DEVICE, ordinal)
        }
        None => (2, 0),
    };
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's CUmemAllocationProp (32 bytes), non-NULL; zeroed first so the fields
    // this simulator does not model read as defaults.
    unsafe { std::ptr::write_bytes(out.cast::<u8>(), 0, 32) };
    put(
        out,
        AllocProp {
            kind: 1,
            handle_types: p.types,
            location_type,
            location_id,
        },
    )
}

cuda_fn! {
    fn cuMemExportToShareableHandle(out: *mut c_void, h: u64, kind: u32, flags: u64) {
        drv()?;
        export(out, h, kind, flags)
    }

    fn cuMemImportFromShareableHandle(out: *mut u64, os: *mut c_void, kind: u32) {
        let d = drv()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, import(d, os, kind)?)
    }

    fn cuMemRetainAllocationHandle(out: *mut u64, addr: *mut c_void) {
        let d = drv()?;
        let (_, _, h) = mapping_at(d, addr as u64)?;
        // SAFETY: a handle recorded in `mapped` is live while mapped.
        lock(&unsafe { phys(h) }?.life).1 += 1;
        put(out, h)
    }

    fn cuMemGetAllocationPropertiesFromHandle(out: *mut AllocProp, h: u64) {
        properties(drv()?, out, h)
    }

    fn cuMemSetAccess(ptr: u64, size: usize, desc: *const c_void, count: usize) {
        set_access(drv()?, ptr, size, desc.cast(), count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_names_say_where_the_memory_lives() {
        let make = |label: &std::ffi::CStr| {
            // SAFETY: a NUL-terminated name.
            unsafe { libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC) }
        };
        let (dev, host, other) = (make(c"gpu-sim-vmm:3"), make(c"gpu-sim-vmm:h"), make(c"x"));
        assert_eq!(fd_location(dev), Ok(Some(3)));
        assert_eq!(fd_location(host), Ok(None));
        assert_eq!(fd_location(other), Err(CUDA_ERROR_INVALID_VALUE));
        for fd in [dev, host, other] {
            // SAFETY: the memfds made above.
            unsafe { libc::close(fd) };
        }
    }
}
