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
    /// The MIG (GPU instance, compute instance) it names, if any.
    pub instance: Option<(u32, u32)>,
}

fn encode(instance: Option<(u32, u32)>) -> u64 {
    instance.map_or(0, |(gi, ci)| ((gi as u64 + 1) << 32) | (ci as u64 + 1))
}

fn decode(w: u64) -> Option<(u32, u32)> {
    (w != 0).then(|| {
        (
            ((w >> 32) as u32).wrapping_sub(1),
            (w as u32).wrapping_sub(1),
        )
    })
}

impl SharedState {
    /// Records an Xid error on `gpu`; returns its sequence number.
    pub fn inject_xid(&self, gpu: usize, code: u32) -> u64 {
        self.inject_xid_in(gpu, code, None)
    }

    /// Records an Xid error on `gpu` naming MIG `instance` (GPU instance,
    /// compute instance), as the driver reports errors inside one.
    pub fn inject_xid_in(&self, gpu: usize, code: u32, instance: Option<(u32, u32)>) -> u64 {
        assert!(gpu < self.gpu_count());
        let h = self.header();
        let seq = h.xid_head.fetch_add(1, AcqRel) + 1;
        let e = &h.xids[(seq as usize) % XID_RING];
        e.seq.store(0, Release);
        e.gpu.store(gpu as u32, Release);
        e.code.store(code, Release);
        e.time_ns.store(now_ns(), Release);
        e.instance.store(encode(instance), Release);
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
                    instance: decode(e.instance.load(Acquire)),
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
        s.inject_xid_in(0, 94, Some((0, 0)));
        let ev = s.xid_events_since(c);
        assert_eq!(
            ev.iter().map(|e| e.code).collect::<Vec<_>>(),
            vec![79, 48, 94]
        );
        assert_eq!(ev[0].instance, None);
        assert_eq!(ev[2].instance, Some((0, 0)), "GI 0 / CI 0 is not 'none'");
        assert!(s.xid_events_since(s.xid_cursor()).is_empty());
    }
}
