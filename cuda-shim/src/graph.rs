//! CUDA graphs under the quotas.
//!
//! * Compute: a graph launch is charged the sum of [`kernel_cost`] over the
//!   exec's kernel nodes (child graphs included), computed when the exec is
//!   instantiated by walking the graph through the real driver, and kept
//!   up to date by `cuGraphExecUpdate`, `cuGraphExec{Kernel,Child,}NodeSetParams`.
//!   Conditional nodes' bodies are not counted (their trip count is
//!   decided on the device).
//! * Capture: launches onto a capturing stream are recorded, not run, so
//!   they are not charged (the graph launch is). [`CAPTURES`] counts the
//!   captures this process began; only while it is non-zero does a launch
//!   ask the driver whether its stream captures (a capture spreads to other
//!   streams through events, so the stream alone cannot tell).
//! * Capture modes: the interposer's own driver calls must not invalidate
//!   the application's captures (a GLOBAL-mode capture forbids "potentially
//!   unsafe" calls from every thread in GLOBAL mode, pool attribute reads
//!   included). [`relaxed`] runs bookkeeping calls in RELAXED mode, as
//!   PyTorch's allocator does around its own cudaMalloc; the watcher thread,
//!   which never captures, runs in THREAD_LOCAL mode ([`thread_local_mode`],
//!   as PyTorch's NCCL watchdog since pytorch#148594).
//! * Memory: an exec's graph memory (alloc nodes, captured
//!   `cuMemAllocAsync`) is reserved in the ledger at instantiation
//!   (CUDA_ERROR_OUT_OF_MEMORY over quota, without instantiating). The
//!   driver keeps a destroyed exec's memory in the device's graph pool until
//!   `cuDeviceGraphMemTrim`, so it stays reserved until then ("cached"); a
//!   later instantiation on that device takes from the cache first. The
//!   driver backs an exec's graph memory at its first launch or upload, so
//!   until then NVML does not show what the ledger reserved: [`unmapped_on`]
//!   tells the memory reconcile, which would otherwise take it out of the
//!   process's "extra" and leave the ledger short once the launch maps it
//!   (shim_graph's charge test, under load).

use crate::arg;
use crate::config::ENFORCING;
use crate::log::log;
use crate::real::{Lib, real_cuda, sym};
use crate::throttle::kernel_cost;
use cuda_abi::{CUDA_SUCCESS, CUresult};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, OnceLock};

type Ptr = *mut c_void;

/// Stream captures this process began and has not ended.
pub(crate) static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// `CUgraphNodeType` values the walk looks at.
const NODE_KERNEL: i32 = 0;
const NODE_GRAPH: i32 = 4;
const NODE_MEM_ALLOC: i32 = 10;
/// Child graphs nest at most this deep (a cycle would be a driver bug).
const MAX_DEPTH: u32 = 16;

/// What the interposer keeps per exec.
#[derive(Default)]
struct Exec {
    /// The sum of the node costs.
    cost: u64,
    /// Top-level kernel and child graph nodes -> their cost.
    nodes: HashMap<usize, u64>,
    /// Graph memory reserved for the exec.
    bytes: u64,
    device: i32,
    /// The share's GPU (ledger position) of `device`.
    gpu: usize,
    /// Of `bytes`, what the driver has not backed yet (no launch yet).
    unmapped: u64,
}

#[derive(Default)]
struct Table {
    execs: HashMap<usize, Exec>,
    /// Device -> bytes of destroyed execs still in its graph pool.
    cached: BTreeMap<i32, u64>,
    /// Share GPU -> the execs' `unmapped` bytes.
    unmapped: BTreeMap<usize, u64>,
}

/// The sum of [`Table::unmapped`]: a graph launch looks at the table only
/// while some exec waits for its first launch.
static UNMAPPED: AtomicU64 = AtomicU64::new(0);

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Default::default);

