//! Device memory nobody asked for by size: what a context takes while it
//! lives (`context_overhead_mib` of the node spec), its device malloc heap
//! (`CU_LIMIT_MALLOC_HEAP_SIZE`, resized by `cuCtxSetLimit`) and loaded
//! module images. Counted in the shared state like allocations, so NVML's
//! per-process used memory and `cuMemGetInfo` show them, as a real driver's
//! do; all of a context's charges go when it is destroyed.

use crate::ctx::{Ctx, current};
use crate::{Driver, R, drv, lock, put};
use cuda_abi::*;
use std::collections::HashMap;
use std::sync::Mutex;

/// What a charge pays for; the key is the context or module address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum What {
    Context,
    Heap,
    Module,
}

struct Charge {
    ctx: usize,
    gpu: usize,
    bytes: u64,
}

const CUDA_ERROR_UNSUPPORTED_LIMIT: CUresult = 215;
/// `CU_LIMIT_MALLOC_HEAP_SIZE`.
const LIMIT_HEAP: i32 = 2;
/// Defaults of `CUlimit` 0..=6 (stack, printf FIFO, heap, sync depth,
/// pending launches, L2 fetch granularity, persisting L2).
const LIMIT_DEFAULTS: [u64; 7] = [1024, 1 << 20, 8 << 20, 2, 2048, 64, 0];

#[derive(Default)]
pub(crate) struct Charges {
    charges: Mutex<HashMap<(What, usize), Charge>>,
    /// Limits set with cuCtxSetLimit, by (context, limit).
    limits: Mutex<HashMap<(usize, i32), u64>>,
}

fn key(c: &Ctx) -> usize {
    c as *const Ctx as usize
}

impl Charges {
    /// Charges `bytes` on `ctx`'s device for `what`/`k`, replacing an
    /// earlier charge of the same key (the difference must fit).
    pub fn set(&self, d: &Driver, what: What, k: usize, ctx: &Ctx, bytes: u64) -> R {
        let mut m = lock(&self.charges);
        let old = m.get(&(what, k)).map_or(0, |c| c.bytes);
        if bytes > old {
            d.state
                .try_alloc(d.me, ctx.gpu, bytes - old)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        } else {
            d.state.free(d.me, ctx.gpu, old - bytes);
        }
        m.insert(
            (what, k),
            Charge {
                ctx: key(ctx),
                gpu: ctx.gpu,
                bytes,
            },
        );
        Ok(())
    }

    /// Gives a charge back (nothing if it is gone already).
    pub fn drop_one(&self, d: &Driver, what: What, k: usize) {
        if let Some(c) = lock(&self.charges).remove(&(what, k)) {
            d.state.free(d.me, c.gpu, c.bytes);
        }
    }

    pub fn has(&self, what: What, k: usize) -> bool {
        lock(&self.charges).contains_key(&(what, k))
    }

    /// Gives back everything charged to a context that goes away.
    pub fn free_context(&self, d: &Driver, c: &Ctx) {
        let k = key(c);
        let gone: Vec<Charge> = {
            let mut m = lock(&self.charges);
            let keys: Vec<_> = m
                .iter()
                .filter(|(_, v)| v.ctx == k)
                .map(|(k, _)| *k)
                .collect();
            keys.into_iter().filter_map(|x| m.remove(&x)).collect()
        };
        for g in gone {
            d.state.free(d.me, g.gpu, g.bytes);
        }
        lock(&self.limits).retain(|(ctx, _), _| *ctx != k);
    }

    fn limit(&self, c: &Ctx, limit: i32) -> u64 {
        lock(&self.limits)
            .get(&(key(c), limit))
            .copied()
            .unwrap_or(LIMIT_DEFAULTS[limit as usize])
    }
}

/// A context comes to life: its overhead and its heap are charged. Does
/// nothing for a context already charged (a primary context retained again).
pub(crate) fn activate(d: &Driver, c: &Ctx) -> R {
    let ch = &d.mem.charges;
    if ch.has(What::Context, key(c)) {
        return Ok(());
    }
    let overhead = d.gpu_spec(c.gpu).context_overhead_bytes();
    ch.set(d, What::Context, key(c), c, overhead)?;
    if let Err(e) = ch.set(d, What::Heap, key(c), c, ch.limit(c, LIMIT_HEAP)) {
        ch.drop_one(d, What::Context, key(c));
        return Err(e);
    }
    Ok(())
}

/// A context goes away (destroyed, or a primary context released to zero
/// or reset): its allocations, modules, heap and overhead are freed.
pub(crate) fn deactivate(d: &Driver, c: &Ctx) {
    d.mem.free_context(d, c);
    d.mem.charges.free_context(d, c);
}

