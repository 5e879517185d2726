//! Graph executables: instantiation, update, launch, and the per-device
//! graph memory pool (see [`crate::graph`] for what is modelled).

use crate::ctx::current;
use crate::graph::*;
use crate::stream::Target;
use crate::{Driver, R, arg_mut, drv, get, put, put_opt};
use cuda_abi::*;
use gpu_sim_core::law::Launch;
use gpu_sim_core::state::now_ns;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

pub(crate) struct Exec {
    /// Kernel nodes, child graphs flattened.
    kernels: Vec<Kernel>,
    /// Top-level kernel node -> index in `kernels` (for SetParams).
    index: HashMap<u64, usize>,
    /// Node types in order (what cuGraphExecUpdate compares).
    shape: Vec<i32>,
    alloc_bytes: u64,
    _regions: Vec<Arc<Region>>,
    gpu: usize,
    /// Holds `alloc_bytes` of its device's pool.
    mapped: bool,
    busy_until: u64,
}

/// A device's graph memory pool.
#[derive(Default, Clone, Copy)]
pub(crate) struct Pool {
    reserved: u64,
    in_use: u64,
    reserved_high: u64,
    used_high: u64,
}

impl Graphs {
    fn build_exec(&self, g: u64, gpu: usize) -> R<Exec> {
        let (mut kernels, mut bytes, mut regions) = (Vec::new(), 0, Vec::new());
        self.flatten(g, &mut kernels, &mut bytes, &mut regions)?;
        let mut index = HashMap::new();
        let mut k = 0;
        let mut shape = Vec::new();
        for n in &self.graphs[&g] {
            let kind = &self.nodes[n].kind;
            shape.push(kind.type_value());
            match kind {
                Kind::Kernel(_) => {
                    index.insert(*n, k);
                    k += 1;
                }
                Kind::Child(c) => {
                    let (mut inner, mut b, mut r) = (Vec::new(), 0, Vec::new());
                    self.flatten(*c, &mut inner, &mut b, &mut r)?;
                    k += inner.len();
                }
                _ => {}
            }
        }
        Ok(Exec {
            kernels,
            index,
            shape,
            alloc_bytes: bytes,
            _regions: regions,
            gpu,
            mapped: false,
            busy_until: 0,
        })
    }