fn table() -> MutexGuard<'static, Table> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The graph launch's cost; 0 (unknown) for an exec the interposer did not
/// see instantiated. A graph without kernels (copies only) costs the least
/// unit, not the unknown launch's 1 ms.
pub(crate) fn launch_cost(exec: Ptr) -> u64 {
    table()
        .execs
        .get(&(exec as usize))
        .map_or(0, |e| e.cost.max(1))
}

/// Graph memory reserved on the share's `gpu` that the driver has not
/// backed yet (for the memory reconcile).
pub(crate) fn unmapped_on(gpu: usize) -> u64 {
    if UNMAPPED.load(Ordering::Acquire) == 0 {
        return 0;
    }
    table().unmapped.get(&gpu).copied().unwrap_or(0)
}

/// Before a graph launch: an exec launched for the first time has its
/// graph memory backed by this call, so it stops counting as unmapped.
/// The returned guard marks the change in flight until the launch returns
/// (the reconcile drops a measurement taken meanwhile).
#[inline]
pub(crate) fn mapping(exec: Ptr) -> Option<crate::mem::InFlight> {
    if UNMAPPED.load(Ordering::Acquire) == 0 {
        return None;
    }
    first_launch(exec)
}

#[cold]
fn first_launch(exec: Ptr) -> Option<crate::mem::InFlight> {
    let flight = crate::mem::InFlight::begin();
    let mut t = table();
    let e = t.execs.get_mut(&(exec as usize))?;
    let (gpu, n) = (e.gpu, std::mem::take(&mut e.unmapped));
    if n == 0 {
        return None;
    }
    forget_unmapped(&mut t, gpu, n);
    Some(flight)
}

fn forget_unmapped(t: &mut Table, gpu: usize, n: u64) {
    if let Some(u) = t.unmapped.get_mut(&gpu) {
        *u = u.saturating_sub(n);
    }
    UNMAPPED.fetch_sub(n, Ordering::AcqRel);
}

/// Whether work submitted to `stream` is being captured (the real driver's
/// `cuStreamIsCapturing`; an invalidated capture counts: its launches fail).
#[cold]
pub(crate) fn stream_capturing(stream: Ptr, ptsz: bool) -> bool {
    type IsCapturing = unsafe extern "C" fn(Ptr, *mut i32) -> CUresult;
    let f = if ptsz {
        drv().is_capturing_ptsz
    } else {
        drv().is_capturing
    };
    let Some(f) = f else { return false };
    let mut status = 0;
    // SAFETY: the real driver's function with its C signature.
    let r = unsafe { std::mem::transmute::<usize, IsCapturing>(f)(stream, &mut status) };
    r == CUDA_SUCCESS && status != 0
}

/// `CUstreamCaptureMode` values.
const CAPTURE_MODE_THREAD_LOCAL: u32 = 1;
const CAPTURE_MODE_RELAXED: u32 = 2;

/// Sets this thread's capture mode through the real driver; the previous
/// one (None: the driver has no such call).
fn exchange_mode(mode: u32) -> Option<u32> {
    type Exchange = unsafe extern "C" fn(*mut u32) -> CUresult;
    let f = drv().exchange_mode?;
    let mut m = mode;
    // SAFETY: the real cuThreadExchangeStreamCaptureMode, resolved by name; `m` is our local.
    let r = unsafe { std::mem::transmute::<usize, Exchange>(f)(&mut m) };
    (r == CUDA_SUCCESS).then_some(m)
}

/// Runs `f`, the interposer's own driver calls (bookkeeping the application
/// did not ask for), in RELAXED capture mode, then restores the thread's
/// mode: they never invalidate an open capture of the process.
pub(crate) fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    let prev = exchange_mode(CAPTURE_MODE_RELAXED);
    let r = f();
    if let Some(p) = prev {
        exchange_mode(p);
    }
    r
}

/// For a thread that never captures (the watcher): other threads'
/// captures no longer restrict it.
pub(crate) fn thread_local_mode() {
    exchange_mode(CAPTURE_MODE_THREAD_LOCAL);
}

