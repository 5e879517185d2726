//! CUDA graphs: explicit construction, instantiation, launch and the graph
//! memory pool. Stream capture, which builds graphs from stream work, is in
//! [`crate::capture`].
//!
//! Handles (`CUgraph`, `CUgraphNode`, `CUgraphExec`) are tagged ids, never
//! dereferenced: a stale or mistyped handle is an error, not a crash. All
//! graph state sits behind one lock; only graph calls take it (the kernel
//! launch path does not, see `capture::CAPTURING`).
//!
//! What is modelled (CUDA 12 semantics):
//! * kernel, memory alloc/free, empty and child-graph nodes; an exec is
//!   independent of its graph once instantiated (child graphs are cloned
//!   into their node, as the real driver does);
//! * a launch occupies the device timeline for the sum of its kernel nodes'
//!   durations (the sim's timeline is serial anyway);
//! * graph memory: an alloc node's address is fixed when the node is made
//!   (reserved address space, no device memory); its bytes are physically
//!   allocated from the device's graph pool at the exec's first launch or
//!   upload (device memory of the process, visible to NVML; a launch that
//!   does not fit fails with OUT_OF_MEMORY). Destroying the exec returns
//!   them to the pool, which keeps them until `cuDeviceGraphMemTrim`; a
//!   later exec reuses pool memory before growing it. Trim frees what no
//!   exec holds and unmaps idle execs (they map again at their next launch).

use crate::capture;
use crate::graph_exec::{Exec, Pool};
use crate::launch::FUNC_MAGIC;
use crate::{R, arg_mut, drv, get, lock, put};
use cuda_abi::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

const GRAPH_TAG: u64 = 0x6701 << 48;
pub(crate) const NODE_TAG: u64 = 0x6702 << 48;
pub(crate) const EXEC_TAG: u64 = 0x6703 << 48;
const TAG_MASK: u64 = 0xffff << 48;

/// `CUgraphNodeType` values.
pub(crate) const NODE_KERNEL: i32 = 0;
const NODE_GRAPH: i32 = 4;
const NODE_EMPTY: i32 = 5;
pub(crate) const NODE_MEM_ALLOC: i32 = 10;
pub(crate) const NODE_MEM_FREE: i32 = 11;

pub(crate) const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub(crate) const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub(crate) const CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE: CUresult = 910;

/// `CUDA_KERNEL_NODE_PARAMS_v2` (v1 is its first 56 bytes; v3 equals v2).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelParams {
    pub func: *mut c_void,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
    pub params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
    pub kern: *mut c_void,
    pub ctx: *mut c_void,
}
const KERNEL_PARAMS_V1: usize = 56;

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1 and v2 share the layout):
/// `CUmemPoolProps` (88 bytes), access descriptors, size, address.
#[repr(C)]
pub struct AllocParams {
    pub pool_props: [u8; 88],
    pub access: *const c_void,
    pub access_count: usize,
    pub bytesize: usize,
    pub dptr: u64,
}

/// `CUgraphNodeParams`: type, 3 reserved ints, a 232-byte union, reserved.
#[repr(C)]
pub struct NodeParams {
    pub kind: i32,
    reserved0: [i32; 3],
    pub union: [u64; 29],
    reserved2: i64,
}

