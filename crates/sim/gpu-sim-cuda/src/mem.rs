//! Device memory: counted per device per process in the shared state (so
//! every process sees it and the card can run out), and backed by real,
//! lazily committed host memory (mmap MAP_NORESERVE), so device pointers are
//! real addresses and copies really move bytes. This file holds the
//! allocations; copies are in `memcpy.rs`, sets in `memset.rs`, pinned host
//! memory in `host.rs`, arrays in `array.rs`, virtual memory management in
//! `vmm.rs`.

use crate::ctx::{Ctx, current};
use crate::pool::Pool;
use crate::{Driver, R, drv, lock, put, put_opt};
use cuda_abi::*;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

pub(crate) const PAGE: usize = 4096;

pub(crate) struct Alloc {
    pub gpu: usize,
    /// Bytes asked for (and counted).
    pub size: usize,
    /// Bytes mapped (size rounded up to pages).
    pub len: usize,
    /// Context it belongs to (freed with it); address only.
    ctx: usize,
    /// The pool it came from: its bytes go back there, not to the device.
    pool: Option<&'static Pool>,
    /// Id of its CUDA IPC handle once exported (`ipc.rs`): its bytes then
    /// live in a shared file, removed when the allocation is freed.
    pub ipc: Option<u64>,
}

#[derive(Default)]
pub(crate) struct Memory {
    /// Device and managed allocations by base address.
    allocs: Mutex<BTreeMap<u64, Alloc>>,
    /// Pinned host allocations: base -> mapped length.
    pub host: Mutex<BTreeMap<u64, usize>>,
    /// VMM reservations: aligned base -> (raw mapping base, raw length).
    pub reserved: Mutex<BTreeMap<u64, (usize, usize)>>,
    /// VMM mappings: address -> (length, handle mapped there).
    pub mapped: Mutex<BTreeMap<u64, (usize, u64)>>,
    /// Contexts' overhead, heaps and module images.
    pub charges: crate::charge::Charges,
    /// Other processes' allocations opened with cuIpcOpenMemHandle: base ->
    /// the mapping (counted by their creator, not here).
    pub opened: Mutex<BTreeMap<u64, crate::ipc::Opened>>,
}

pub(crate) fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

pub(crate) unsafe fn map_anon(len: usize, prot: i32) -> R<*mut c_void> {
    // SAFETY: a fresh private anonymous mapping (NULL hint, no MAP_FIXED) replaces nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(p)
}

impl Memory {
    /// Allocates `size` bytes on `ctx`'s device.
    pub fn alloc(&self, d: &Driver, ctx: &Ctx, size: usize) -> R<u64> {
        self.alloc_in(d, ctx, size, None)
    }