/// True when some capture is active and `stream` is part of one: the
/// launch path's check (one relaxed load while nothing captures).
#[inline(always)]
pub(crate) fn captured(stream: Ptr, ptsz: bool) -> bool {
    CAPTURES.load(Ordering::Relaxed) != 0 && stream_capturing(stream, ptsz)
}

/// The real functions the walk needs (0: missing).
struct Drv {
    get_nodes: usize,
    node_type: usize,
    kernel_params: usize,
    alloc_params: usize,
    child_graph: usize,
    ctx_device: usize,
    is_capturing: Option<usize>,
    is_capturing_ptsz: Option<usize>,
    exchange_mode: Option<usize>,
}

fn drv() -> &'static Drv {
    static D: OnceLock<Drv> = OnceLock::new();
    D.get_or_init(|| {
        let v2 = sym(Lib::Cuda, c"cuGraphKernelNodeGetParams_v2");
        let nz = |p: usize| (p != 0).then_some(p);
        Drv {
            get_nodes: sym(Lib::Cuda, c"cuGraphGetNodes"),
            node_type: sym(Lib::Cuda, c"cuGraphNodeGetType"),
            kernel_params: nz(v2).unwrap_or_else(|| sym(Lib::Cuda, c"cuGraphKernelNodeGetParams")),
            alloc_params: sym(Lib::Cuda, c"cuGraphMemAllocNodeGetParams"),
            child_graph: sym(Lib::Cuda, c"cuGraphChildGraphNodeGetGraph"),
            ctx_device: sym(Lib::Cuda, c"cuCtxGetDevice"),
            is_capturing: nz(sym(Lib::Cuda, c"cuStreamIsCapturing")),
            is_capturing_ptsz: nz(sym(Lib::Cuda, c"cuStreamIsCapturing_ptsz")),
            exchange_mode: nz(sym(Lib::Cuda, c"cuThreadExchangeStreamCaptureMode")),
        }
    })
}

/// Grid and block of a kernel node params struct (any version: they share
/// the head `func, gridDim[3], blockDim[3]`).
#[repr(C)]
pub struct KernelHead {
    func: Ptr,
    grid: [u32; 3],
    block: [u32; 3],
}

/// `CUDA_KERNEL_NODE_PARAMS_v2` is 72 bytes, v1 56; room for both.
const KERNEL_PARAMS_BYTES: usize = 72;
/// `CUDA_MEM_ALLOC_NODE_PARAMS`: 120 bytes, `bytesize` at 104.
const ALLOC_PARAMS_BYTES: usize = 120;
const ALLOC_BYTESIZE_AT: usize = 104;

fn kernel_head_cost(p: *const KernelHead) -> u64 {
    // SAFETY: p points at a kernel params struct (checked by the caller).
    let k = unsafe { &*p };
    kernel_cost(k.grid, k.block)
}

/// What a graph holds: kernel cost, graph memory, and per top-level node
/// costs.
#[derive(Default)]
struct Walk {
    cost: u64,
    bytes: u64,
    nodes: HashMap<usize, u64>,
}

