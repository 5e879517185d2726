//! The container's view of GPU memory: the quota is the card's size, and
//! free is the quota minus what the whole container holds (never below
//! zero, never above what the card really has free).

use crate::config;
use crate::real::real_cuda;
use crate::registration::proc;
use crate::{out, written};
use cuda_abi::{CUDA_SUCCESS, CUresult};

/// (free, total) on the current context's device as the container sees
/// them, from the real ones.
pub fn virtual_mem(real_free: u64, real_total: u64) -> (u64, u64) {
    if config::enforce().is_none() {
        return (real_free, real_total);
    }
    virtual_mem_on(
        crate::devices::current().unwrap_or(0),
        real_free,
        real_total,
    )
}

/// (free, total) on the share's GPU at `gpu` (its ledger's position).
pub fn virtual_mem_on(gpu: usize, real_free: u64, real_total: u64) -> (u64, u64) {
    let Some(enf) = config::enforce() else {
        return (real_free, real_total);
    };
    let _ = proc().ensure_registered();
    crate::mem::measure_if_stale();
    let (quota, used, limit) = held_on(enf, gpu);
    if limit > quota {
        return borrower_view(limit, used, real_free, real_total);
    }
    clamp_view(quota, used, real_free, real_total)
}

/// A borrower sees its limit as the card and, free, what the manager says
/// it may still take (its quota's rest and what is left to lend); its
/// quota's rest alone if the manager does not answer.
#[cold]
fn borrower_view(limit: u64, used: u64, real_free: u64, real_total: u64) -> (u64, u64) {
    let total = limit.min(real_total);
    let may = crate::lending::available().unwrap_or(0);
    (may.min(real_free).min(total.saturating_sub(used)), total)
}

/// (quota, what the container holds, borrowing limit) on GPU `gpu`: the
/// attachment's, or the quota file's before one.
fn held_on(enf: &config::Enforce, gpu: usize) -> (u64, u64, u64) {
    match proc().attach().as_ref() {
        Some(a) => {
            let h = a.gpu(gpu);
            (h.quota, h.ledger.used(), h.limit)
        }
        None => (enf.gpus[gpu.min(enf.gpus.len() - 1)].gpu_memory, 0, 0),
    }
}

/// Pure part of [`virtual_mem`].
pub fn clamp_view(quota: u64, used: u64, real_free: u64, real_total: u64) -> (u64, u64) {
    let total = quota.min(real_total);
    let free = total.saturating_sub(used).min(real_free);
    (free, total)
}

/// The card's size as the share sees it on GPU `gpu`: its limit for a
/// borrower, else its quota (no question to the manager).
fn total_on(gpu: usize, real_total: u64) -> u64 {
    let Some(enf) = config::enforce() else {
        return real_total;
    };
    let _ = proc().ensure_registered();
    let (quota, _, limit) = held_on(enf, gpu);
    quota.max(limit).min(real_total)
}

/// The quota as device `dev`'s total memory (a device outside the share
/// is shown as it is: its contexts are refused).
pub fn virtual_total(dev: i32, real_total: u64) -> u64 {
    if config::enforce().is_none() {
        return real_total;
    }
    match crate::devices::record(dev) {
        Ok(gpu) => total_on(gpu, real_total),
        Err(_) => real_total,
    }
}

cuda_exports! {
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let f = real_cuda!(cuMemGetInfo_v2: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(free, total) };
        if r == CUDA_SUCCESS
            && let (Some(fr), Some(to)) = (written(free), written(total))
        {
            let (fr, to) = virtual_mem(fr as u64, to as u64);
            out(free, fr as usize);
            out(total, to as usize);
        }
        r
    }

    fn cuMemGetInfo(free: *mut u32, total: *mut u32) {
        // The legacy 32-bit query: answered from the 64-bit one.
        let f = real_cuda!(cuMemGetInfo_v2: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult);
        if free.is_null() || total.is_null() {
            return cuda_abi::CUDA_ERROR_INVALID_VALUE;
        }
        let (mut fr, mut to) = (0usize, 0usize);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(&mut fr, &mut to) };
        if r == CUDA_SUCCESS {
            let (fr, to) = virtual_mem(fr as u64, to as u64);
            out(free, fr.min(u32::MAX as u64) as u32);
            out(total, to.min(u32::MAX as u64) as u32);
        }
        r
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) {
        let f = real_cuda!(cuDeviceTotalMem_v2: unsafe extern "C" fn(*mut usize, i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(bytes, dev) };
        if r == CUDA_SUCCESS && let Some(b) = written(bytes) {
            out(bytes, virtual_total(dev, b as u64) as usize);
        }
        r
    }

    fn cuDeviceTotalMem(bytes: *mut u32, dev: i32) {
        let f = real_cuda!(cuDeviceTotalMem_v2: unsafe extern "C" fn(*mut usize, i32) -> CUresult);
        if bytes.is_null() {
            return cuda_abi::CUDA_ERROR_INVALID_VALUE;
        }
        let mut b = 0usize;
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(&mut b, dev) };
        if r == CUDA_SUCCESS {
            out(bytes, virtual_total(dev, b as u64).min(u32::MAX as u64) as u32);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_never_underflows_nor_exceeds_the_card() {
        assert_eq!(clamp_view(1000, 300, 10_000, 16_000), (700, 1000));
        assert_eq!(clamp_view(1000, 1300, 10_000, 16_000), (0, 1000));
        assert_eq!(clamp_view(1000, 300, 200, 16_000), (200, 1000));
        assert_eq!(clamp_view(100_000, 0, 500, 16_000), (500, 16_000));
    }
}