    /// Allocates `size` bytes on `ctx`'s device, from `pool` when given (the
    /// pool, not the allocation, holds device memory).
    pub fn alloc_in(
        &self,
        d: &Driver,
        ctx: &Ctx,
        size: usize,
        pool: Option<&'static Pool>,
    ) -> R<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match pool {
            Some(p) => p.take(d, size as u64)?,
            None => d
                .state
                .try_alloc(d.me, ctx.gpu, size as u64)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?,
        }
        let len = round_up(size, PAGE);
        // SAFETY: plain anonymous mapping of `len` bytes; see map_anon.
        let p = match unsafe { map_anon(len, libc::PROT_READ | libc::PROT_WRITE) } {
            Ok(p) => p,
            Err(e) => {
                match pool {
                    Some(p) => p.put_back(d, size as u64),
                    None => d.state.free(d.me, ctx.gpu, size as u64),
                }
                return Err(e);
            }
        };
        let addr = p as u64;
        lock(&self.allocs).insert(
            addr,
            Alloc {
                gpu: ctx.gpu,
                size,
                len,
                ctx: ctx as *const Ctx as usize,
                pool,
                ipc: None,
            },
        );
        Ok(addr)
    }

    pub fn free(&self, d: &Driver, ptr: u64) -> R {
        let a = lock(&self.allocs)
            .remove(&ptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Self::release(d, ptr, a);
        Ok(())
    }

    fn release(d: &Driver, ptr: u64, a: Alloc) {
        if let Some(id) = a.ipc {
            crate::ipc::unlink(d, &crate::ipc::name(crate::ipc::MEM, id, ""));
        }
        // SAFETY: `ptr`/`a.len` is an allocation `alloc_in` mapped; its record was removed from
        // `allocs` by the caller, so this is its only unmap.
        unsafe { libc::munmap(ptr as *mut c_void, a.len) };
        match a.pool {
            Some(p) => p.put_back(d, a.size as u64),
            None => d.state.free(d.me, a.gpu, a.size as u64),
        }
    }

    /// Frees what a destroyed context allocated.
    pub fn free_context(&self, d: &Driver, c: &Ctx) {
        let key = c as *const Ctx as usize;
        let gone: Vec<(u64, Alloc)> = {
            let mut m = lock(&self.allocs);
            let keys: Vec<u64> = m
                .iter()
                .filter(|(_, a)| a.ctx == key)
                .map(|(k, _)| *k)
                .collect();
            keys.into_iter()
                .filter_map(|k| m.remove(&k).map(|a| (k, a)))
                .collect()
        };
        for (p, a) in gone {
            Self::release(d, p, a);
        }
    }

    /// The allocation containing `ptr` (this process's own or one opened
    /// from another's IPC handle): (base, size).
    pub fn containing(&self, ptr: u64) -> Option<(u64, usize)> {
        let own = {
            let m = lock(&self.allocs);
            m.range(..=ptr).next_back().map(|(&base, a)| (base, a.size))
        };
        let opened = {
            let m = lock(&self.opened);
            m.range(..=ptr).next_back().map(|(&base, o)| (base, o.size))
        };
        [own, opened]
            .into_iter()
            .flatten()
            .find(|&(base, size)| ptr < base + size as u64)
    }

    /// The VMM handles mapped back to back over [ptr, end), in order; `None`
    /// when a gap or the reservation's end interrupts them. One range may
    /// span several mappings: PyTorch's expandable segments map a handle per
    /// 20 MiB and set access (and copy) across them at once.
    pub fn mapped_cover(&self, ptr: u64, end: u64) -> Option<Vec<u64>> {
        let m = lock(&self.mapped);
        let (&first, _) = m.range(..=ptr).next_back()?;
        let mut at = first;
        let mut handles = Vec::new();
        for (&base, &(len, h)) in m.range(first..) {
            if base != at {
                return None;
            }
            handles.push(h);
            at = base + len as u64;
            if end <= at {
                return (ptr < at).then_some(handles);
            }
        }
        None
    }

    /// The VMM mapping containing `ptr`: (base, length).
    pub fn mapping(&self, ptr: u64) -> Option<(u64, usize)> {
        let m = lock(&self.mapped);
        let (&base, &(len, _)) = m.range(..=ptr).next_back()?;
        (ptr < base + len as u64).then_some((base, len))
    }

    /// The own allocation containing `ptr`: (base, size, GPU, context
    /// address, from a pool).
    pub(crate) fn own_alloc(&self, ptr: u64) -> Option<(u64, usize, usize, usize, bool)> {
        let m = lock(&self.allocs);
        let (&base, a) = m.range(..=ptr).next_back()?;
        (ptr < base + a.size as u64).then_some((base, a.size, a.gpu, a.ctx, a.pool.is_some()))
    }

    /// Runs `f` on the own, unpooled allocation containing `ptr` (what a
    /// CUDA IPC handle may export): its base and record.
    pub(crate) fn with_alloc<T>(&self, ptr: u64, f: impl FnOnce(u64, &mut Alloc) -> R<T>) -> R<T> {
        let mut m = lock(&self.allocs);
        let (&base, a) = m
            .range_mut(..=ptr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if ptr >= base + a.size as u64 || a.pool.is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        f(base, a)
    }

    /// Checks that [ptr, ptr+n) is device memory of this process.
    pub fn check(&self, ptr: u64, n: usize) -> R {
        if ptr == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let end = ptr.checked_add(n as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((base, size)) = self.containing(ptr)
            && end <= base + size as u64
        {
            return Ok(());
        }
        if self.mapped_cover(ptr, end).is_some() {
            return Ok(());
        }
        if crate::globals::contains(ptr, end) {
            return Ok(());
        }
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

pub(crate) fn ctx_and_driver() -> R<(&'static Driver, &'static Ctx)> {
    Ok((drv()?, current()?))
}

cuda_fn! {
    fn cuMemAlloc_v2(out: *mut u64, size: usize) {
        let (d, c) = ctx_and_driver()?;
        crate::capture_mode::unsafe_call()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, d.mem.alloc(d, c, size)?)
    }

    fn cuMemAllocManaged(out: *mut u64, size: usize, flags: u32) {
        let (d, c) = ctx_and_driver()?;
        crate::capture_mode::unsafe_call()?;
        if out.is_null() || !matches!(flags, 1 | 2) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, d.mem.alloc(d, c, size)?)
    }

    fn cuMemAllocPitch_v2(out: *mut u64, pitch: *mut usize, width: usize, height: usize, elem: u32) {
        let (d, c) = ctx_and_driver()?;
        crate::capture_mode::unsafe_call()?;
        if out.is_null() || pitch.is_null() || !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = round_up(width, 512);
        let ptr = d.mem.alloc(d, c, p * height)?;
        put(pitch, p)?;
        put(out, ptr)
    }

    fn cuMemFree_v2(ptr: u64) {
        let d = drv()?;
        crate::capture_mode::unsafe_call()?;
        // free(NULL) semantics, as NVIDIA's driver: runtimes pass
        // cudaFree(0) (the context-creating idiom, cublasCreate's) through.
        if ptr == 0 {
            return Ok(());
        }
        d.mem.free(d, ptr)
    }

    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let (d, c) = ctx_and_driver()?;
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // A MIG device's: its GPU instance's memory.
        let (t, used) = d.state.memory_seen(d.me, c.gpu);
        put(total, t as usize)?;
        put(free, t.saturating_sub(used) as usize)?;
        Ok(())
    }

    fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, ptr: u64) {
        let d = drv()?;
        // A VMM address: its mapping (NCCL's ncclCuMemFree unmaps what this says).
        let (b, s) = d.mem.containing(ptr).or_else(|| d.mem.mapping(ptr)).ok_or(CUDA_ERROR_NOT_FOUND)?;
        put_opt(base, b);
        put_opt(size, s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_up(1, PAGE), PAGE);
        assert_eq!(round_up(PAGE, PAGE), PAGE);
        assert_eq!(round_up(0, PAGE), 0);
    }
}
