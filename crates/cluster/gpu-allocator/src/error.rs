//! Errors. [`AllocError::kind`] separates bad requests (never satisfiable:
//! gRPC InvalidArgument) from a node that is full right now (ResourceExhausted
//! / Unavailable) and from misuse of the state (a stale or unknown id).

/// A topology the caller built is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error(
        "{matrix} matrix has {found} entries where {expected} (one per GPU) were expected: build it from the same GPU list"
    )]
    MatrixSize {
        matrix: &'static str,
        expected: usize,
        found: usize,
    },
    #[error(
        "GPU at position {position} says it is index {index}: GpuInfo::index must equal the GPU's position in the list"
    )]
    IndexMismatch { position: usize, index: usize },
    #[error(
        "topology between GPU {a} and GPU {b} differs from that between GPU {b} and GPU {a}: PCIe levels and NVLink counts must be symmetric"
    )]
    Asymmetric { a: usize, b: usize },
}

/// What went wrong, coarsely, for mapping to status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request can never be satisfied on this node as configured.
    InvalidRequest,
    /// Valid, but the free capacity does not hold it now.
    Insufficient,
    /// The caller's bookkeeping disagrees with the allocator (unknown or
    /// duplicate id, stale placement, GPU index out of range).
    State,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error(
        "vcuda-core {cores} is not a valid request: ask for 1..99 (a share of one GPU) or a multiple of 100 (whole GPUs: 100, 200, ...)"
    )]
    InvalidCores { cores: u32 },
    #[error(
        "vcuda-core {cores} asks for a share of one GPU, but share mode is off on this node: ask for a multiple of 100 (whole GPUs) or run the manager with --share-mode"
    )]
    ShareModeOff { cores: u32 },
    #[error(
        "vcuda-core {cores} asks for a share of one GPU but vcuda-memory is 0: a share needs at least one memory unit (256 MiB)"
    )]
    ShareWithoutMemory { cores: u32 },
    #[error(
        "vcuda-memory {requested} ({} MiB) is more than the largest GPU on this node holds, {largest} units ({} MiB): a share never spans GPUs, so ask for at most {largest}",
        .requested * 256, .largest * 256
    )]
    MemoryTooLarge { requested: u64, largest: u64 },
    #[error("vcuda-core {cores} asks for {requested} whole GPUs but this node has only {total}")]
    TooManyGpus {
        cores: u32,
        requested: usize,
        total: usize,
    },
    #[error("{request} is not a valid request: {problem}")]
    InvalidShares { request: String, problem: String },
    #[error("not enough free GPU capacity: {detail}")]
    Insufficient { detail: String },
    #[error("allocation {id:?} already exists: release it before committing it again")]
    DuplicateAllocation { id: String },
    #[error("allocation {id:?} is not known to the allocator")]
    UnknownAllocation { id: String },
    #[error("GPU index {gpu} does not exist: this node has {total} GPUs")]
    UnknownGpu { gpu: usize, total: usize },
    #[error("placement is malformed: {detail}")]
    InvalidPlacement { detail: String },
    #[error("placement for {id:?} no longer fits: {detail}; evaluate the request again")]
    Conflict { id: String, detail: String },
}

impl AllocError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            AllocError::InvalidCores { .. }
            | AllocError::ShareModeOff { .. }
            | AllocError::ShareWithoutMemory { .. }
            | AllocError::MemoryTooLarge { .. }
            | AllocError::TooManyGpus { .. }
            | AllocError::InvalidShares { .. } => ErrorKind::InvalidRequest,
            AllocError::Insufficient { .. } => ErrorKind::Insufficient,
            AllocError::DuplicateAllocation { .. }
            | AllocError::UnknownAllocation { .. }
            | AllocError::UnknownGpu { .. }
            | AllocError::InvalidPlacement { .. }
            | AllocError::Conflict { .. } => ErrorKind::State,
        }
    }
}
