//! Pointer attributes (`cuPointerGetAttribute`, `cuPointerGetAttributes`)
//! for what this driver hands out: device allocations (own or opened over
//! CUDA IPC), VMM mappings and pinned host memory. vLLM's custom
//! all-reduce asks `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` of each buffer
//! a graph captured before exporting its allocation with
//! `cudaIpcGetMemHandle` (csrc/custom_all_reduce.cuh,
//! `register_graph_buffers`); cudart's `cudaPointerGetAttributes` asks the
//! memory type, device and pointers.

use crate::ctx::current;
use crate::{Driver, R, drv, lock};
use cuda_abi::*;
use std::ffi::c_void;

/// `CUpointer_attribute` values this driver answers.
const CONTEXT: i32 = 1;
const MEMORY_TYPE: i32 = 2;
const DEVICE_POINTER: i32 = 3;
const HOST_POINTER: i32 = 4;
const SYNC_MEMOPS: i32 = 6;
const BUFFER_ID: i32 = 7;
const IS_MANAGED: i32 = 8;
const DEVICE_ORDINAL: i32 = 9;
const IS_LEGACY_CUDA_IPC_CAPABLE: i32 = 10;
const RANGE_START_ADDR: i32 = 11;
const RANGE_SIZE: i32 = 12;
const MAPPED: i32 = 13;
const ALLOWED_HANDLE_TYPES: i32 = 14;
const ACCESS_FLAGS: i32 = 16;

/// `CUmemorytype`.
const MEMORYTYPE_HOST: u32 = 1;
const MEMORYTYPE_DEVICE: u32 = 2;

/// What a pointer points into.
struct Info {
    host: bool,
    base: u64,
    size: u64,
    gpu: Option<usize>,
    /// Context handle (0: none known).
    ctx: u64,
    ipc_capable: bool,
    handle_types: u32,
}

fn describe(d: &Driver, ptr: u64) -> Option<Info> {
    let current = || current().map_or(0, |c| c as *const _ as u64);
    if let Some((base, size, gpu, ctx, pooled)) = d.mem.own_alloc(ptr) {
        return Some(Info {
            host: false,
            base,
            size: size as u64,
            gpu: Some(gpu),
            ctx: ctx as u64,
            ipc_capable: !pooled,
            handle_types: 0,
        });
    }
    {
        let m = lock(&d.mem.opened);
        if let Some((&base, o)) = m.range(..=ptr).next_back()
            && ptr < base + o.size as u64
        {
            return Some(Info {
                host: false,
                base,
                size: o.size as u64,
                gpu: Some(o.gpu),
                ctx: current(),
                ipc_capable: false,
                handle_types: 0,
            });
        }
    }
    if let Some(handles) = d.mem.mapped_cover(ptr, ptr + 1) {
        // The reserved range it lies in, as the driver reports for VMM.
        let r = lock(&d.mem.reserved);
        let (&base, &(raw, len)) = r.range(..=ptr).next_back()?;
        // SAFETY: a handle recorded in `mapped` is live while mapped.
        let p = unsafe { crate::vmm::phys(handles[0]) }.ok()?;
        return Some(Info {
            host: false,
            base,
            size: (raw + len) as u64 - base,
            gpu: p.loc,
            ctx: current(),
            ipc_capable: false,
            handle_types: p.types,
        });
    }
    let m = lock(&d.mem.host);
    let (&base, &len) = m.range(..=ptr).next_back()?;
    (ptr < base + len as u64).then(|| Info {
        host: true,
        base,
        size: len as u64,
        gpu: None,
        ctx: current(),
        ipc_capable: false,
        handle_types: 0,
    })
}

/// Writes attribute `attr` of `ptr` to `out`; INVALID_VALUE for a pointer
/// this driver did not hand out (as the driver answers a pageable host
/// pointer) or an attribute it does not model.
unsafe fn attribute(d: &Driver, out: *mut c_void, attr: i32, ptr: u64) -> R {
    let i = describe(d, ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let ordinal = |g: usize| {
        d.devices
            .iter()
            .find(|x| x.gpu == g)
            .map_or(-1, |x| x.ordinal)
    };
    let put32 = |v: u32| crate::put(out as *mut u32, v);
    let put64 = |v: u64| crate::put(out as *mut u64, v);
    match attr {
        CONTEXT => put64(i.ctx),
        MEMORY_TYPE => put32(if i.host {
            MEMORYTYPE_HOST
        } else {
            MEMORYTYPE_DEVICE
        }),
        // Unified addressing: one address for both sides.
        DEVICE_POINTER | HOST_POINTER => put64(ptr),
        SYNC_MEMOPS | MAPPED => put32(1),
        BUFFER_ID => put64(i.base),
        IS_MANAGED => put32(0),
        DEVICE_ORDINAL => put32(i.gpu.map_or(-1, ordinal) as u32),
        IS_LEGACY_CUDA_IPC_CAPABLE => put32(i.ipc_capable as u32),
        RANGE_START_ADDR => put64(i.base),
        RANGE_SIZE => put64(i.size),
        ALLOWED_HANDLE_TYPES => put64(u64::from(i.handle_types)),
        // CU_POINTER_ACCESS_FLAG_READWRITE.
        ACCESS_FLAGS => put32(3),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Writes an attribute's default (0 or NULL) in its type's width.
fn zero(out: *mut c_void, attr: i32) {
    match attr {
        CONTEXT | DEVICE_POINTER | HOST_POINTER | BUFFER_ID | RANGE_START_ADDR | RANGE_SIZE
        | ALLOWED_HANDLE_TYPES => crate::put_opt(out as *mut u64, 0),
        _ => crate::put_opt(out as *mut u32, 0),
    }
}

cuda_fn! {
    fn cuPointerGetAttribute(out: *mut c_void, attr: i32, ptr: u64) {
        let d = drv()?;
        // SAFETY: `out` is our caller's storage for the attribute's type (CUDA ABI).
        unsafe { attribute(d, out, attr, ptr) }
    }

    fn cuPointerGetAttributes(n: u32, attrs: *const i32, out: *mut *mut c_void, ptr: u64) {
        let d = drv()?;
        if attrs.is_null() || out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let known = describe(d, ptr).is_some();
        for k in 0..n as usize {
            // SAFETY: the caller's arrays of `n` attributes and out-pointers (CUDA ABI).
            let (a, o) = unsafe { (*attrs.add(k), *out.add(k)) };
            if known {
                // SAFETY: `o` is the caller's storage for attribute `a`'s type.
                unsafe { attribute(d, o, a, ptr) }?;
            } else {
                // Not a pointer of ours: the defaults (unregistered, NULL), no error.
                zero(o, a);
            }
        }
        Ok(())
    }
}
