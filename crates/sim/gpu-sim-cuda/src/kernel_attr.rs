//! Attributes of a `CUkernel` (a library's kernel, per device): the same as
//! its function's here, where a library is loaded once for every device.
//! cudart 13 asks them for PyTorch's CUB scans (`torch.cumsum`), cuBLASLt 13
//! sets them before its half-precision matmuls.

use crate::drv;
use crate::module::{cuFuncGetAttribute, cuFuncSetAttribute, cuFuncSetCacheConfig};
use std::ffi::c_void;

cuda_fn! {
    fn cuKernelGetAttribute(value: *mut i32, attr: i32, kernel: *mut c_void, dev: i32) {
        drv()?.device(dev)?;
        // SAFETY: our caller's arguments, passed on (CUDA ABI): the handle is checked by
        // its magic, the out-pointer for NULL.
        match unsafe { cuFuncGetAttribute(value, attr, kernel) } {
            0 => Ok(()),
            e => Err(e),
        }
    }

    fn cuKernelSetAttribute(attr: i32, value: i32, kernel: *mut c_void, dev: i32) {
        drv()?.device(dev)?;
        // SAFETY: as cuKernelGetAttribute.
        match unsafe { cuFuncSetAttribute(kernel, attr, value) } {
            0 => Ok(()),
            e => Err(e),
        }
    }

    fn cuKernelSetCacheConfig(kernel: *mut c_void, config: i32, dev: i32) {
        drv()?.device(dev)?;
        // SAFETY: as cuKernelGetAttribute.
        match unsafe { cuFuncSetCacheConfig(kernel, config) } {
            0 => Ok(()),
            e => Err(e),
        }
    }
}