/// Walks `graph` through the real driver. Err: a call failed (the caller
/// lets the driver report the bad graph).
fn walk(graph: Ptr, depth: u32) -> Result<Walk, CUresult> {
    type GetNodes = unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> CUresult;
    type NodeType = unsafe extern "C" fn(Ptr, *mut i32) -> CUresult;
    type Params = unsafe extern "C" fn(Ptr, *mut u8) -> CUresult;
    type Child = unsafe extern "C" fn(Ptr, *mut Ptr) -> CUresult;
    let d = drv();
    if d.get_nodes == 0 || d.node_type == 0 || depth > MAX_DEPTH {
        return Err(cuda_abi::CUDA_ERROR_NOT_FOUND);
    }
    let ok = |r: CUresult| if r == CUDA_SUCCESS { Ok(()) } else { Err(r) };
    // SAFETY: the real driver's functions with their C signatures.
    let (get_nodes, node_type) = unsafe {
        (
            std::mem::transmute::<usize, GetNodes>(d.get_nodes),
            std::mem::transmute::<usize, NodeType>(d.node_type),
        )
    };
    let mut n = 0usize;
    // SAFETY: the real driver's function of this exact signature, resolved by name; its pointer
    // arguments are to our own live locals.
    ok(unsafe { get_nodes(graph, std::ptr::null_mut(), &mut n) })?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: as above; `nodes` holds `n` entries, the count the driver gave.
    ok(unsafe { get_nodes(graph, nodes.as_mut_ptr(), &mut n) })?;
    nodes.truncate(n);
    let mut w = Walk::default();
    for node in nodes {
        let mut t = -1;
        // SAFETY: the real driver's function of this exact signature, resolved by name; its
        // pointer arguments are to our own live locals.
        ok(unsafe { node_type(node, &mut t) })?;
        let cost = match t {
            NODE_KERNEL if d.kernel_params != 0 => {
                // SAFETY: `kernel_params` was resolved by name for the real function of this C
                // signature (checked non-zero above).
                let f = unsafe { std::mem::transmute::<usize, Params>(d.kernel_params) };
                let mut buf = [0u64; KERNEL_PARAMS_BYTES / 8];
                // SAFETY: the real cuGraphKernelNodeGetParams writes at most
                // KERNEL_PARAMS_BYTES into `buf`, which is that size and 8-aligned.
                ok(unsafe { f(node, buf.as_mut_ptr().cast()) })?;
                kernel_head_cost(buf.as_ptr().cast())
            }
            NODE_GRAPH if d.child_graph != 0 => {
                // SAFETY: `child_graph` was resolved by name for the real function of this C
                // signature (checked non-zero above).
                let f = unsafe { std::mem::transmute::<usize, Child>(d.child_graph) };
                let mut child = std::ptr::null_mut();
                // SAFETY: the real driver's function of this exact signature, resolved by name;
                // its pointer arguments are to our own live locals.
                ok(unsafe { f(node, &mut child) })?;
                let inner = walk(child, depth + 1)?;
                w.bytes = w.bytes.saturating_add(inner.bytes);
                inner.cost
            }
            NODE_MEM_ALLOC if d.alloc_params != 0 => {
                // SAFETY: `alloc_params` was resolved by name for the real function of this C
                // signature (checked non-zero above).
                let f = unsafe { std::mem::transmute::<usize, Params>(d.alloc_params) };
                let mut buf = [0u64; ALLOC_PARAMS_BYTES / 8];
                // SAFETY: the real cuGraphMemAllocNodeGetParams writes at most
                // ALLOC_PARAMS_BYTES into `buf`, which is that size and 8-aligned.
                ok(unsafe { f(node, buf.as_mut_ptr().cast()) })?;
                w.bytes = w.bytes.saturating_add(buf[ALLOC_BYTESIZE_AT / 8]);
                continue;
            }
            _ => continue,
        };
        w.cost = w.cost.saturating_add(cost);
        w.nodes.insert(node as usize, cost);
    }
    Ok(w)
}

/// The current context's device (where graph memory lands); 0 if unknown.
fn current_device() -> i32 {
    type CtxGetDevice = unsafe extern "C" fn(*mut i32) -> CUresult;
    let d = drv();
    let mut dev = 0;
    if d.ctx_device != 0 {
        // SAFETY: the real driver's function with its C signature.
        unsafe { std::mem::transmute::<usize, CtxGetDevice>(d.ctx_device)(&mut dev) };
    }
    dev
}

