//! Virtual memory management: physical handles (memfds), address
//! reservations, and mapping one into the other.

use crate::mem::{map_anon, round_up};
use crate::{Driver, R, arg, drv, lock, put};
use cuda_abi::*;
use std::ffi::c_void;
use std::sync::Mutex;

/// VMM allocation granularity the real driver reports.
const GRANULARITY: usize = 2 << 20;
const PHYS_MAGIC: u64 = 0x5349_4d50_4859_0001;

/// `CUmemLocation` inside CUmemAllocationProp / CUmemPoolProps (offset 8).
#[repr(C)]
pub struct AllocProp {
    pub kind: u32,
    pub handle_types: u32,
    pub location_type: u32,
    pub location_id: i32,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(crate) const LOCATION_DEVICE: u32 = 1;

/// `CU_MEM_LOCATION_TYPE_HOST`, `_HOST_NUMA`, `_HOST_NUMA_CURRENT`.
pub(crate) const LOCATION_HOST: std::ops::RangeInclusive<u32> = 2..=4;

/// The GPU a VMM allocation lives on; `None` for host memory.
fn prop_location(d: &Driver, p: *const AllocProp) -> R<Option<usize>> {
    let pr = arg(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if LOCATION_HOST.contains(&pr.location_type) {
        return Ok(None);
    }
    prop_device(d, p).map(Some)
}

fn prop_device(d: &Driver, p: *const AllocProp) -> R<usize> {
    let p = arg(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if p.location_type != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(d.device(p.location_id)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?
        .gpu)
}

pub(crate) struct Phys {
    magic: u64,
    /// Device it is counted on: its creator's device memory only (host
    /// memory and imported handles are not counted here).
    pub gpu: Option<usize>,
    /// Where it lives: a GPU index, `None` for host memory.
    pub loc: Option<usize>,
    pub size: usize,
    pub fd: i32,
    /// `CUmemAllocationProp.requestedHandleTypes` (those it may export as).
    pub types: u32,
    /// Its fabric file's name (`ipc.rs`) in the process that made it.
    pub fabric: Option<String>,
    /// (live mappings, references: its creation or import and each
    /// retain, less releases): the memory stays until both are zero, as
    /// the driver defers a release until the last unmap.
    pub life: Mutex<(u32, u32)>,
}

impl Phys {
    /// A new handle (one reference) for memory in `fd`.
    pub fn leak(gpu: Option<usize>, loc: Option<usize>, size: usize, fd: i32, types: u32) -> u64 {
        let p = Box::new(Phys {
            magic: PHYS_MAGIC,
            gpu,
            loc,
            size,
            fd,
            types,
            fabric: None,
            life: Mutex::new((0, 1)),
        });
        Box::into_raw(p) as u64
    }
}

/// Frees a handle once it is released and no longer mapped.
unsafe fn phys_settle(d: &Driver, h: u64) {
    let done = {
        // SAFETY: `h` is a VMM handle this driver handed out (the callers looked it up in
        // `mapped` or checked it with `phys`), still alive: only this function frees it.
        let p = unsafe { &*(h as *const Phys) };
        let l = lock(&p.life);
        l.0 == 0 && l.1 == 0
    };
    if done {
        // SAFETY: released and no longer mapped: no one else can reach the Box any more; freed
        // once, here.
        let mut p = unsafe { Box::from_raw(h as *mut Phys) };
        p.magic = 0;
        // SAFETY: the handle's own memfd, closed once, with it.
        unsafe { libc::close(p.fd) };
        if let Some(gpu) = p.gpu {
            d.state.free(d.me, gpu, p.size as u64);
        }
        if let Some(name) = &p.fabric {
            crate::ipc::unlink(d, name);
        }
    }
}

/// A mapping of `h` went away.
unsafe fn phys_unmapped(d: &Driver, h: u64) {
    {
        // SAFETY: as in phys_settle: a live VMM handle of ours, still mapped.
        let p = unsafe { &*(h as *const Phys) };
        let mut l = lock(&p.life);
        l.0 = l.0.saturating_sub(1);
    }
    // SAFETY: `h` is a live VMM handle of ours (see above).
    unsafe { phys_settle(d, h) };
}

pub(crate) unsafe fn phys<'a>(h: u64) -> R<&'a Phys> {
    let p = h as *const Phys;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if p.is_null() || unsafe { (*p).magic } != PHYS_MAGIC {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: checked just above: the live object this driver leaked for the handle; it stays
    // until its destroy call (use after that is the caller's bug, as with the real driver).
    Ok(unsafe { &*p })
}

cuda_fn! {
    fn cuMemGetAllocationGranularity(out: *mut usize, prop: *const AllocProp, _option: u32) {
        let d = drv()?;
        // Host locations too: NCCL sizes its host-located cuMemCreate with it.
        prop_location(d, prop)?;
        put(out, GRANULARITY)
    }

    fn cuMemCreate(out: *mut u64, size: usize, prop: *const AllocProp, flags: u64) {
        let d = drv()?;
        let gpu = prop_location(d, prop)?;
        if out.is_null() || flags != 0 || size == 0 || size & (GRANULARITY - 1) != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let types = arg(prop).ok_or(CUDA_ERROR_INVALID_VALUE)?.handle_types;
        crate::share::check_types(d, gpu, types)?;
        if let Some(gpu) = gpu {
            d.state.try_alloc(d.me, gpu, size as u64).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        }
        let backing = crate::share::backing(d, gpu, size, types);
        let Ok((fd, fabric)) = backing else {
            if let Some(gpu) = gpu {
                d.state.free(d.me, gpu, size as u64);
            }
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        let h = Phys::leak(gpu, gpu, size, fd, types);
        // SAFETY: the handle just made, not yet handed out.
        unsafe { &mut *(h as *mut Phys) }.fabric = fabric;
        put(out, h)?;
        Ok(())
    }

    fn cuMemRelease(h: u64) {
        let d = drv()?;
        // SAFETY: `phys` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let p = unsafe { phys(h) }?;
        {
            let mut l = lock(&p.life);
            if l.1 == 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            l.1 -= 1;
        }
        // Mapped: the memory stays (and counts) until the last unmap.
        // SAFETY: `phys_settle` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { phys_settle(d, h) };
        Ok(())
    }

    fn cuMemAddressReserve(out: *mut u64, size: usize, align: usize, _addr: u64, _flags: u64) {
        let d = drv()?;
        if out.is_null() || size == 0 || size & (GRANULARITY - 1) != 0 || (align != 0 && !align.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let align = align.max(GRANULARITY);
        let raw_len = size + align;
        // SAFETY: `map_anon` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let raw = unsafe { map_anon(raw_len, libc::PROT_NONE) }? as usize;
        let base = round_up(raw, align) as u64;
        lock(&d.mem.reserved).insert(base, (raw, raw_len));
        put(out, base)
    }

    fn cuMemAddressFree(ptr: u64, _size: usize) {
        let d = drv()?;
        let (raw, len) = lock(&d.mem.reserved).remove(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `raw`/`len` is the reservation `cuMemAddressReserve` mapped
        // and recorded; removing the record above makes this its only unmap.
        unsafe { libc::munmap(raw as *mut c_void, len) };
        let mut gone = Vec::new();
        lock(&d.mem.mapped).retain(|&a, &mut (_, h)| {
            let inside = a >= ptr && a < ptr + len as u64;
            if inside {
                gone.push(h);
            }
            !inside
        });
        for h in gone {
            // SAFETY: `phys_unmapped` gets the pointers and handles our caller passed in,
            // which the CUDA ABI makes valid for this call (or NULL, checked there);
            // handles are ones this driver handed out or are rejected by their magic.
            unsafe { phys_unmapped(d, h) };
        }
        Ok(())
    }

    fn cuMemMap(ptr: u64, size: usize, offset: usize, h: u64, flags: u64) {
        let d = drv()?;
        // SAFETY: `phys` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        let p = unsafe { phys(h) }?;
        if lock(&p.life).1 == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if flags != 0 || size == 0 || offset.checked_add(size).is_none_or(|e| e > p.size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        {
            let r = lock(&d.mem.reserved);
            let (&base, &(raw, len)) = r.range(..=ptr).next_back().ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if ptr + size as u64 > raw as u64 + len as u64 || ptr < base {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        // SAFETY: MAP_FIXED only inside a reservation of ours (range checked
        // against `reserved` above), so no other mapping is replaced; `p.fd` is
        // the handle's memfd and `offset + size <= p.size` is checked above.
        let m = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                p.fd,
                offset as i64,
            )
        };
        if m == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        lock(&p.life).0 += 1;
        if let Some((_, old)) = lock(&d.mem.mapped).insert(ptr, (size, h)) {
            // SAFETY: `phys_unmapped` gets the pointers and handles our caller passed in,
            // which the CUDA ABI makes valid for this call (or NULL, checked there);
            // handles are ones this driver handed out or are rejected by their magic.
            unsafe { phys_unmapped(d, old) };
        }
        Ok(())
    }

    fn cuMemUnmap(ptr: u64, size: usize) {
        let d = drv()?;
        let (_, h) = lock(&d.mem.mapped).remove(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `ptr` was mapped by our `cuMemMap` inside a reservation of
        // ours (recorded in `mapped`, removed above); putting PROT_NONE
        // anonymous memory back over it returns it to the reservation.
        unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        // SAFETY: `phys_unmapped` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { phys_unmapped(d, h) };
        Ok(())
    }
}
