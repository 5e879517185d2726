//! The process's own allocations: what each free gives back to the ledger.

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

/// Sharded so that threads allocating at once rarely contend.
pub struct AllocTable {
    shards: [Mutex<HashMap<(Kind, u64), u64>>; SHARDS],
}

impl Default for AllocTable {
    fn default() -> Self {
        AllocTable {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
        }
    }
}

impl AllocTable {
    fn shard(&self, key: u64) -> std::sync::MutexGuard<'_, HashMap<(Kind, u64), u64>> {
        // Device pointers are aligned: mix the middle bits.
        let h = (key >> 9) ^ (key >> 21) ^ key;
        self.shards[(h as usize) % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, kind: Kind, key: u64, bytes: u64) {
        self.shard(key).insert((kind, key), bytes);
    }

    pub fn remove(&self, kind: Kind, key: u64) -> Option<u64> {
        self.shard(key).remove(&(kind, key))
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
        t.insert(Kind::Ptr, 0x1000, 10);
        t.insert(Kind::Array, 0x1000, 20);
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(Kind::Ptr, 0x1000), Some(10));
        assert_eq!(t.remove(Kind::Ptr, 0x1000), None);
        assert_eq!(t.remove(Kind::Array, 0x1000), Some(20));
        assert!(t.is_empty());
    }
}