/// An instantiation: walks the graph, reserves its graph memory (less what
/// the device's pool already caches), then `call`s the driver, which writes
/// the exec to `out`.
unsafe fn instantiate(out: *mut Ptr, graph: Ptr, call: impl FnOnce() -> CUresult) -> CUresult {
    if !ENFORCING.load(Ordering::Relaxed) {
        return call();
    }
    let w = match walk(graph, 0) {
        Ok(w) => w,
        Err(e) => {
            log!(Debug, "graph walk failed ({e}); instantiating uncosted");
            return call();
        }
    };
    let device = current_device();
    let cached = {
        let mut t = table();
        let c = t.cached.entry(device).or_default();
        let take = (*c).min(w.bytes);
        *c -= take;
        take
    };
    let fresh = w.bytes - cached;
    let gpu = crate::devices::record(device).unwrap_or(0);
    // The exec is recorded inside the reservation's in-flight window, so no
    // reconcile sees the reserved bytes without them marked unmapped.
    let r = crate::mem::reserve_for(device, fresh, || {
        let r = call();
        if r == CUDA_SUCCESS && !out.is_null() {
            let exec = Exec {
                cost: w.cost,
                nodes: w.nodes,
                bytes: w.bytes,
                device,
                gpu,
                unmapped: fresh,
            };
            let mut t = table();
            // SAFETY: the driver succeeded, so it wrote the exec.
            t.execs.insert(unsafe { *out } as usize, exec);
            if fresh > 0 {
                *t.unmapped.entry(gpu).or_default() += fresh;
                UNMAPPED.fetch_add(fresh, Ordering::AcqRel);
            }
        }
        r
    });
    if r != CUDA_SUCCESS || out.is_null() {
        *table().cached.entry(device).or_default() += cached;
    }
    r
}

/// After a successful `cuGraphExecUpdate`: the exec now runs `graph`'s
/// kernels (graph memory cannot change in an update).
fn updated(exec: Ptr, graph: Ptr) {
    if let Ok(w) = walk(graph, 0)
        && let Some(e) = table().execs.get_mut(&(exec as usize))
    {
        e.cost = w.cost;
        e.nodes.extend(w.nodes);
    }
}

/// After a node of the exec changed: `cost` replaces its old cost.
fn node_changed(exec: Ptr, node: Ptr, cost: u64) {
    if let Some(e) = table().execs.get_mut(&(exec as usize)) {
        let old = e.nodes.insert(node as usize, cost).unwrap_or(0);
        e.cost = e.cost.saturating_sub(old).saturating_add(cost);
    }
}

/// `CUgraphNodeParams`: the type, then (at byte 16) the node's params.
#[repr(C)]
pub struct NodeParams {
    kind: i32,
    _reserved: [i32; 3],
    body: [u64; 29],
    _reserved2: i64,
}

type Instantiate5 = unsafe extern "C" fn(*mut Ptr, Ptr, *mut Ptr, *mut u8, usize) -> CUresult;
type InstantiateFlags = unsafe extern "C" fn(*mut Ptr, Ptr, u64) -> CUresult;
type InstantiateParams = unsafe extern "C" fn(*mut Ptr, Ptr, Ptr) -> CUresult;
type SetKernel = unsafe extern "C" fn(Ptr, Ptr, *const KernelHead) -> CUresult;
type Capture = unsafe extern "C" fn(Ptr, u32) -> CUresult;
type EndCapture = unsafe extern "C" fn(Ptr, *mut Ptr) -> CUresult;

