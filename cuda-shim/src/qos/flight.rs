//! A latency process's streams with work not yet said done, per device of
//! its share: a synchronize or query of one stream makes the device idle
//! only once none of its other streams launched since their own (servers
//! run requests on several streams). A context synchronize clears the
//! device; an event's synchronize or query, the stream it was recorded on,
//! up to its record (a launch onto that stream after the record is not
//! done). Out of the launch path's way: only a latency process's
//! launches, records and synchronizes come here.

use super::Stream;
use std::sync::Mutex;

/// Streams tracked at most; past it a device is idle only through a
/// context synchronize (or its mark's deadline), never too early.
const MAX: usize = 64;

/// Events whose record is remembered at most; an event past them (or
/// recorded before the process registered) clears its whole device, as a
/// context synchronize does.
const MAX_EVENTS: usize = 256;

#[derive(Clone, Copy, PartialEq, Eq)]
struct Flight {
    dev: usize,
    /// The stream handle; `usize::MAX`: streams past [`MAX`].
    stream: usize,
    ptsz: bool,
    /// The process's launch count at its latest launch onto the stream.
    seq: u64,
}

impl Flight {
    fn on(&self, dev: usize, stream: usize, ptsz: bool) -> bool {
        (self.dev, self.stream, self.ptsz) == (dev, stream, ptsz)
    }
}

/// An event's latest record: the stream and the launch count then.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Record {
    pub event: usize,
    pub stream: Stream,
    pub ptsz: bool,
    pub seq: u64,
}

// SAFETY: the stream is a handle, never dereferenced here.
unsafe impl Send for Record {}

struct Table {
    flights: Vec<Flight>,
    events: Vec<Record>,
    /// Launches so far (a latency process's).
    seq: u64,
}

static FLIGHT: Mutex<Table> = Mutex::new(Table {
    flights: Vec::new(),
    events: Vec::new(),
    seq: 0,
});

fn table() -> std::sync::MutexGuard<'static, Table> {
    FLIGHT.lock().unwrap_or_else(|e| e.into_inner())
}

/// A launch onto `stream` of the share's device `dev`.
pub(super) fn launched(dev: usize, stream: Stream, ptsz: bool) {
    let mut t = table();
    t.seq += 1;
    let seq = t.seq;
    note(&mut t.flights, dev, stream as usize, ptsz, seq);
}

fn note(v: &mut Vec<Flight>, dev: usize, stream: usize, ptsz: bool, seq: u64) {
    if let Some(f) = v.iter_mut().find(|x| x.on(dev, stream, ptsz)) {
        f.seq = seq;
        return;
    }
    let f = Flight {
        dev,
        stream,
        ptsz,
        seq,
    };
    if v.len() < MAX {
        v.push(f);
    } else if let Some(o) = v.iter_mut().find(|x| x.on(dev, usize::MAX, false)) {
        o.seq = seq;
    } else {
        // Replaces one of the device's own, or any: a device with no
        // overflow entry may then idle early once, never hold for ever.
        let i = v.iter().position(|x| x.dev == dev).unwrap_or(0);
        v[i] = Flight {
            stream: usize::MAX,
            ptsz: false,
            ..f
        };
    }
}

/// `event` was recorded onto `stream`: what it will say done is the
/// stream's work launched so far. `captured`: recorded into a graph, not
/// onto the stream (forgotten: its synchronize clears the device).
pub(super) fn recorded(event: usize, stream: Stream, ptsz: bool, captured: bool) {
    let mut t = table();
    t.events.retain(|r| r.event != event);
    if captured {
        return;
    }
    if t.events.len() >= MAX_EVENTS {
        t.events.remove(0);
    }
    let seq = t.seq;
    t.events.push(Record {
        event,
        stream,
        ptsz,
        seq,
    });
}

/// The latest record of `event`, if remembered.
pub(super) fn record_of(event: usize) -> Option<Record> {
    table().events.iter().find(|r| r.event == event).copied()
}

/// An event recorded as `r` was synchronised or said done on device `dev`:
/// its stream's work up to the record is done. Is the device idle now?
pub(super) fn event_done(dev: usize, r: Record) -> bool {
    let mut t = table();
    let stream = r.stream as usize;
    t.flights
        .retain(|x| !(x.on(dev, stream, r.ptsz) && x.seq <= r.seq));
    !t.flights.iter().any(|x| x.dev == dev)
}

/// `stream` of device `dev` was synchronised or said done: is the device
/// idle now?
pub(super) fn stream_done(dev: usize, stream: Stream, ptsz: bool) -> bool {
    let mut t = table();
    t.flights.retain(|x| !x.on(dev, stream as usize, ptsz));
    !t.flights.iter().any(|x| x.dev == dev)
}

/// Device `dev`'s context was synchronised: every stream there is done.
pub(super) fn device_done(dev: usize) -> bool {
    table().flights.retain(|x| x.dev != dev);
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

        // Events: their stream, up to their record.
        launched(0, s(1), false);
        launched(0, s(2), false);
        recorded(50, s(1), false, false);
        let r = record_of(50).unwrap();
        assert_eq!((r.stream, r.ptsz), (s(1), false));
        assert!(!event_done(0, r), "stream 2 still runs");
        assert!(stream_done(0, s(2), false), "stream 1 was said done");
        launched(0, s(1), false);
        recorded(51, s(1), false, false);
        launched(0, s(1), false);
        assert!(
            !event_done(0, record_of(51).unwrap()),
            "a launch after the record"
        );
        recorded(51, s(1), false, false);
        assert!(
            event_done(0, record_of(51).unwrap()),
            "recorded again, after it"
        );
        // Recorded into a graph: forgotten.
        recorded(51, s(1), false, true);
        assert_eq!(record_of(51), None);
        // A bounded table: the oldest record goes first.
        for e in 1000..1000 + MAX_EVENTS {
            recorded(e, s(1), false, false);
        }
        assert_eq!(record_of(50), None);
        assert!(record_of(1000 + MAX_EVENTS - 1).is_some());
    }
}
