//! CUDA IPC: memory and event handles another process opens.
//!
//! A handle is 64 bytes the program sends itself (over a socket, a pipe):
//! it names a file in the node's `run/gpu-sim/ipc/` that holds what is
//! shared, so processes in other containers that mount the state open it
//! too. Exporting an allocation moves its bytes into such a file (mapped
//! shared at the same address); the opener maps the file. The memory stays
//! counted once, for the process that allocated it, as NVIDIA's driver
//! attributes it; freeing it removes the file (an opener's mapping stays
//! valid until closed: the driver calls using it after that undefined).
//!
//! As the driver's documentation says: a handle cannot be opened in the
//! process that made it (`CUDA_ERROR_INVALID_CONTEXT`); opening one again
//! in the same process returns the same pointer and counts a reference,
//! which `cuIpcCloseMemHandle` drops; event handles need an event made with
//! `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`.

use crate::ctx::current;
use crate::event::{Event, event};
use crate::mem::{PAGE, round_up};
use crate::{Driver, R, drv, lock, put};
use cuda_abi::*;
use gpu_sim_core::Attached;
use std::ffi::c_void;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

/// `CUipcMemHandle` / `CUipcEventHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcHandle {
    bytes: [u8; 64],
}

/// What a shared file holds, its name's prefix.
pub(crate) const MEM: &str = "m";
pub(crate) const EVENT: &str = "e";
pub(crate) const FABRIC: &str = "f";

const MEM_MAGIC: &[u8; 8] = b"SIMIPCM1";
const EVENT_MAGIC: &[u8; 8] = b"SIMIPCE1";
/// `CU_EVENT_INTERPROCESS`.
pub(crate) const EVENT_INTERPROCESS: u32 = 4;
const EVENT_DISABLE_TIMING: u32 = 2;

/// An allocation of another process mapped here.
pub(crate) struct Opened {
    pub id: u64,
    pub size: usize,
    /// The GPU it lives on (the node's index).
    pub gpu: usize,
    len: usize,
    refs: u32,
}

/// A new handle id: the exporting process's registration (slot and
/// generation) and a counter, so stale files can be told by their owner.
pub(crate) fn new_id(d: &Driver) -> u64 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    u64::from(d.me.slot) << 48
        | u64::from(d.me.generation & 0xffff) << 32
        | u64::from(NEXT.fetch_add(1, Relaxed))
}

/// The process that made handle `id`.
pub(crate) fn owner(id: u64) -> Attached {
    Attached {
        slot: (id >> 48) as u32,
        generation: ((id >> 32) & 0xffff) as u32,
    }
}

/// The shared file of a `kind` handle `id`: `<kind>-<id, 16 hex digits>`,
/// what `sweep` reads the owner from; `suffix` adds what a holder of the
/// file alone must know (a fabric allocation's location).
pub(crate) fn name(kind: &str, id: u64, suffix: &str) -> String {
    format!("{kind}-{id:016x}{suffix}")
}

fn path(d: &Driver, name: &str) -> PathBuf {
    d.state.root().ipc_dir().join(name)
}

/// Creates the shared file `name`, first removing the files of processes
/// that died (the driver frees what a dead process shared).
pub(crate) fn create(d: &Driver, name: &str, len: usize) -> R<File> {
    let dir = d.state.root().ipc_dir();
    if std::fs::create_dir(&dir).is_ok() {
        // Containers run as other users too (as the state file itself).
        let _ =
            std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o1777));
    }
    sweep(d);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o666)
        .custom_flags(libc::O_CLOEXEC)
        .open(path(d, name))
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    // Whatever the umask: an opener may run as another user.
    let _ = f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    f.set_len(len as u64)
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    Ok(f)
}

/// Opens the shared file `name` (INVALID_VALUE when it is gone).
pub(crate) fn open(d: &Driver, name: &str) -> R<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path(d, name))
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

pub(crate) fn unlink(d: &Driver, name: &str) {
    let _ = std::fs::remove_file(path(d, name));
}

