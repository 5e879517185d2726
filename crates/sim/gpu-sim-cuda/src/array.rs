//! CUDA arrays and mipmapped arrays: device memory counted by descriptor,
//! never addressed.

use crate::mem::ctx_and_driver;
use crate::{R, arg, drv, put};
use cuda_abi::*;
use std::ffi::c_void;

const ARRAY_MAGIC: u64 = 0x5349_4d41_5252_0001;

struct ArrayObj {
    magic: u64,
    gpu: usize,
    bytes: u64,
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct ArrayDesc {
    width: usize,
    height: usize,
    format: u32,
    channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct Array3dDesc {
    width: usize,
    height: usize,
    depth: usize,
    format: u32,
    channels: u32,
    flags: u32,
}

/// Bytes per element of a `CUarray_format`, times 2 (NV12 is 1.5 bytes).
fn format_bytes_x2(format: u32) -> R<u64> {
    Ok(match format {
        0x01 | 0x08 | 0xc0 | 0xc6 => 2,                      // 8-bit
        0x02 | 0x09 | 0x10 | 0xc1 | 0xc3 | 0xc7 | 0xc9 => 4, // 16-bit
        0x03 | 0x0a | 0x20 | 0xc2 | 0xc4 | 0xc8 | 0xca => 8, // 32-bit
        0xc5 | 0xcb => 16,
        0xb0 => 3, // NV12
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

fn array_bytes(w: usize, h: usize, depth: usize, format: u32, channels: u32) -> R<u64> {
    if w == 0 || !matches!(channels, 1 | 2 | 4) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let elems = w as u64 * h.max(1) as u64 * depth.max(1) as u64 * channels as u64;
    Ok((elems * format_bytes_x2(format)?).div_ceil(2))
}

unsafe fn array_create(out: *mut *mut c_void, bytes: R<u64>) -> R {
    let (d, c) = ctx_and_driver()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = bytes?;
    d.state
        .try_alloc(d.me, c.gpu, bytes)
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    let a = Box::new(ArrayObj {
        magic: ARRAY_MAGIC,
        gpu: c.gpu,
        bytes,
    });
    put(out, Box::into_raw(a).cast())?;
    Ok(())
}

unsafe fn array_destroy(h: *mut c_void) -> R {
    let d = drv()?;
    let a = h as *mut ArrayObj;
    // SAFETY: a non-NULL handle of this type is, per the CUDA ABI, one this driver handed out
    // (a Box it leaked); the magic word tells the types apart, and destroy zeroes it so a stale
    // handle fails here.
    if a.is_null() || unsafe { (*a).magic } != ARRAY_MAGIC {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: the handle passed its magic check, so it is a Box this driver leaked; freed once,
    // here, under cuArrayDestroy.
    let a = unsafe { Box::from_raw(a) };
    d.state.free(d.me, a.gpu, a.bytes);
    Ok(())
}

cuda_fn! {
    fn cuArrayCreate_v2(out: *mut *mut c_void, desc: *const ArrayDesc) {
        let d = arg(desc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `array_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_create(out, array_bytes(d.width, d.height, 1, d.format, d.channels)) }
    }

    fn cuArray3DCreate_v2(out: *mut *mut c_void, desc: *const Array3dDesc) {
        let d = arg(desc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `array_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_create(out, array_bytes(d.width, d.height, d.depth, d.format, d.channels)) }
    }

    fn cuArrayDestroy(a: *mut c_void) {
        // SAFETY: `array_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_destroy(a) }
    }

    fn cuMipmappedArrayCreate(out: *mut *mut c_void, desc: *const Array3dDesc, levels: u32) {
        let d = arg(desc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if levels == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut total = 0u64;
        let (mut w, mut h, mut z) = (d.width, d.height, d.depth);
        for _ in 0..levels {
            total += array_bytes(w, h, z, d.format, d.channels)?;
            (w, h, z) = ((w / 2).max(1), h / 2, z / 2);
            if d.height > 0 {
                h = h.max(1);
            }
            if d.depth > 0 {
                z = z.max(1);
            }
        }
        // SAFETY: `array_create` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_create(out, Ok(total)) }
    }

    fn cuMipmappedArrayDestroy(a: *mut c_void) {
        // SAFETY: `array_destroy` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { array_destroy(a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_sizes_follow_the_descriptor() {
        // 1024 x 768 RGBA float
        assert_eq!(array_bytes(1024, 768, 0, 0x20, 4), Ok(1024 * 768 * 16));
        // 1D of u8
        assert_eq!(array_bytes(100, 0, 0, 0x01, 1), Ok(100));
        // NV12: 1.5 bytes per pixel
        assert_eq!(array_bytes(64, 64, 0, 0xb0, 1), Ok(64 * 64 * 3 / 2));
        assert_eq!(array_bytes(0, 1, 1, 0x01, 1), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(array_bytes(1, 1, 1, 0x01, 3), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(array_bytes(1, 1, 1, 0x77, 1), Err(CUDA_ERROR_INVALID_VALUE));
    }
}
