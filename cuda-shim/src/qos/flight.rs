//! A latency process's streams with work not yet said done, per device of
//! its share: a synchronize or query of one stream makes the device idle
//! only once none of its other streams launched since their own (servers
//! run requests on several streams). A context synchronize clears the
//! device. Out of the launch path's way: only a latency process's
//! launches and synchronizes come here.

use super::Stream;
use std::sync::Mutex;

/// Streams tracked at most; past it a device is idle only through a
/// context synchronize (or its mark's deadline), never too early.
const MAX: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
struct Flight {
    dev: usize,
    /// The stream handle; `usize::MAX`: streams past [`MAX`].
    stream: usize,
    ptsz: bool,
}

static FLIGHT: Mutex<Vec<Flight>> = Mutex::new(Vec::new());

fn flights() -> std::sync::MutexGuard<'static, Vec<Flight>> {
    FLIGHT.lock().unwrap_or_else(|e| e.into_inner())
}

/// A launch onto `stream` of the share's device `dev`.
pub(super) fn launched(dev: usize, stream: Stream, ptsz: bool) {
    note(&mut flights(), dev, stream as usize, ptsz);
}

fn note(v: &mut Vec<Flight>, dev: usize, stream: usize, ptsz: bool) {
    let f = Flight { dev, stream, ptsz };
    if v.contains(&f) {
        return;
    }
    let over = Flight {
        stream: usize::MAX,
        ptsz: false,
        ..f
    };
    if v.len() < MAX {
        v.push(f);
    } else if !v.contains(&over) {
        // Replaces one of the device's own, or any: a device with no
        // overflow entry may then idle early once, never hold for ever.
        let i = v.iter().position(|x| x.dev == dev).unwrap_or(0);
        v[i] = over;
    }
}

/// `stream` of device `dev` was synchronised or said done: is the device
/// idle now?
pub(super) fn stream_done(dev: usize, stream: Stream, ptsz: bool) -> bool {
    let mut v = flights();
    v.retain(|x| !(x.dev == dev && x.stream == stream as usize && x.ptsz == ptsz));
    !v.iter().any(|x| x.dev == dev)
}

/// Device `dev`'s context was synchronised: every stream there is done.
pub(super) fn device_done(dev: usize) -> bool {
    flights().retain(|x| x.dev != dev);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: usize) -> Stream {
        n as Stream
    }

    // One test: the table is the process's.
    #[test]
    fn a_device_is_idle_once_every_stream_launched_onto_is_done() {
        launched(0, s(1), false);
        launched(0, s(2), false);
        launched(1, s(7), false);
        assert!(!stream_done(0, s(1), false), "stream 2 still runs");
        assert!(
            !stream_done(0, s(1), true),
            "a per-thread stream is another"
        );
        assert!(stream_done(0, s(2), false));
        assert!(!stream_done(1, s(8), false), "gpu-1's stream 7 runs");
        launched(0, s(3), false);
        assert!(device_done(0));
        assert!(
            stream_done(0, s(9), false),
            "the context synchronize cleared it"
        );
        // Past MAX streams a device idles only through its context.
        for n in 100..100 + MAX {
            launched(0, s(n), false);
        }
        for n in 100..100 + MAX {
            stream_done(0, s(n), false);
        }
        assert!(
            !stream_done(0, s(100), false),
            "streams past the table: only a context synchronize says done"
        );
        assert!(device_done(0));
        assert!(!stream_done(1, s(1), false), "gpu-1 untouched");
        assert!(stream_done(1, s(7), false));
    }
}