/// Removes the shared files of processes no longer alive.
fn sweep(d: &Driver) {
    let Ok(dir) = std::fs::read_dir(d.state.root().ipc_dir()) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let id = name
            .to_str()
            .and_then(|n| n.get(2..18))
            .and_then(|h| u64::from_str_radix(h, 16).ok());
        if let Some(id) = id
            && !d.state.is_live(owner(id))
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Maps `len` bytes of `f` shared, at `at` (MAP_FIXED) or anywhere.
///
/// # Safety
/// `at`, when given, is a mapping of this process's own of at least `len`
/// bytes, which this replaces.
pub(crate) unsafe fn map_shared(f: &File, len: usize, at: Option<u64>) -> R<u64> {
    let (hint, fixed) = match at {
        Some(a) => (a as *mut c_void, libc::MAP_FIXED),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: a shared mapping of our own file; MAP_FIXED only over the caller's own mapping
    // (this function's contract).
    let p = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | fixed,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(p as u64)
}

/// Moves an allocation's bytes into `f` and maps the file in its place:
/// only the pages it touched are copied (the rest read as zeros anyway).
///
/// # Safety
/// `[base, base+len)` is an allocation of ours (`mem.rs`), page aligned.
unsafe fn move_into(f: &File, base: u64, len: usize) -> R {
    let pages = len / PAGE;
    let mut resident = vec![0u8; pages];
    // SAFETY: our own mapping of `len` bytes; `resident` has one byte per page.
    let known = unsafe { libc::mincore(base as *mut c_void, len, resident.as_mut_ptr()) } == 0;
    for (i, r) in resident.iter().enumerate() {
        if known && r & 1 == 0 {
            continue;
        }
        let off = i * PAGE;
        // SAFETY: page `i` of our own mapping, readable; written to the file at the same offset.
        let n = unsafe {
            libc::pwrite(
                f.as_raw_fd(),
                (base as usize + off) as *const c_void,
                PAGE,
                off as i64,
            )
        };
        if n != PAGE as isize {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    // SAFETY: `[base, base+len)` is our own mapping (this function's contract).
    unsafe { map_shared(f, len, Some(base)) }.map(|_| ())
}

/// The handle of the allocation containing `ptr`, its bytes made shared
/// at the first export (the same handle every time after).
fn export_mem(d: &Driver, ptr: u64) -> R<IpcHandle> {
    d.mem.with_alloc(ptr, |base, a| {
        let id = match a.ipc {
            Some(id) => id,
            None => {
                let id = new_id(d);
                let f = create(d, &name(MEM, id, ""), a.len)?;
                // SAFETY: `base`/`a.len` is the allocation's own page-aligned mapping.
                if let Err(e) = unsafe { move_into(&f, base, a.len) } {
                    unlink(d, &name(MEM, id, ""));
                    return Err(e);
                }
                a.ipc = Some(id);
                id
            }
        };
        let mut h = IpcHandle { bytes: [0; 64] };
        h.bytes[..8].copy_from_slice(MEM_MAGIC);
        h.bytes[8..16].copy_from_slice(&id.to_le_bytes());
        h.bytes[16..24].copy_from_slice(&(a.size as u64).to_le_bytes());
        h.bytes[24..28].copy_from_slice(&(a.gpu as u32).to_le_bytes());
        Ok(h)
    })
}

/// The id and size a handle of `magic` carries; INVALID_VALUE for anything
/// else, INVALID_CONTEXT for one this process made (the driver's answer).
fn parse(d: &Driver, h: &IpcHandle, magic: &[u8; 8]) -> R<(u64, usize)> {
    if &h.bytes[..8] != magic {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let id = u64::from_le_bytes(h.bytes[8..16].try_into().unwrap());
    if owner(id) == d.me {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    let size = u64::from_le_bytes(h.bytes[16..24].try_into().unwrap()) as usize;
    Ok((id, size))
}

fn open_mem(d: &Driver, h: &IpcHandle) -> R<u64> {
    current()?;
    let (id, size) = parse(d, h, MEM_MAGIC)?;
    let gpu = u32::from_le_bytes(h.bytes[24..28].try_into().unwrap()) as usize;
    if gpu >= d.node().gpus.len() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut m = lock(&d.mem.opened);
    if let Some((&base, o)) = m.iter_mut().find(|(_, o)| o.id == id) {
        o.refs += 1;
        return Ok(base);
    }
    let f = open(d, &name(MEM, id, ""))?;
    let len = round_up(size, PAGE);
    // SAFETY: a fresh shared mapping of the handle's file (no MAP_FIXED).
    let base = unsafe { map_shared(&f, len, None) }?;
    m.insert(
        base,
        Opened {
            id,
            size,
            gpu,
            len,
            refs: 1,
        },
    );
    Ok(base)
}

fn close_mem(d: &Driver, ptr: u64) -> R {
    let mut m = lock(&d.mem.opened);
    let o = m.get_mut(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    o.refs -= 1;
    if o.refs == 0 {
        let o = m.remove(&ptr).unwrap();
        // SAFETY: the mapping open_mem made for this entry, removed above: its only unmap.
        unsafe { libc::munmap(ptr as *mut c_void, o.len) };
    }
    Ok(())
}

/// The shared cell an interprocess event's time lives in.
fn map_event_cell(f: &File) -> R<*mut AtomicU64> {
    // SAFETY: a fresh shared mapping of the event's file (no MAP_FIXED).
    Ok(unsafe { map_shared(f, PAGE, None) }? as *mut AtomicU64)
}

fn export_event(d: &Driver, e: &Event) -> R<IpcHandle> {
    if e.flags & (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
        != EVENT_INTERPROCESS | EVENT_DISABLE_TIMING
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut id = e.ipc_id.load(Acquire);
    if id == 0 {
        id = new_id(d);
        let f = create(d, &name(EVENT, id, ""), PAGE)?;
        let cell = map_event_cell(&f)?;
        // SAFETY: the fresh mapping of a page: a valid, aligned AtomicU64 at its start.
        unsafe { &*cell }.store(e.own_time.load(Acquire), Release);
        e.shared.store(cell, Release);
        e.ipc_id.store(id, Release);
    }
    let mut h = IpcHandle { bytes: [0; 64] };
    h.bytes[..8].copy_from_slice(EVENT_MAGIC);
    h.bytes[8..16].copy_from_slice(&id.to_le_bytes());
    Ok(h)
}

fn open_event(d: &Driver, h: &IpcHandle) -> R<*mut c_void> {
    current()?;
    let (id, _) = parse(d, h, EVENT_MAGIC)?;
    let cell = map_event_cell(&open(d, &name(EVENT, id, ""))?)?;
    let e = Event::new(EVENT_INTERPROCESS | EVENT_DISABLE_TIMING);
    e.shared.store(cell, Release);
    Ok(Box::into_raw(e).cast())
}

/// An event goes: its shared cell is unmapped, and its file removed when
/// this process made it.
pub(crate) fn drop_event(d: &Driver, e: &Event) {
    let cell = e.shared.swap(std::ptr::null_mut(), AcqRel);
    if !cell.is_null() {
        // SAFETY: the page map_event_cell mapped for this event, taken out above: its only unmap.
        unsafe { libc::munmap(cell.cast(), PAGE) };
    }
    let id = e.ipc_id.swap(0, AcqRel);
    if id != 0 {
        unlink(d, &name(EVENT, id, ""));
    }
}

cuda_fn! {
    fn cuIpcGetMemHandle(out: *mut IpcHandle, ptr: u64) {
        let d = drv()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, export_mem(d, ptr)?)
    }

    fn cuIpcOpenMemHandle(out: *mut u64, handle: IpcHandle, _flags: u32) {
        let d = drv()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, open_mem(d, &handle)?)
    }

    fn cuIpcOpenMemHandle_v2(out: *mut u64, handle: IpcHandle, _flags: u32) {
        let d = drv()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, open_mem(d, &handle)?)
    }

    fn cuIpcCloseMemHandle(ptr: u64) {
        let d = drv()?;
        current()?;
        close_mem(d, ptr)
    }

    fn cuIpcGetEventHandle(out: *mut IpcHandle, ev: *mut c_void) {
        let d = drv()?;
        // SAFETY: `ev` is our caller's event handle; `event` checks its magic.
        let e = unsafe { event(ev) }?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, export_event(d, e)?)
    }

    fn cuIpcOpenEventHandle(out: *mut *mut c_void, handle: IpcHandle) {
        let d = drv()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, open_event(d, &handle)?)
    }
}
