//! The process's own allocations: what each free gives back to the ledger,
//! and the context each was made in (a destroyed or reset context frees
//! them all).

use std::collections::HashMap;
use std::sync::Mutex;

/// What kind of handle a key is (they live in different namespaces).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A device pointer (cuMemAlloc*, cuMemAllocManaged, stream-ordered).
    Ptr,
    /// A CUarray.
    Array,
    /// A CUmipmappedArray.
    Mipmapped,
    /// A CUmemGenericAllocationHandle (cuMemCreate).
    Generic,
}

const SHARDS: usize = 16;

/// One allocation: its bytes, its context (`CUcontext` address, 0 when
/// none was current) and the GPU of the share it lives on (the position of
/// its ledger, `crate::devices`; 0 in a one-GPU container).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub bytes: u64,
    pub ctx: u64,
    pub gpu: usize,
}

/// A multiply-rotate hasher (the Fx hash's step): keys are the driver's
/// handles, in this process only, so SipHash's resistance to chosen keys
/// buys nothing, and its ~15 ns per operation were a tenth of what the
/// interposer adds to an allocation and its free.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    #[inline]
    fn write_isize(&mut self, x: isize) {
        self.write_u64(x as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type Shard = HashMap<(Kind, u64), Entry, std::hash::BuildHasherDefault<KeyHasher>>;

/// Sharded so that threads allocating at once rarely contend.
pub struct AllocTable {
    shards: [Mutex<Shard>; SHARDS],
}

impl Default for AllocTable {
    fn default() -> Self {
        AllocTable {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::default())),
        }
    }
}

impl AllocTable {
    fn shard(&self, key: u64) -> std::sync::MutexGuard<'_, Shard> {
        // Device pointers are aligned: mix the middle bits.
        let h = (key >> 9) ^ (key >> 21) ^ key;
        self.shards[(h as usize) % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Records an allocation; returns what the table held under the same
    /// key (the driver reused it: the old one is gone).
    pub fn insert(&self, kind: Kind, key: u64, e: Entry) -> Option<Entry> {
        self.shard(key).insert((kind, key), e)
    }

    pub fn remove(&self, kind: Kind, key: u64) -> Option<Entry> {
        self.shard(key).remove(&(kind, key))
    }

    pub fn get(&self, kind: Kind, key: u64) -> Option<Entry> {
        self.shard(key).get(&(kind, key)).copied()
    }

    /// Removes every allocation of context `ctx`; returns (kind, key, entry).
    pub fn take_ctx(&self, ctx: u64) -> Vec<(Kind, u64, Entry)> {
        let mut out = Vec::new();
        for s in &self.shards {
            let mut m = s.lock().unwrap_or_else(|e| e.into_inner());
            m.retain(|&(kind, key), e| {
                let mine = e.ctx == ctx;
                if mine {
                    out.push((kind, key, *e));
                }
                !mine
            });
        }
        out
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_separate() {
        let t = AllocTable::default();
        let e = |bytes, ctx| Entry { bytes, ctx, gpu: 0 };
        t.insert(Kind::Ptr, 0x1000, e(10, 1));
        t.insert(Kind::Array, 0x1000, e(20, 2));
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(Kind::Ptr, 0x1000), Some(e(10, 1)));
        assert_eq!(t.remove(Kind::Ptr, 0x1000), None);
        assert_eq!(t.remove(Kind::Array, 0x1000), Some(e(20, 2)));
        assert!(t.is_empty());
        assert_eq!(t.insert(Kind::Ptr, 0x2000, e(5, 1)), None);
        assert_eq!(t.insert(Kind::Ptr, 0x2000, e(6, 1)), Some(e(5, 1)), "reuse");
        t.insert(Kind::Ptr, 0x3000, e(7, 2));
        let gone = t.take_ctx(1);
        assert_eq!(gone, vec![(Kind::Ptr, 0x2000, e(6, 1))]);
        assert_eq!(t.len(), 1);
    }
}
