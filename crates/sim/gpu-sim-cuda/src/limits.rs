//! The context limits CUDA 12.8 added for CIG (CUDA in graphics) contexts,
//! as `cuCtxGetLimit` answers them for an ordinary context: the shared
//! memory a context may use (`CU_LIMIT_SHMEM_SIZE`: all of a
//! multiprocessor's, no CIG reservation) and CIG off. cuBLASLt 13 reads the
//! first at `cublasCreate` ("per-ctx shared memory size limit") and fails
//! every matmul without it. Drivers older than 12.8 refuse them
//! (`CUDA_ERROR_UNSUPPORTED_LIMIT`, the caller's path); the first version
//! that has them was not checked beyond 12.8's cuda.h.

use crate::Driver;
use crate::ctx::Ctx;

const CU_LIMIT_SHMEM_SIZE: i32 = 7;
const CU_LIMIT_CIG_ENABLED: i32 = 8;
const CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED: i32 = 9;
const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: i32 = 81;

/// The value of a read-only limit of this node's driver, or None (not one
/// of them, or the driver predates them).
pub(crate) fn read_only(d: &Driver, c: &Ctx, limit: i32) -> Option<usize> {
    if d.node().cuda_version < 12080 {
        return None;
    }
    match limit {
        CU_LIMIT_SHMEM_SIZE => {
            let g = d.gpu_spec(c.gpu);
            crate::device::attribute(g, c.ordinal, MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
                .ok()
                .map(|v| v as usize)
        }
        CU_LIMIT_CIG_ENABLED | CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED => Some(0),
        _ => None,
    }
}
