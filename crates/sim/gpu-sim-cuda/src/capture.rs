//! Stream capture: while a stream captures, kernel launches, `cuMemAllocAsync`
//! and `cuMemFreeAsync` on it become kernel, memory alloc and memory free
//! nodes of the capture's graph (chained in stream order) instead of running.
//!
//! A capture spreads as in the real driver: an event recorded on a capturing
//! stream carries the capture's current nodes, and a stream that waits on it
//! joins the capture (fork); the origin waiting on an event recorded on the
//! joined stream merges the branches back (join). `cuStreamEndCapture` on the
//! origin ends the capture for every stream that joined it (unjoined branches
//! are not reported as an error here).
//!
//! Only created streams capture: the legacy and per-thread default streams
//! answer CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. Capture modes are enforced
//! as the driver does (`crate::capture_mode`): a prohibited call invalidates
//! the capture, whose end then fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
//! a non-RELAXED capture ends only on the thread that began it.

use crate::capture_mode::{self, RELAXED, ctx_key, thread_id};
use crate::graph::{self, CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, Kind};
use crate::stream::Target;
use crate::{R, drv, get, put, put_opt};
use cuda_abi::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Streams capturing now. The launch and async-allocation paths read only
/// this while it is 0 (no lock).
pub(crate) static CAPTURING: AtomicUsize = AtomicUsize::new(0);

const CUDA_ERROR_STREAM_CAPTURE_MERGE: CUresult = 902;
const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CUresult = 903;
const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;

pub(crate) struct CapStream {
    seq: u64,
    /// The nodes the stream's next captured work depends on.
    deps: Vec<u64>,
    /// The stream's context (`capture_mode::ctx_key`).
    pub ctx: usize,
    /// Not CU_STREAM_NON_BLOCKING: the legacy stream encompasses it.
    pub blocking: bool,
}

pub(crate) struct Seq {
    graph: u64,
    origin: usize,
    /// cuStreamBeginCaptureToGraph: the graph is the caller's.
    into_existing: bool,
    /// The mode it began with, and the thread that began it.
    pub mode: u32,
    pub thread: u64,
    /// A prohibited call happened: the capture can only be ended, with an error.
    invalidated: bool,
}

#[derive(Default)]
pub(crate) struct Captures {
    next_seq: u64,
    streams: HashMap<usize, CapStream>,
    seqs: HashMap<u64, Seq>,
    /// Events recorded on a capturing stream: (sequence, nodes).
    events: HashMap<usize, (u64, Vec<u64>)>,
}

fn key(t: Target) -> Option<usize> {
    match t {
        Target::Stream(s) => Some(s as *const _ as usize),
        _ => None,
    }
}

impl Captures {
    pub fn is_capturing(&self, t: Target) -> bool {
        key(t).is_some_and(|k| self.streams.contains_key(&k))
    }

    /// Invalidates every open capture `hit` selects; whether there was one.
    pub fn invalidate(&mut self, hit: impl Fn(&Seq) -> bool) -> bool {
        let mut any = false;
        for s in self.seqs.values_mut().filter(|s| hit(s)) {
            s.invalidated = true;
            any = true;
        }
        any
    }

    /// Invalidates the captures of the streams `hit` selects.
    pub fn invalidate_streams(&mut self, hit: impl Fn(&CapStream) -> bool) -> bool {
        let seqs: Vec<u64> = self
            .streams
            .values()
            .filter(|s| hit(s))
            .map(|s| s.seq)
            .collect();
        for q in &seqs {
            if let Some(s) = self.seqs.get_mut(q) {
                s.invalidated = true;
            }
        }
        !seqs.is_empty()
    }

    /// Invalidates `t`'s capture, if it captures.
    pub fn invalidate_stream(&mut self, t: Target) -> bool {
        let Some(seq) = key(t).and_then(|k| self.streams.get(&k)).map(|s| s.seq) else {
            return false;
        };
        self.seqs.get_mut(&seq).unwrap().invalidated = true;
        true
    }

    /// Invalidates the capture event `ev` was recorded in, if open.
    pub fn invalidate_event(&mut self, ev: usize) -> bool {
        let Some(seq) = self.events.get(&ev).map(|e| e.0) else {
            return false;
        };
        self.seqs
            .get_mut(&seq)
            .map(|s| s.invalidated = true)
            .is_some()
    }
}