/// A capture began: launches start asking about their stream.
fn began(r: CUresult) -> CUresult {
    if r == CUDA_SUCCESS {
        CAPTURES.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// `cuStreamEndCapture` returned: the capture is over unless the stream
/// still captures (an end on the wrong stream, say).
fn ended(stream: Ptr, ptsz: bool, r: CUresult) -> CUresult {
    if r == CUDA_SUCCESS || !stream_capturing(stream, ptsz) {
        let _ = CAPTURES.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
    r
}

cuda_exports! {
    fn cuGraphInstantiate(out: *mut Ptr, graph: Ptr, err: *mut Ptr, log: *mut u8, len: usize) {
        let f = real_cuda!(cuGraphInstantiate: Instantiate5);
        // SAFETY: `out` is our caller's out-pointer, NULL or valid (CUDA ABI), as
        // `instantiate` requires; `f` is the real driver's function of this
        // signature, resolved by name, given the caller's arguments unchanged.
        unsafe { instantiate(out, graph, || f(out, graph, err, log, len)) }
    }

    fn cuGraphInstantiate_v2(out: *mut Ptr, graph: Ptr, err: *mut Ptr, log: *mut u8, len: usize) {
        let f = real_cuda!(cuGraphInstantiate_v2: Instantiate5);
        // SAFETY: `out` is our caller's out-pointer, NULL or valid (CUDA ABI), as
        // `instantiate` requires; `f` is the real driver's function of this
        // signature, resolved by name, given the caller's arguments unchanged.
        unsafe { instantiate(out, graph, || f(out, graph, err, log, len)) }
    }

    fn cuGraphInstantiateWithFlags(out: *mut Ptr, graph: Ptr, flags: u64) {
        let f = real_cuda!(cuGraphInstantiateWithFlags: InstantiateFlags);
        // SAFETY: `out` is our caller's out-pointer, NULL or valid (CUDA ABI), as
        // `instantiate` requires; `f` is the real driver's function of this
        // signature, resolved by name, given the caller's arguments unchanged.
        unsafe { instantiate(out, graph, || f(out, graph, flags)) }
    }

    fn cuGraphInstantiateWithParams(out: *mut Ptr, graph: Ptr, params: Ptr) {
        let f = real_cuda!(cuGraphInstantiateWithParams: InstantiateParams);
        // SAFETY: `out` is our caller's out-pointer, NULL or valid (CUDA ABI), as
        // `instantiate` requires; `f` is the real driver's function of this
        // signature, resolved by name, given the caller's arguments unchanged.
        unsafe { instantiate(out, graph, || f(out, graph, params)) }
    }

    fn cuGraphInstantiateWithParams_ptsz(out: *mut Ptr, graph: Ptr, params: Ptr) {
        let f = real_cuda!(cuGraphInstantiateWithParams_ptsz: InstantiateParams);
        // SAFETY: `out` is our caller's out-pointer, NULL or valid (CUDA ABI), as
        // `instantiate` requires; `f` is the real driver's function of this
        // signature, resolved by name, given the caller's arguments unchanged.
        unsafe { instantiate(out, graph, || f(out, graph, params)) }
    }

    fn cuGraphExecUpdate(exec: Ptr, graph: Ptr, err: *mut Ptr, result: *mut i32) {
        let f = real_cuda!(cuGraphExecUpdate: unsafe extern "C" fn(Ptr, Ptr, *mut Ptr, *mut i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(exec, graph, err, result) };
        if r == CUDA_SUCCESS {
            updated(exec, graph);
        }
        r
    }

    fn cuGraphExecUpdate_v2(exec: Ptr, graph: Ptr, info: Ptr) {
        let f = real_cuda!(cuGraphExecUpdate_v2: unsafe extern "C" fn(Ptr, Ptr, Ptr) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(exec, graph, info) };
        if r == CUDA_SUCCESS {
            updated(exec, graph);
        }
        r
    }

    fn cuGraphExecKernelNodeSetParams(exec: Ptr, node: Ptr, params: *const KernelHead) {
        let f = real_cuda!(cuGraphExecKernelNodeSetParams: SetKernel);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(exec, node, params) };
        if r == CUDA_SUCCESS && !params.is_null() {
            node_changed(exec, node, kernel_head_cost(params));
        }
        r
    }

    fn cuGraphExecKernelNodeSetParams_v2(exec: Ptr, node: Ptr, params: *const KernelHead) {
        let f = real_cuda!(cuGraphExecKernelNodeSetParams_v2: SetKernel);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(exec, node, params) };
        if r == CUDA_SUCCESS && !params.is_null() {
            node_changed(exec, node, kernel_head_cost(params));
        }
        r
    }

    fn cuGraphExecNodeSetParams(exec: Ptr, node: Ptr, params: *mut NodeParams) {
        let f = real_cuda!(cuGraphExecNodeSetParams: unsafe extern "C" fn(Ptr, Ptr, *mut NodeParams) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(exec, node, params) };
        if r == CUDA_SUCCESS && let Some(p) = arg(params) {
            match p.kind {
                NODE_KERNEL => node_changed(exec, node, kernel_head_cost(p.body.as_ptr().cast())),
                NODE_GRAPH => {
                    if let Ok(w) = walk(p.body[0] as Ptr, 1) {
                        node_changed(exec, node, w.cost);
                    }
                }
                _ => {}
            }
        }
        r
    }

    fn cuGraphExecChildGraphNodeSetParams(exec: Ptr, node: Ptr, child: Ptr) {
        let f = real_cuda!(cuGraphExecChildGraphNodeSetParams: unsafe extern "C" fn(Ptr, Ptr, Ptr) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(exec, node, child) };
        if r == CUDA_SUCCESS && let Ok(w) = walk(child, 1) {
            node_changed(exec, node, w.cost);
        }
        r
    }

    fn cuGraphExecDestroy(exec: Ptr) {
        let f = real_cuda!(cuGraphExecDestroy: unsafe extern "C" fn(Ptr) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(exec) };
        if r == CUDA_SUCCESS {
            let _flight = crate::mem::InFlight::begin();
            let mut t = table();
            if let Some(e) = t.execs.remove(&(exec as usize))
                && e.bytes > 0
            {
                forget_unmapped(&mut t, e.gpu, e.unmapped);
                // The driver's graph pool keeps it until trimmed.
                *t.cached.entry(e.device).or_default() += e.bytes;
            }
        }
        r
    }

    fn cuDeviceGraphMemTrim(device: i32) {
        let f = real_cuda!(cuDeviceGraphMemTrim: unsafe extern "C" fn(i32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        let r = unsafe { f(device) };
        if r == CUDA_SUCCESS {
            let freed = table().cached.remove(&device).unwrap_or(0);
            crate::mem::release_reserved(device, freed);
        }
        r
    }

    fn cuStreamBeginCapture(stream: Ptr) {
        let f = real_cuda!(cuStreamBeginCapture: unsafe extern "C" fn(Ptr) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        began(unsafe { f(stream) })
    }

    fn cuStreamBeginCapture_ptsz(stream: Ptr) {
        let f = real_cuda!(cuStreamBeginCapture_ptsz: unsafe extern "C" fn(Ptr) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        began(unsafe { f(stream) })
    }

    fn cuStreamBeginCapture_v2(stream: Ptr, mode: u32) {
        let f = real_cuda!(cuStreamBeginCapture_v2: Capture);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        began(unsafe { f(stream, mode) })
    }

    fn cuStreamBeginCapture_v2_ptsz(stream: Ptr, mode: u32) {
        let f = real_cuda!(cuStreamBeginCapture_v2_ptsz: Capture);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        began(unsafe { f(stream, mode) })
    }

    fn cuStreamBeginCaptureToGraph(stream: Ptr, graph: Ptr, deps: Ptr, edges: Ptr, n: usize, mode: u32) {
        let f = real_cuda!(cuStreamBeginCaptureToGraph: unsafe extern "C" fn(Ptr, Ptr, Ptr, Ptr, usize, u32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        began(unsafe { f(stream, graph, deps, edges, n, mode) })
    }

    fn cuStreamBeginCaptureToGraph_ptsz(stream: Ptr, graph: Ptr, deps: Ptr, edges: Ptr, n: usize, mode: u32) {
        let f = real_cuda!(cuStreamBeginCaptureToGraph_ptsz: unsafe extern "C" fn(Ptr, Ptr, Ptr, Ptr, usize, u32) -> CUresult);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        began(unsafe { f(stream, graph, deps, edges, n, mode) })
    }

    fn cuStreamEndCapture(stream: Ptr, graph: *mut Ptr) {
        let f = real_cuda!(cuStreamEndCapture: EndCapture);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ended(stream, false, unsafe { f(stream, graph) })
    }

    fn cuStreamEndCapture_ptsz(stream: Ptr, graph: *mut Ptr) {
        let f = real_cuda!(cuStreamEndCapture_ptsz: EndCapture);
        // SAFETY: the real driver's function of this exact signature, resolved by
        // name; pointers are our caller's (passed on unchanged) or our own locals.
        ended(stream, true, unsafe { f(stream, graph) })
    }
}