/// Address space reserved for an alloc node (no device memory: that is
/// counted by the pool). Unmapped when the last graph or exec drops it.
pub(crate) struct Region {
    addr: u64,
    len: usize,
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` is the region alloc_kind mapped; a Region is dropped once, so
        // this is its only unmap.
        unsafe { libc::munmap(self.addr as *mut c_void, self.len) };
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    pub func: usize,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
}

#[derive(Clone)]
pub(crate) enum Kind {
    Kernel(Kernel),
    Alloc {
        props: [u8; 88],
        bytes: usize,
        region: Arc<Region>,
    },
    Free(u64),
    Empty,
    /// The node's own clone of the child graph.
    Child(u64),
}

impl Kind {
    pub fn type_value(&self) -> i32 {
        match self {
            Kind::Kernel(_) => NODE_KERNEL,
            Kind::Alloc { .. } => NODE_MEM_ALLOC,
            Kind::Free(_) => NODE_MEM_FREE,
            Kind::Empty => NODE_EMPTY,
            Kind::Child(_) => NODE_GRAPH,
        }
    }
}

pub(crate) struct Node {
    graph: u64,
    pub kind: Kind,
}

#[derive(Default)]
pub(crate) struct Graphs {
    next: u64,
    pub graphs: HashMap<u64, Vec<u64>>,
    pub nodes: HashMap<u64, Node>,
    pub execs: HashMap<u64, Exec>,
    pub pools: HashMap<usize, Pool>,
    pub capture: capture::Captures,
}

static GRAPHS: LazyLock<Mutex<Graphs>> = LazyLock::new(Default::default);

pub(crate) fn state() -> MutexGuard<'static, Graphs> {
    lock(&GRAPHS)
}

pub(crate) fn id(h: *mut c_void, tag: u64) -> R<u64> {
    let v = h as u64;
    if v & TAG_MASK != tag {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(v)
}

pub(crate) fn graph_id(h: *mut c_void) -> R<u64> {
    id(h, GRAPH_TAG)
}

impl Graphs {
    pub fn fresh(&mut self, tag: u64) -> u64 {
        self.next += 1;
        tag | self.next
    }

    pub fn new_graph(&mut self) -> u64 {
        let g = self.fresh(GRAPH_TAG);
        self.graphs.insert(g, Vec::new());
        g
    }

    /// Adds a node after `deps` (which must be nodes of `graph`).
    pub fn add(&mut self, graph: u64, deps: &[u64], kind: Kind) -> R<u64> {
        if !self.graphs.contains_key(&graph)
            || deps
                .iter()
                .any(|d| self.nodes.get(d).is_none_or(|n| n.graph != graph))
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let n = self.fresh(NODE_TAG);
        self.graphs.get_mut(&graph).unwrap().push(n);
        self.nodes.insert(n, Node { graph, kind });
        Ok(n)
    }

    pub fn graph_nodes(&self, g: u64) -> Option<&Vec<u64>> {
        self.graphs.get(&g)
    }

    pub fn node(&self, h: *mut c_void) -> R<&Node> {
        self.nodes
            .get(&id(h, NODE_TAG)?)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    pub fn destroy_graph(&mut self, g: u64) {
        for n in self.graphs.remove(&g).unwrap_or_default() {
            if let Some(Node {
                kind: Kind::Child(c),
                ..
            }) = self.nodes.remove(&n)
            {
                self.destroy_graph(c);
            }
        }
    }

    /// A copy of graph `g` (for child graph nodes); node ids are new.
    fn clone_graph(&mut self, g: u64) -> R<u64> {
        let nodes = self.graphs.get(&g).ok_or(CUDA_ERROR_INVALID_VALUE)?.clone();
        let c = self.new_graph();
        for n in nodes {
            let kind = match &self.nodes[&n].kind {
                Kind::Child(inner) => Kind::Child(self.clone_graph(*inner)?),
                Kind::Alloc { .. } | Kind::Free(_) => return Err(CUDA_ERROR_NOT_SUPPORTED),
                k => k.clone(),
            };
            self.add(c, &[], kind)?;
        }
        Ok(c)
    }

    /// Kernels, alloc bytes and address regions of `g`, children included.
    pub fn flatten(
        &self,
        g: u64,
        kernels: &mut Vec<Kernel>,
        bytes: &mut u64,
        regions: &mut Vec<Arc<Region>>,
    ) -> R {
        for n in self.graphs.get(&g).ok_or(CUDA_ERROR_INVALID_VALUE)? {
            match &self.nodes[n].kind {
                Kind::Kernel(k) => kernels.push(*k),
                Kind::Alloc {
                    bytes: b, region, ..
                } => {
                    *bytes += *b as u64;
                    regions.push(region.clone());
                }
                Kind::Child(c) => self.flatten(*c, kernels, bytes, regions)?,
                Kind::Free(_) | Kind::Empty => {}
            }
        }
        Ok(())
    }
}

/// A kernel node's shape, checked as a launch would be.
unsafe fn kernel_of(p: &KernelParams) -> R<Kernel> {
    let f = if p.func.is_null() { p.kern } else { p.func };
    let magic = f as *const u64;
    // SAFETY: `f` is non-NULL here and, per the CUDA ABI, a CUfunction this driver handed out,
    // whose first word is its magic (checked).
    if magic.is_null() || unsafe { *magic } != FUNC_MAGIC {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if p.grid.contains(&0) || p.block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if p.block.iter().map(|&b| b as u64).product::<u64>() > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(Kernel {
        func: f as usize,
        grid: p.grid,
        block: p.block,
        shared: p.shared,
    })
}

/// Reads a v1 (56-byte) or v2 kernel params struct.
pub(crate) unsafe fn read_kernel(p: *const c_void, v2: bool) -> R<Kernel> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: KernelParams is integers and raw pointers: all-zero is valid.
    let mut k: KernelParams = unsafe { std::mem::zeroed() };
    let n = if v2 {
        size_of::<KernelParams>()
    } else {
        KERNEL_PARAMS_V1
    };
    // SAFETY: `p` is non-NULL (checked above) and the caller's CUDA_KERNEL_NODE_PARAMS of the
    // version `v2` says, i.e. at least `n` bytes; `k` is a local of at least `n` bytes.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut k).cast::<u8>(), n) };
    // SAFETY: `k.func`/`k.kern` are the caller's CUfunction handles, which `kernel_of` checks
    // by magic.
    unsafe { kernel_of(&k) }
}

/// Reserves address space for `bytes` of graph memory on `gpu`.
pub(crate) fn alloc_kind(props: [u8; 88], bytes: usize) -> R<Kind> {
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let len = bytes.div_ceil(4096) * 4096;
    // SAFETY: a fresh private anonymous mapping (NULL hint, no MAP_FIXED) replaces nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(Kind::Alloc {
        props,
        bytes,
        region: Arc::new(Region {
            addr: p as u64,
            len,
        }),
    })
}

/// Pool props of a device-located alloc (what capture records).
pub(crate) fn device_props(ordinal: i32) -> [u8; 88] {
    let mut p = [0u8; 88];
    p[0] = 1; // CU_MEM_ALLOCATION_TYPE_PINNED
    p[8] = 1; // CU_MEM_LOCATION_TYPE_DEVICE
    p[12..16].copy_from_slice(&ordinal.to_ne_bytes());
    p
}

pub(crate) fn alloc_addr(k: &Kind) -> u64 {
    match k {
        Kind::Alloc { region, .. } => region.addr,
        _ => 0,
    }
}

unsafe fn deps(p: *const *mut c_void, n: usize) -> R<Vec<u64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `p` is non-NULL (checked above) and, per the CUDA ABI, the caller's array of `n`
    // node handles, read only during this call.
    unsafe { std::slice::from_raw_parts(p, n) }
        .iter()
        .map(|&h| id(h, NODE_TAG))
        .collect()
}

unsafe fn add_node(
    out: *mut *mut c_void,
    graph: *mut c_void,
    dep: *const *mut c_void,
    n: usize,
    kind: impl FnOnce(&mut Graphs) -> R<Kind>,
) -> R {
    drv()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let g = graph_id(graph)?;
    // SAFETY: `dep`/`n` are our caller's dependency array, passed on under this function's own
    // contract.
    let deps = unsafe { deps(dep, n)? };
    let mut st = state();
    let kind = kind(&mut st)?;
    let node = st.add(g, &deps, kind)?;
    put(out, node as *mut c_void)
}

unsafe fn mem_alloc_node(p: *mut AllocParams) -> R<Kind> {
    let p = arg_mut(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // CUmemPoolProps: allocType PINNED, location DEVICE with a valid ordinal.
    let word = |i: usize| i32::from_ne_bytes(p.pool_props[i..i + 4].try_into().unwrap());
    if word(0) != 1 || word(8) != 1 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    drv()?.device(word(12))?;
    let kind = alloc_kind(p.pool_props, p.bytesize)?;
    p.dptr = alloc_addr(&kind);
    Ok(kind)
}

/// `cuGraphAddNode*`: kernel, memory alloc/free, empty and child graph.
unsafe fn generic_node(st: &mut Graphs, p: *mut NodeParams) -> R<Kind> {
    let p = arg_mut(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let body = p.union.as_mut_ptr().cast::<c_void>();
    match p.kind {
        // SAFETY: `body` is the node-params union inside the caller's struct, sized for the v2
        // kernel params.
        NODE_KERNEL => Ok(Kind::Kernel(unsafe { read_kernel(body, true)? })),
        // SAFETY: `body` is the node-params union inside the caller's struct, which holds
        // CUDA_MEM_ALLOC_NODE_PARAMS for this kind.
        NODE_MEM_ALLOC => unsafe { mem_alloc_node(body.cast()) },
        NODE_MEM_FREE => Ok(Kind::Free(p.union[0])),
        NODE_EMPTY => Ok(Kind::Empty),
        NODE_GRAPH => Ok(Kind::Child(
            st.clone_graph(graph_id(p.union[0] as *mut c_void)?)?,
        )),
        _ => Err(CUDA_ERROR_NOT_SUPPORTED),
    }
}

unsafe fn kernel_params(node: *mut c_void, out: *mut c_void, v2: bool) -> R {
    drv()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let st = state();
    let Kind::Kernel(k) = st.node(node)?.kind else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    let p = KernelParams {
        func: k.func as *mut c_void,
        grid: k.grid,
        block: k.block,
        shared: k.shared,
        params: std::ptr::null_mut(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    };
    let n = if v2 {
        size_of::<KernelParams>()
    } else {
        KERNEL_PARAMS_V1
    };
    // SAFETY: `out` is non-NULL (checked above) and the caller's CUDA_KERNEL_NODE_PARAMS of the
    // version `v2` says, so it has room for `n` bytes; `p` is our local.
    unsafe { std::ptr::copy_nonoverlapping((&raw const p).cast::<u8>(), out.cast::<u8>(), n) };
    Ok(())
}

type NodeH = *mut c_void;

cuda_fn! {
    fn cuGraphCreate(out: *mut *mut c_void, flags: u32) {
        drv()?;
        if out.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, state().new_graph() as *mut c_void)
    }

    fn cuGraphDestroy(graph: *mut c_void) {
        drv()?;
        let g = graph_id(graph)?;
        let mut st = state();
        if !st.graphs.contains_key(&g) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        st.destroy_graph(g);
        Ok(())
    }

    fn cuGraphAddKernelNode(out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, n: usize, p: *const c_void) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |_| Ok(Kind::Kernel(read_kernel(p, false)?))) }
    }

    fn cuGraphAddKernelNode_v2(out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, n: usize, p: *const c_void) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |_| Ok(Kind::Kernel(read_kernel(p, true)?))) }
    }

    fn cuGraphAddMemAllocNode(out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, n: usize, p: *mut AllocParams) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |_| mem_alloc_node(p)) }
    }

    fn cuGraphAddMemFreeNode(out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, n: usize, dptr: u64) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |_| Ok(Kind::Free(dptr))) }
    }

    fn cuGraphAddEmptyNode(out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, n: usize) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |_| Ok(Kind::Empty)) }
    }

    fn cuGraphAddChildGraphNode(out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, n: usize, child: *mut c_void) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |st| Ok(Kind::Child(st.clone_graph(graph_id(child)?)?))) }
    }

    fn cuGraphAddNode(out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, n: usize, p: *mut NodeParams) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |st| generic_node(st, p)) }
    }

    fn cuGraphAddNode_v2(
        out: *mut NodeH, graph: *mut c_void, dep: *const NodeH, _edges: *const c_void, n: usize, p: *mut NodeParams,
    ) {
        // SAFETY: `add_node` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { add_node(out, graph, dep, n, |st| generic_node(st, p)) }
    }

    fn cuGraphGetNodes(graph: *mut c_void, nodes: *mut NodeH, count: *mut usize) {
        drv()?;
        let g = graph_id(graph)?;
        let st = state();
        let list = st.graphs.get(&g).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if count.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if nodes.is_null() {
            return put(count, list.len());
        }
        let n = get(count)?;
        for i in 0..n {
            let v = list.get(i).map_or(std::ptr::null_mut(), |&n| n as NodeH);
            // SAFETY: `nodes` is non-NULL and the caller's array of `*count`
            // handles (CUDA ABI); `i < *count`.
            unsafe { nodes.add(i).write(v) };
        }
        put(count, n.min(list.len()))?;
        Ok(())
    }

    fn cuGraphNodeGetType(node: NodeH, out: *mut i32) {
        drv()?;
        put(out, state().node(node)?.kind.type_value())
    }

    fn cuGraphNodeGetContainingGraph(node: NodeH, out: *mut *mut c_void) {
        drv()?;
        put(out, state().node(node)?.graph as *mut c_void)
    }

    fn cuGraphKernelNodeGetParams(node: NodeH, out: *mut c_void) {
        // SAFETY: `kernel_params` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { kernel_params(node, out, false) }
    }

    fn cuGraphKernelNodeGetParams_v2(node: NodeH, out: *mut c_void) {
        // SAFETY: `kernel_params` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { kernel_params(node, out, true) }
    }

    fn cuGraphMemAllocNodeGetParams(node: NodeH, out: *mut AllocParams) {
        drv()?;
        let st = state();
        let k = &st.node(node)?.kind;
        let Kind::Alloc { props, bytes, .. } = k else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        put(out, AllocParams {
            pool_props: *props,
            access: std::ptr::null(),
            access_count: 0,
            bytesize: *bytes,
            dptr: alloc_addr(k),
        })
    }

    fn cuGraphMemFreeNodeGetParams(node: NodeH, out: *mut u64) {
        drv()?;
        match state().node(node)?.kind {
            Kind::Free(p) => put(out, p),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    fn cuGraphChildGraphNodeGetGraph(node: NodeH, out: *mut *mut c_void) {
        drv()?;
        match state().node(node)?.kind {
            Kind::Child(g) => put(out, g as *mut c_void),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

}