/// Appends `kind` to the capture of `t`'s stream; None when not capturing.
fn record(t: Target, kind: impl FnOnce() -> R<Kind>) -> R<Option<u64>> {
    let Some(k) = key(t) else { return Ok(None) };
    let mut st = graph::state();
    let Some(cs) = st.capture.streams.get(&k) else {
        return Ok(None);
    };
    let seq = &st.capture.seqs[&cs.seq];
    if seq.invalidated {
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    let (graph, deps) = (seq.graph, cs.deps.clone());
    let node = st.add(graph, &deps, kind()?)?;
    st.capture.streams.get_mut(&k).unwrap().deps = vec![node];
    Ok(Some(node))
}

/// Launch hook: true when the launch was captured instead of run.
#[inline]
pub(crate) fn kernel(
    t: Target,
    f: *mut c_void,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
) -> R<bool> {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(false);
    }
    capture_mode::legacy_use(t)?;
    let k = graph::Kernel {
        func: f as usize,
        grid,
        block,
        shared,
    };
    Ok(record(t, || Ok(Kind::Kernel(k)))?.is_some())
}

/// `cuMemAllocAsync` hook: the address of the new alloc node, if captured.
#[inline]
pub(crate) fn alloc(t: Target, size: usize) -> R<Option<u64>> {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(None);
    }
    let mut addr = 0;
    let props = graph::device_props(t.ctx().ordinal);
    record(t, || {
        let kind = graph::alloc_kind(props, size)?;
        addr = graph::alloc_addr(&kind);
        Ok(kind)
    })?;
    Ok((addr != 0).then_some(addr))
}

/// `cuMemFreeAsync` hook: true when captured as a free node.
#[inline]
pub(crate) fn free(t: Target, ptr: u64) -> R<bool> {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(false);
    }
    Ok(record(t, || Ok(Kind::Free(ptr)))?.is_some())
}

/// `cuEventRecord` hook: true when recorded into a capture (no time).
#[inline]
pub(crate) fn event_record(ev: *mut c_void, t: Target) -> bool {
    if CAPTURING.load(Relaxed) == 0 {
        return false;
    }
    let mut st = graph::state();
    let c = &mut st.capture;
    match key(t).and_then(|k| c.streams.get(&k)) {
        Some(cs) => {
            let v = (cs.seq, cs.deps.clone());
            c.events.insert(ev as usize, v);
            true
        }
        None => {
            c.events.remove(&(ev as usize));
            false
        }
    }
}

/// `cuStreamWaitEvent` hook: a wait on a captured event joins the stream
/// to that capture (or merges the branch). True when handled here.
#[inline]
pub(crate) fn wait_event(t: Target, ev: *mut c_void) -> R<bool> {
    if CAPTURING.load(Relaxed) == 0 {
        return Ok(false);
    }
    let mut st = graph::state();
    let c = &mut st.capture;
    let Some((seq, deps)) = c.events.get(&(ev as usize)).cloned() else {
        return Ok(false);
    };
    let k = key(t).ok_or(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)?;
    match c.streams.get_mut(&k) {
        Some(cs) if cs.seq != seq => return Err(CUDA_ERROR_STREAM_CAPTURE_MERGE),
        Some(cs) => {
            for d in deps {
                if !cs.deps.contains(&d) {
                    cs.deps.push(d);
                }
            }
        }
        None => {
            c.streams.insert(k, cap_stream(t, seq, deps));
            CAPTURING.fetch_add(1, Relaxed);
        }
    }
    Ok(true)
}

/// `cuStreamDestroy` hook: a destroyed stream leaves its capture (its
/// address may be reused); destroying the origin abandons the capture.
pub(crate) fn stream_destroyed(t: Target) {
    if CAPTURING.load(Relaxed) == 0 {
        return;
    }
    let Some(k) = key(t) else { return };
    let mut st = graph::state();
    let c = &mut st.capture;
    let Some(cs) = c.streams.remove(&k) else {
        return;
    };
    CAPTURING.fetch_sub(1, Relaxed);
    if c.seqs[&cs.seq].origin == k {
        let before = c.streams.len();
        c.streams.retain(|_, s| s.seq != cs.seq);
        CAPTURING.fetch_sub(before - c.streams.len(), Relaxed);
        c.events.retain(|_, (s, _)| *s != cs.seq);
        let seq = c.seqs.remove(&cs.seq).unwrap();
        if !seq.into_existing {
            st.destroy_graph(seq.graph);
        }
    }
}

