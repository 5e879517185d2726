//! Injected Xid events: a ring in the header, read by cursor.

use super::{SharedState, XID_RING, now_ns};
use std::sync::atomic::Ordering::*;

/// An injected Xid event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidEvent {
    pub seq: u64,
    pub gpu: u32,
    pub code: u32,
    pub time_ns: u64,
}

impl SharedState {
    /// Records an Xid error on `gpu`; returns its sequence number.
    pub fn inject_xid(&self, gpu: usize, code: u32) -> u64 {
        assert!(gpu < self.gpu_count());
        let h = self.header();
        let seq = h.xid_head.fetch_add(1, AcqRel) + 1;
        let e = &h.xids[(seq as usize) % XID_RING];
        e.seq.store(0, Release);
        e.gpu.store(gpu as u32, Release);
        e.code.store(code, Release);
        e.time_ns.store(now_ns(), Release);
        e.seq.store(seq, Release);
        seq
    }

    /// Sequence number of the newest Xid event (0 if none).
    pub fn xid_cursor(&self) -> u64 {
        self.header().xid_head.load(Acquire)
    }

    /// Xid events newer than `cursor`, oldest first.
    pub fn xid_events_since(&self, cursor: u64) -> Vec<XidEvent> {
        let h = self.header();
        let head = h.xid_head.load(Acquire);
        let first = cursor.max(head.saturating_sub(XID_RING as u64 - 1)) + 1;
        (first..=head)
            .filter_map(|seq| {
                let e = &h.xids[(seq as usize) % XID_RING];
                let ev = XidEvent {
                    seq,
                    gpu: e.gpu.load(Acquire),
                    code: e.code.load(Acquire),
                    time_ns: e.time_ns.load(Acquire),
                };
                (e.seq.load(Acquire) == seq).then_some(ev)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::state::SharedState;
    use crate::state::tests::installed;

    #[test]
    fn xid_events_in_order() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let c = s.xid_cursor();
        s.inject_xid(0, 79);
        s.inject_xid(0, 48);
        let ev = s.xid_events_since(c);
        assert_eq!(ev.iter().map(|e| e.code).collect::<Vec<_>>(), vec![79, 48]);
        assert!(s.xid_events_since(s.xid_cursor()).is_empty());
    }
}