    fn exec(&mut self, h: *mut c_void) -> R<&mut Exec> {
        self.execs
            .get_mut(&id(h, EXEC_TAG)?)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Maps the exec's graph memory from its device's pool (growing the
    /// pool, i.e. allocating device memory, when the pool lacks it).
    fn map(&mut self, d: &Driver, h: *mut c_void) -> R {
        let e = self.exec(h)?;
        if e.mapped || e.alloc_bytes == 0 {
            return Ok(());
        }
        let (gpu, need) = (e.gpu, e.alloc_bytes);
        let pool = self.pools.entry(gpu).or_default();
        let free = pool.reserved - pool.in_use;
        if need > free {
            d.state
                .try_alloc(d.me, gpu, need - free)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
            pool.reserved += need - free;
        }
        pool.in_use += need;
        pool.reserved_high = pool.reserved_high.max(pool.reserved);
        pool.used_high = pool.used_high.max(pool.in_use);
        self.exec(h)?.mapped = true;
        Ok(())
    }

    fn unmap(&mut self, gpu: usize, bytes: u64) {
        if let Some(p) = self.pools.get_mut(&gpu) {
            p.in_use -= bytes;
        }
    }
}

/// Flags cuGraphInstantiateWithFlags knows (AUTO_FREE_ON_LAUNCH, UPLOAD,
/// DEVICE_LAUNCH, USE_NODE_PRIORITY).
const INSTANTIATE_FLAGS: u64 = 0xf;

unsafe fn instantiate(out: *mut *mut c_void, graph: *mut c_void, flags: u64) -> R {
    drv()?;
    let gpu = current()?.gpu;
    if out.is_null() || flags & !INSTANTIATE_FLAGS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let g = graph_id(graph)?;
    let mut st = state();
    let e = st.build_exec(g, gpu)?;
    let h = st.fresh(EXEC_TAG);
    st.execs.insert(h, e);
    put(out, h as *mut c_void)
}

/// `cuGraphExecUpdate`: same node types in the same order, same graph
/// memory; kernel parameters are taken over. Err: the update result.
fn exec_update(exec: *mut c_void, graph: *mut c_void) -> Result<(), i32> {
    // CU_GRAPH_EXEC_UPDATE_ERROR, _TOPOLOGY_CHANGED, _NOT_SUPPORTED.
    const ERROR: i32 = 1;
    const TOPOLOGY: i32 = 2;
    const UNSUPPORTED: i32 = 6;
    let g = graph_id(graph).map_err(|_| ERROR)?;
    let mut st = state();
    let old = st.exec(exec).map_err(|_| ERROR)?;
    let gpu = old.gpu;
    let new = st.build_exec(g, gpu).map_err(|_| ERROR)?;
    let old = st.exec(exec).map_err(|_| ERROR)?;
    if new.shape != old.shape || new.kernels.len() != old.kernels.len() {
        return Err(TOPOLOGY);
    }
    if new.alloc_bytes != old.alloc_bytes {
        return Err(UNSUPPORTED);
    }
    old.kernels = new.kernels;
    old.index.extend(new.index);
    Ok(())
}

unsafe fn exec_set_kernel(exec: *mut c_void, node: *mut c_void, p: *const c_void, v2: bool) -> R {
    drv()?;
    // SAFETY: `p` is our caller's kernel-params pointer of version `v2`, passed on under this
    // function's own contract.
    let k = unsafe { read_kernel(p, v2)? };
    let n = id(node, NODE_TAG)?;
    let mut st = state();
    let e = st.exec(exec)?;
    let i = *e.index.get(&n).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    e.kernels[i] = k;
    Ok(())
}

unsafe fn launch(exec: *mut c_void, stream: *mut c_void, ptsz: bool) -> R {
    let d = drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(stream, ptsz)? };
    // One entry of the context's launch queue; taken before the lock, as
    // a full queue sleeps.
    let slot = t.ctx().queue.admit(t.ctx().gpu);
    let mut st = state();
    if st.capture.is_capturing(t) {
        // Launching a graph into a capture (a child graph node): not modelled.
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    st.map(d, exec)?;
    let gpu = t.ctx().gpu;
    let e = st.exec(exec)?;
    // Each kernel node by its own law, as if launched one by one.
    let spec = d.gpu_spec(gpu);
    let dur: u64 = e
        .kernels
        .iter()
        .map(|k| {
            crate::module::law_of(k.func, d.node().kernel_wave_ns).duration_ns(
                spec,
                Launch::new(k.grid, k.block, k.shared),
                crate::launch::random(),
            )
        })
        .sum();
    if dur > 0 {
        let (_, end) = d.state.launch(d.me, gpu, dur, t.tail());
        t.ctx().queue.record(slot, end);
        t.set_tail(end);
        e.busy_until = end;
    }
    Ok(())
}

unsafe fn upload(exec: *mut c_void, stream: *mut c_void, ptsz: bool) -> R {
    let d = drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    unsafe { Target::of(stream, ptsz)? };
    state().map(d, exec)
}

/// Frees pool memory no exec holds; idle execs give theirs up first.
fn trim(d: &Driver, gpu: usize) {
    let now = now_ns();
    let mut st = state();
    let mut freed = 0;
    for e in st.execs.values_mut() {
        if e.gpu == gpu && e.mapped && crate::ctx::end_of(gpu, e.busy_until) <= now {
            e.mapped = false;
            freed += e.alloc_bytes;
        }
    }
    st.unmap(gpu, freed);
    if let Some(p) = st.pools.get_mut(&gpu) {
        let spare = p.reserved - p.in_use;
        if spare > 0 {
            d.state.free(d.me, gpu, spare);
            p.reserved -= spare;
        }
    }
}

/// `CUgraphMem_attribute`: USED_MEM_CURRENT, USED_MEM_HIGH,
/// RESERVED_MEM_CURRENT, RESERVED_MEM_HIGH.
fn mem_attribute(p: &Pool, attr: i32) -> R<u64> {
    match attr {
        0 => Ok(p.in_use),
        1 => Ok(p.used_high),
        2 => Ok(p.reserved),
        3 => Ok(p.reserved_high),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

type NodeH = *mut c_void;

cuda_fn! {
    // ---- executables ----

    fn cuGraphInstantiate(out: *mut *mut c_void, graph: *mut c_void, err_node: *mut NodeH, log: *mut u8, log_len: usize) {
        put_opt(err_node, std::ptr::null_mut());
        if log_len > 0 {
            put_opt(log, 0);
        }
        // SAFETY: `instantiate` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { instantiate(out, graph, 0) }
    }

    fn cuGraphInstantiate_v2(out: *mut *mut c_void, graph: *mut c_void, err_node: *mut NodeH, log: *mut u8, log_len: usize) {
        put_opt(err_node, std::ptr::null_mut());
        if log_len > 0 {
            put_opt(log, 0);
        }
        // SAFETY: `instantiate` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { instantiate(out, graph, 0) }
    }

    fn cuGraphInstantiateWithFlags(out: *mut *mut c_void, graph: *mut c_void, flags: u64) {
        // SAFETY: `instantiate` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { instantiate(out, graph, flags) }
    }

    fn cuGraphInstantiateWithParams(out: *mut *mut c_void, graph: *mut c_void, p: *mut InstantiateParams) {
        // SAFETY: `instantiate_with_params` gets the pointers and handles our caller passed
        // in, which the CUDA ABI makes valid for this call (or NULL, checked there);
        // handles are ones this driver handed out or are rejected by their magic.
        unsafe { instantiate_with_params(out, graph, p, false) }
    }

    fn cuGraphInstantiateWithParams_ptsz(out: *mut *mut c_void, graph: *mut c_void, p: *mut InstantiateParams) {
        // SAFETY: `instantiate_with_params` gets the pointers and handles our caller passed
        // in, which the CUDA ABI makes valid for this call (or NULL, checked there);
        // handles are ones this driver handed out or are rejected by their magic.
        unsafe { instantiate_with_params(out, graph, p, true) }
    }

    fn cuGraphExecUpdate(exec: *mut c_void, graph: *mut c_void, err_node: *mut NodeH, result: *mut i32) {
        drv()?;
        put_opt(err_node, std::ptr::null_mut());
        let r = exec_update(exec, graph);
        put_opt(result, r.err().unwrap_or(0));
        r.map_err(|_| CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE)
    }

    fn cuGraphExecUpdate_v2(exec: *mut c_void, graph: *mut c_void, info: *mut UpdateResultInfo) {
        drv()?;
        let r = exec_update(exec, graph);
        if let Some(i) = arg_mut(info) {
            *i = UpdateResultInfo {
                result: r.err().unwrap_or(0),
                error_node: std::ptr::null_mut(),
                error_from_node: std::ptr::null_mut(),
            };
        }
        r.map_err(|_| CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE)
    }

    fn cuGraphExecKernelNodeSetParams(exec: *mut c_void, node: NodeH, p: *const c_void) {
        // SAFETY: `exec_set_kernel` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { exec_set_kernel(exec, node, p, false) }
    }

    fn cuGraphExecKernelNodeSetParams_v2(exec: *mut c_void, node: NodeH, p: *const c_void) {
        // SAFETY: `exec_set_kernel` gets the pointers and handles our caller passed in,
        // which the CUDA ABI makes valid for this call (or NULL, checked there); handles
        // are ones this driver handed out or are rejected by their magic.
        unsafe { exec_set_kernel(exec, node, p, true) }
    }

    fn cuGraphLaunch(exec: *mut c_void, stream: *mut c_void) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(exec, stream, false) }
    }

    fn cuGraphLaunch_ptsz(exec: *mut c_void, stream: *mut c_void) {
        // SAFETY: `launch` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { launch(exec, stream, true) }
    }

    fn cuGraphUpload(exec: *mut c_void, stream: *mut c_void) {
        // SAFETY: `upload` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { upload(exec, stream, false) }
    }

    fn cuGraphUpload_ptsz(exec: *mut c_void, stream: *mut c_void) {
        // SAFETY: `upload` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { upload(exec, stream, true) }
    }

    fn cuGraphExecDestroy(exec: *mut c_void) {
        drv()?;
        let mut st = state();
        let e = st.execs.remove(&id(exec, EXEC_TAG)?).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if e.mapped {
            // Back to the pool: device memory until cuDeviceGraphMemTrim.
            st.unmap(e.gpu, e.alloc_bytes);
        }
        Ok(())
    }

    // ---- graph memory ----

    fn cuDeviceGraphMemTrim(dev: i32) {
        let d = drv()?;
        trim(d, d.device(dev)?.gpu);
        Ok(())
    }

    fn cuDeviceGetGraphMemAttribute(dev: i32, attr: i32, value: *mut u64) {
        let d = drv()?;
        let gpu = d.device(dev)?.gpu;
        let p = state().pools.get(&gpu).copied().unwrap_or_default();
        put(value, mem_attribute(&p, attr)?)
    }

    fn cuDeviceSetGraphMemAttribute(dev: i32, attr: i32, value: *mut u64) {
        let d = drv()?;
        let gpu = d.device(dev)?.gpu;
        // Only the high watermarks can be set, and only to 0 (a reset).
        if get(value)? != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = state();
        let p = st.pools.entry(gpu).or_default();
        match attr {
            1 => p.used_high = p.in_use,
            3 => p.reserved_high = p.reserved,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    }
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS`.
#[repr(C)]
pub struct InstantiateParams {
    flags: u64,
    upload_stream: *mut c_void,
    err_node: *mut c_void,
    result: i32,
}

/// `CUgraphExecUpdateResultInfo`.
#[repr(C)]
pub struct UpdateResultInfo {
    result: i32,
    error_node: *mut c_void,
    error_from_node: *mut c_void,
}

unsafe fn instantiate_with_params(
    out: *mut *mut c_void,
    graph: *mut c_void,
    p: *mut InstantiateParams,
    ptsz: bool,
) -> R {
    let p = arg_mut(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    p.err_node = std::ptr::null_mut();
    // SAFETY: `out` is our caller's out-pointer, passed on under this function's own contract.
    let r = unsafe { instantiate(out, graph, p.flags) };
    // CUDA_GRAPH_INSTANTIATE_SUCCESS / _ERROR.
    p.result = r.is_err() as i32;
    r?;
    // CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD.
    if p.flags & 2 != 0 {
        // SAFETY: `instantiate` succeeded, so it wrote the exec handle to `*out` (non-NULL);
        // `upload_stream` is the caller's stream handle, checked by magic.
        unsafe { upload(*out, p.upload_stream, ptsz)? };
    }
    Ok(())
}
