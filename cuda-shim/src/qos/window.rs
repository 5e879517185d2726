//! A batch process's bound on the work it keeps queued per stream while a
//! latency process shares its GPU: about [`QUEUE_NS`] of device time, not
//! a number of launches. A latency request arriving at any moment waits
//! behind that queue; a queue of one launch (synchronise before each)
//! leaves the device idle for the batch process's wake-up and next launch
//! after every kernel, most of a 10 µs kernel's time.
//!
//! How: an event is recorded on the stream before each launch, so an
//! event that completed says every launch before it ended, and two
//! consecutive completed events bracket one launch's device time
//! (`cuEventElapsedTime`; a gap on the device counts as the kernel's, so
//! the estimate errs long). Launches allowed in flight: [`QUEUE_NS`] over
//! the estimate, at least one, at most [`MAX_DEPTH`]; a launch waits for
//! the oldest event until the queue is under that. An estimate at or above
//! [`QUEUE_NS`] (long kernels, or none measured yet) is one launch in
//! flight: the caller synchronises the stream.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::events::{create, destroy, elapsed_ns, query, record, sync};
use cuda_abi::CUDA_SUCCESS;

/// Device time a batch stream may keep queued beside a latency process.
pub const QUEUE_NS: u64 = 200_000;
/// Launches in flight per stream, whatever the estimate.
pub const MAX_DEPTH: usize = 32;
/// Streams remembered before idle ones are forgotten (a process that makes
/// and destroys streams by the thousand).
const MAX_STREAMS: usize = 256;
/// Per-thread default stream handle (`CU_STREAM_PER_THREAD`).
const PER_THREAD: usize = 0x2;

use crate::events::{Event, Stream};

#[derive(Default)]
struct Window {
    /// Events recorded before launches, oldest first, not seen complete.
    pending: VecDeque<usize>,
    /// The newest event seen complete (the start of the next sample).
    done: Option<usize>,
    free: Vec<usize>,
    /// Estimated device time of one launch, ns (0: none measured).
    estimate_ns: u64,
}

/// Streams by handle. Held only between driver calls that do not wait.
static WINDOWS: Mutex<Option<HashMap<usize, Window>>> = Mutex::new(None);

/// Before a batch launch onto `stream`: waits until the stream's queue is
/// under its bound and records this launch's event. `false`: the bound is
/// one launch (or events are unusable here): synchronise the stream.
pub fn before_launch(stream: Stream, ptsz: bool) -> bool {
    let (key, stream) = window_of(stream, ptsz);
    loop {
        let wait_on = {
            let mut g = WINDOWS.lock().unwrap_or_else(|e| e.into_inner());
            let map = g.get_or_insert_with(HashMap::new);
            if map.len() >= MAX_STREAMS && !map.contains_key(&key) {
                forget_idle(map);
            }
            let w = map.entry(key).or_default();
            w.retire();
            let depth = w.depth();
            if depth <= 1 {
                let _ = w.record(stream, ptsz);
                return false;
            }
            if w.pending.len() + 1 < depth {
                return w.record(stream, ptsz);
            }
            w.pending[0]
        };
        // Outside the lock: other streams' launches go on meanwhile.
        if sync(wait_on as Event) != CUDA_SUCCESS {
            return false;
        }
    }
}

/// The window a launch onto `stream` belongs to, and the handle to record
/// its events on. A per-thread default stream (`CU_STREAM_PER_THREAD`, or
/// the null stream from a `_ptsz` entry point) is one stream per thread:
/// keyed by the thread, with low bits no stream pointer has, so one
/// thread never waits on another's queue nor brackets its launches with
/// the other's events.
fn window_of(stream: Stream, ptsz: bool) -> (usize, Stream) {
    if (stream.is_null() && ptsz) || stream as usize == PER_THREAD {
        thread_local!(static THREAD: usize = {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        });
        let key = THREAD.with(|t| (t << 3) | PER_THREAD);
        return (key, PER_THREAD as Stream);
    }
    (stream as usize, stream)
}

/// Drops the windows with nothing pending, destroying their events.
#[cold]
fn forget_idle(map: &mut HashMap<usize, Window>) {
    map.retain(|_, w| {
        w.retire();
        if !w.pending.is_empty() {
            return true;
        }
        for ev in w.free.drain(..).chain(w.done.take()) {
            destroy(ev as Event);
        }
        false
    });
}

impl Window {
    /// Launches allowed in flight: 1 with no estimate yet, or one at or
    /// above the bound.
    fn depth(&self) -> usize {
        QUEUE_NS
            .checked_div(self.estimate_ns)
            .map_or(1, |d| (d as usize).clamp(1, MAX_DEPTH))
    }

    /// Takes completed events off the front, sampling each launch they
    /// bracket.
    fn retire(&mut self) {
        while let Some(&ev) = self.pending.front() {
            if query(ev as Event) != CUDA_SUCCESS {
                break;
            }
            self.pending.pop_front();
            if let Some(prev) = self.done.replace(ev) {
                if let Some(ns) = elapsed_ns(prev as Event, ev as Event) {
                    self.sample(ns);
                }
                self.free.push(prev);
            }
        }
    }

    fn sample(&mut self, ns: u64) {
        self.estimate_ns = if self.estimate_ns == 0 {
            ns
        } else {
            (self.estimate_ns * 7 + ns) / 8
        };
    }

    /// Records an event on the stream ahead of the launch; `false` if the
    /// driver would not (another context's stream, a destroyed one).
    fn record(&mut self, stream: Stream, ptsz: bool) -> bool {
        let ev = match self.free.pop() {
            Some(e) => e,
            None => match create() {
                Some(e) => e,
                None => return false,
            },
        };
        if record(ev as Event, stream, ptsz) != CUDA_SUCCESS {
            self.free.push(ev);
            return false;
        }
        self.pending.push_back(ev);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_thread_default_streams_get_a_window_per_thread() {
        let null = std::ptr::null_mut();
        let here = window_of(null, true);
        assert_eq!(
            here,
            window_of(PER_THREAD as Stream, false),
            "same stream, same window"
        );
        assert_eq!(
            here.1 as usize, PER_THREAD,
            "events go on the per-thread stream"
        );
        let there = std::thread::spawn(|| window_of(std::ptr::null_mut(), true).0)
            .join()
            .unwrap();
        assert_ne!(here.0, there, "another thread's stream, another window");
        // The legacy stream is one for the whole process.
        assert_eq!(window_of(null, false), (0, null));
        let s = 0x7f00_1234_5000usize as Stream;
        assert_eq!(window_of(s, true), (s as usize, s));
        assert_ne!(here.0 & 0x7, 0, "never a stream pointer's key");
    }
}