unsafe fn begin(h: *mut c_void, mode: u32, ptsz: bool, into: Option<(u64, Vec<u64>)>) -> R {
    drv()?;
    if mode > 2 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(h, ptsz)? };
    let k = key(t).ok_or(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)?;
    let mut st = graph::state();
    if st.capture.streams.contains_key(&k) {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    let existing = into.is_some();
    let (graph, deps) = match into {
        Some((g, deps)) => {
            let ok = st
                .graph_nodes(g)
                .is_some_and(|n| deps.iter().all(|d| n.contains(d)));
            if !ok {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            (g, deps)
        }
        None => (st.new_graph(), Vec::new()),
    };
    let c = &mut st.capture;
    c.next_seq += 1;
    let seq = c.next_seq;
    c.seqs.insert(
        seq,
        Seq {
            graph,
            origin: k,
            into_existing: existing,
            mode,
            thread: thread_id(),
            invalidated: false,
        },
    );
    c.streams.insert(k, cap_stream(t, seq, deps));
    CAPTURING.fetch_add(1, Relaxed);
    Ok(())
}

unsafe fn end(h: *mut c_void, out: *mut *mut c_void, ptsz: bool) -> R {
    drv()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(h, ptsz)? };
    let k = key(t).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    let mut st = graph::state();
    let c = &mut st.capture;
    let seq = c.streams.get(&k).ok_or(CUDA_ERROR_ILLEGAL_STATE)?.seq;
    let s = &c.seqs[&seq];
    if s.origin != k {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    }
    if s.mode != RELAXED && s.thread != thread_id() {
        return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    }
    let before = c.streams.len();
    c.streams.retain(|_, s| s.seq != seq);
    CAPTURING.fetch_sub(before - c.streams.len(), Relaxed);
    c.events.retain(|_, (s, _)| *s != seq);
    let s = c.seqs.remove(&seq).unwrap();
    if s.invalidated {
        if !s.into_existing {
            st.destroy_graph(s.graph);
        }
        put(out, std::ptr::null_mut())?;
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    put(out, s.graph as *mut c_void)
}

fn cap_stream(t: Target, seq: u64, deps: Vec<u64>) -> CapStream {
    CapStream {
        seq,
        deps,
        ctx: ctx_key(t.ctx()),
        blocking: t.blocking(),
    }
}

/// Status (`CUstreamCaptureStatus`: NONE 0, ACTIVE 1), capture id, graph
/// and current dependencies of `h`'s capture. The dependency array stays
/// valid until the stream's next captured work, as in the driver.
unsafe fn info(
    h: *mut c_void,
    ptsz: bool,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const u64,
    count: *mut usize,
) -> R {
    drv()?;
    // SAFETY: the stream handle is the one our caller got from the CUDA caller, passed on under
    // this function's own contract; `Target::of` checks its magic.
    let t = unsafe { Target::of(h, ptsz)? };
    if status.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let st = graph::state();
    let c = &st.capture;
    let cs = key(t).and_then(|k| c.streams.get(&k));
    // CU_STREAM_CAPTURE_STATUS_NONE / ACTIVE / INVALIDATED.
    let st_code = cs.map_or(0, |cs| if c.seqs[&cs.seq].invalidated { 2 } else { 1 });
    put(status, st_code)?;
    let Some(cs) = cs else { return Ok(()) };
    put_opt(id, cs.seq);
    put_opt(graph, c.seqs[&cs.seq].graph as *mut c_void);
    put_opt(deps, cs.deps.as_ptr());
    put_opt(count, cs.deps.len());
    Ok(())
}

type P = *mut c_void;
type NodeList = *mut *const u64;

cuda_fn! {
    // SAFETY: `begin` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuStreamBeginCapture(h: P) { unsafe { begin(h, 0, false, None) } }
    // SAFETY: `begin` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuStreamBeginCapture_ptsz(h: P) { unsafe { begin(h, 0, true, None) } }
    // SAFETY: `begin` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuStreamBeginCapture_v2(h: P, mode: u32) { unsafe { begin(h, mode, false, None) } }
    // SAFETY: `begin` gets the pointers and handles our caller passed in, which the CUDA
    // ABI makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuStreamBeginCapture_v2_ptsz(h: P, mode: u32) { unsafe { begin(h, mode, true, None) } }

    fn cuStreamBeginCaptureToGraph(h: P, g: P, deps: *const P, _edges: *const c_void, n: usize, mode: u32) {
        let g = graph::graph_id(g)?;
        // SAFETY: `graph_deps` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let d = unsafe { graph_deps(deps, n) }?;
        // SAFETY: `begin` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { begin(h, mode, false, Some((g, d))) }
    }

    fn cuStreamBeginCaptureToGraph_ptsz(h: P, g: P, deps: *const P, _edges: *const c_void, n: usize, mode: u32) {
        let g = graph::graph_id(g)?;
        // SAFETY: `graph_deps` gets the pointers and handles our caller passed in, which
        // the CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        let d = unsafe { graph_deps(deps, n) }?;
        // SAFETY: `begin` gets the pointers and handles our caller passed in, which the
        // CUDA ABI makes valid for this call (or NULL, checked there); handles are ones
        // this driver handed out or are rejected by their magic.
        unsafe { begin(h, mode, true, Some((g, d))) }
    }

    // SAFETY: `end` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuStreamEndCapture(h: P, out: *mut P) { unsafe { end(h, out, false) } }
    // SAFETY: `end` gets the pointers and handles our caller passed in, which the CUDA ABI
    // makes valid for this call (or NULL, checked there); handles are ones this driver
    // handed out or are rejected by their magic.
    fn cuStreamEndCapture_ptsz(h: P, out: *mut P) { unsafe { end(h, out, true) } }

    fn cuStreamIsCapturing(h: P, status: *mut i32) {
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, false, status, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) }
    }

    fn cuStreamIsCapturing_ptsz(h: P, status: *mut i32) {
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, true, status, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) }
    }

    fn cuStreamGetCaptureInfo(h: P, status: *mut i32, id: *mut u64) {
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, false, status, id, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) }
    }

    fn cuStreamGetCaptureInfo_ptsz(h: P, status: *mut i32, id: *mut u64) {
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, true, status, id, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) }
    }

    fn cuStreamGetCaptureInfo_v2(h: P, status: *mut i32, id: *mut u64, g: *mut P, deps: NodeList, n: *mut usize) {
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, false, status, id, g, deps, n) }
    }

    fn cuStreamGetCaptureInfo_v2_ptsz(h: P, status: *mut i32, id: *mut u64, g: *mut P, deps: NodeList, n: *mut usize) {
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, true, status, id, g, deps, n) }
    }

    fn cuStreamGetCaptureInfo_v3(
        h: P, status: *mut i32, id: *mut u64, g: *mut P, deps: NodeList, edges: *mut *const c_void, n: *mut usize,
    ) {
        // Every captured edge is a default one: no edge data.
        put_opt(edges, std::ptr::null());
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, false, status, id, g, deps, n) }
    }

    fn cuStreamGetCaptureInfo_v3_ptsz(
        h: P, status: *mut i32, id: *mut u64, g: *mut P, deps: NodeList, edges: *mut *const c_void, n: *mut usize,
    ) {
        put_opt(edges, std::ptr::null());
        // SAFETY: `info` gets the pointers and handles our caller passed in, which the CUDA
        // ABI makes valid for this call (or NULL, checked there); handles are ones this
        // driver handed out or are rejected by their magic.
        unsafe { info(h, true, status, id, g, deps, n) }
    }

    fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) {
        let new = get(mode)?;
        if new > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(mode, capture_mode::exchange(new))?;
        Ok(())
    }
}

unsafe fn graph_deps(p: *const P, n: usize) -> R<Vec<u64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `p` is non-NULL (checked above) and, per the CUDA ABI, the caller's array of `n`
    // node handles, read only during this call.
    Ok(unsafe { std::slice::from_raw_parts(p, n) }
        .iter()
        .map(|&h| h as u64)
        .collect())
}
