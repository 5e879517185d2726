//! The module loading mode (CUDA 11.7+): NVIDIA's runtime asks for it before
//! anything else and gives up on an error. As the real driver: lazy unless
//! `CUDA_MODULE_LOADING=EAGER` (lazy is the default since CUDA 12.2).

use crate::put;
use std::ffi::c_int;

const CU_MODULE_EAGER_LOADING: c_int = 1;
const CU_MODULE_LAZY_LOADING: c_int = 2;

fn mode() -> c_int {
    match std::env::var("CUDA_MODULE_LOADING").as_deref() {
        Ok("EAGER") => CU_MODULE_EAGER_LOADING,
        _ => CU_MODULE_LAZY_LOADING,
    }
}

cuda_fn! {
    fn cuModuleGetLoadingMode(out: *mut c_int) {
        put(out, mode())
    }
}
