//! Two slots cuBLASLt 13 calls (found by tracing PyTorch's matmul, see
//! tests/python/test_torch.py), reverse-engineered from its use of them:
//! TOOLS_TLS slot 2 hands out the calling thread's current context, and
//! RUNTIME13 slot 4 that context's unique id, the key of cuBLASLt's
//! per-context state. Without them every cublasLt matmul fails its
//! heuristics query (CUBLAS_STATUS_NOT_SUPPORTED).

use crate::ctx::current;
use crate::put;
use cuda_abi::*;
use std::ffi::c_void;

/// TOOLS_TLS slot 2: `(CUcontext *out) -> CUresult`, the current context
/// (CUDA_ERROR_INVALID_CONTEXT without one).
pub(super) unsafe extern "C" fn current_context(out: *mut *mut c_void) -> CUresult {
    let r = current().and_then(|c| put(out, c as *const _ as *mut c_void));
    super::result(r)
}

/// RUNTIME13 slot 4: `(CUcontext, unsigned long long *id) -> CUresult`. A
/// context is never freed here (a destroyed one stays as a tombstone), so
/// its address is unique for the life of the process.
pub(super) unsafe extern "C" fn context_id(ctx: *mut c_void, id: *mut u64) -> CUresult {
    if ctx.is_null() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    super::result(put(id, ctx as u64))
}