/// Bytes a module image takes on the device: the size its header gives (a
/// fatbinary or its wrapper, an ELF cubin), else a NUL-terminated PTX text;
/// rounded up to pages.
///
/// # Safety
/// `image` points to a module image as `cuModuleLoadData` accepts it.
pub(crate) unsafe fn image_bytes(image: *const u8) -> u64 {
    const FATBIN_WRAPPER: u32 = 0x466243b1;
    const FATBIN: u32 = 0xba55ed50;
    const ELF: u32 = 0x464c457f;
    // SAFETY: `image` is a module image as cuModuleLoadData accepts it (this fn's contract):
    // its header fields at these offsets are in bounds; read unaligned.
    let rd32 = |p: *const u8, off: usize| unsafe { (p.add(off) as *const u32).read_unaligned() };
    // SAFETY: as for rd32.
    let rd64 = |p: *const u8, off: usize| unsafe { (p.add(off) as *const u64).read_unaligned() };
    // SAFETY: as for rd32.
    let rd16 = |p: *const u8, off: usize| unsafe { (p.add(off) as *const u16).read_unaligned() };
    let mut p = image;
    if rd32(p, 0) == FATBIN_WRAPPER {
        p = rd64(p, 8) as *const u8;
        if p.is_null() {
            return 0;
        }
    }
    let bytes = match rd32(p, 0) {
        FATBIN => u64::from(rd16(p, 6)) + rd64(p, 8),
        ELF => {
            let sh = rd64(p, 0x28) + u64::from(rd16(p, 0x3a)) * u64::from(rd16(p, 0x3c));
            let ph = rd64(p, 0x20) + u64::from(rd16(p, 0x36)) * u64::from(rd16(p, 0x38));
            sh.max(ph)
        }
        _ => {
            // SAFETY: neither fatbinary nor ELF: the contract makes it NUL-terminated PTX text.
            unsafe { std::ffi::CStr::from_ptr(p.cast()) }
                .to_bytes()
                .len() as u64
                + 1
        }
    };
    bytes.div_ceil(4096) * 4096
}

/// Charges a module loaded into the current context.
pub(crate) fn charge_module(d: &Driver, module: usize, bytes: u64) -> R {
    let c = current()?;
    d.mem.charges.set(d, What::Module, module, c, bytes)
}

cuda_fn! {
    fn cuCtxSetLimit(limit: i32, value: usize) {
        let d = drv()?;
        let c = current()?;
        if !(0..LIMIT_DEFAULTS.len() as i32).contains(&limit) {
            return Err(CUDA_ERROR_UNSUPPORTED_LIMIT);
        }
        if limit == LIMIT_HEAP {
            d.mem.charges.set(d, What::Heap, key(c), c, value as u64)?;
        }
        lock(&d.mem.charges.limits).insert((key(c), limit), value as u64);
        Ok(())
    }

    fn cuCtxGetLimit(value: *mut usize, limit: i32) {
        let d = drv()?;
        let c = current()?;
        if let Some(v) = crate::limits::read_only(d, c, limit) {
            return put(value, v);
        }
        if !(0..LIMIT_DEFAULTS.len() as i32).contains(&limit) {
            return Err(CUDA_ERROR_UNSUPPORTED_LIMIT);
        }
        put(value, d.mem.charges.limit(c, limit) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_sizes() {
        let ptx = c".version 8.0\n.target sm_80\n";
        // SAFETY: a NUL-terminated PTX string.
        assert_eq!(unsafe { image_bytes(ptx.as_ptr().cast()) }, 4096);
        let mut fat = [0u8; 16];
        fat[..4].copy_from_slice(&0xba55ed50u32.to_le_bytes());
        fat[6..8].copy_from_slice(&16u16.to_le_bytes());
        fat[8..16].copy_from_slice(&(3u64 << 20).to_le_bytes());
        // SAFETY: a fatbinary header with its size fields, as image_bytes reads it.
        assert_eq!(unsafe { image_bytes(fat.as_ptr()) }, (3 << 20) + 4096);
        let mut wrapper = [0u8; 24];
        wrapper[..4].copy_from_slice(&0x466243b1u32.to_le_bytes());
        wrapper[8..16].copy_from_slice(&(fat.as_ptr() as u64).to_le_bytes());
        // SAFETY: a wrapper whose data pointer is the live fatbinary above.
        assert_eq!(unsafe { image_bytes(wrapper.as_ptr()) }, (3 << 20) + 4096);
    }
}
