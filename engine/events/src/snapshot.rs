//! Residency snapshots: what a (re)connecting subscriber gets instead of a replay hole.
//!
//! The crate knows nothing of residencies: the engine registers a [`SnapshotSource`] on its
//! [`EventSink`](crate::EventSink) (a weak reference, so no ownership loop). The source copies
//! every block it has announced and, without letting a store or removal in between, queues a
//! [`Marker`] behind the events those blocks were announced by. The publisher thread seals
//! its open batch when the marker comes out of the queue and resolves the marker with the
//! seq of the next batch, `S`: the copy is exactly what the wire said up to batch `S - 1`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::oneshot;

use crate::wire::{BlockStored, Medium};

/// A block as it was announced, able to announce itself again.
pub trait Announced: Send + Sync + fmt::Debug {
    /// Router hash of the block.
    fn hash(&self) -> u64;
    /// Router hash of its parent, `None` for a chain root.
    fn parent(&self) -> Option<u64>;
    /// The store that announced it in `medium` (one block).
    fn stored(&self, medium: Medium) -> BlockStored;
}

/// One announced (medium, block).
pub type Entry = (Medium, Arc<dyn Announced>);

/// Where snapshots come from (the engine's announcer).
pub trait SnapshotSource: Send + Sync {
    /// Copies every announced (medium, block) and queues `marker` so that it follows
    /// every event published before the copy and precedes every later one. Returns the
    /// marker when it could not be queued (the queue is full or closed).
    fn snapshot(&self, marker: Marker) -> Result<Vec<Entry>, Marker>;
}

/// Resolved by the publisher thread with the seq of the first batch after it.
#[derive(Debug)]
pub struct Marker(oneshot::Sender<u64>);

impl Marker {
    pub(crate) fn new() -> (Self, oneshot::Receiver<u64>) {
        let (tx, rx) = oneshot::channel();
        (Self(tx), rx)
    }

    pub(crate) fn resolve(self, seq: u64) {
        // The requester may have given up (shutdown); nothing to tell then.
        let _ = self.0.send(seq);
    }
}

/// The registered source, shared by the sinks (which register it) and the replay loop.
#[derive(Default)]
pub(crate) struct SourceSlot(Mutex<Option<Weak<dyn SnapshotSource>>>);

impl fmt::Debug for SourceSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SourceSlot")
    }
}

impl SourceSlot {
    pub(crate) fn set(&self, source: Weak<dyn SnapshotSource>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(source);
    }

    pub(crate) fn get(&self) -> Option<Arc<dyn SnapshotSource>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()?
            .upgrade()
    }
}

/// Orders `entries` so that every block comes after its parent (when the parent is in the
/// snapshot, in any medium), `CPU_PINNED` before `DISK` at equal depth. Linear in the
/// entries (each chain is walked once, depths memoized).
pub fn parents_first(mut entries: Vec<Entry>) -> Vec<Entry> {
    let parent: HashMap<u64, Option<u64>> = entries
        .iter()
        .map(|(_, b)| (b.hash(), b.parent()))
        .collect();
    let mut depth: HashMap<u64, u32> = HashMap::with_capacity(parent.len());
    let mut path = Vec::new();
    for (_, b) in &entries {
        let mut at = b.hash();
        // Walk up to a root or a block outside the snapshot (depth 0) or below a block of
        // known depth (bounded by the map's size, so even a malformed cycle ends).
        let base = loop {
            if let Some(&d) = depth.get(&at) {
                break d + 1;
            }
            path.push(at);
            match parent.get(&at).copied().flatten() {
                Some(p) if parent.contains_key(&p) && path.len() <= parent.len() => at = p,
                _ => break 0,
            }
        };
        for (i, h) in path.drain(..).rev().enumerate() {
            depth.insert(h, base + i as u32);
        }
    }
    let rank = |m: Medium| u8::from(m == Medium::Disk);
    entries.sort_by_key(|(m, b)| (depth.get(&b.hash()).copied().unwrap_or(0), rank(*m)));
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct B(u64, Option<u64>);

    impl Announced for B {
        fn hash(&self) -> u64 {
            self.0
        }
        fn parent(&self) -> Option<u64> {
            self.1
        }
        fn stored(&self, medium: Medium) -> BlockStored {
            BlockStored::new(medium, 1)
                .with_parent(self.1)
                .block(self.0, &[0])
        }
    }

    fn e(m: Medium, h: u64, p: Option<u64>) -> Entry {
        (m, Arc::new(B(h, p)))
    }

    #[test]
    fn children_follow_their_parents_in_any_medium() {
        let got = parents_first(vec![
            e(Medium::Disk, 4, Some(3)),
            e(Medium::CpuPinned, 3, Some(2)),
            e(Medium::CpuPinned, 9, Some(100)), // parent not in the snapshot: a root here
            e(Medium::Disk, 2, Some(1)),
            e(Medium::CpuPinned, 1, None),
            e(Medium::Disk, 1, None),
        ]);
        let pos = |m: Medium, h: u64| {
            got.iter()
                .position(|(gm, b)| *gm == m && b.hash() == h)
                .unwrap()
        };
        assert!(pos(Medium::CpuPinned, 1) < pos(Medium::Disk, 2));
        assert!(pos(Medium::Disk, 1) < pos(Medium::Disk, 2));
        assert!(pos(Medium::Disk, 2) < pos(Medium::CpuPinned, 3));
        assert!(pos(Medium::CpuPinned, 3) < pos(Medium::Disk, 4));
        assert_eq!(got.len(), 6);
    }

    #[test]
    fn a_cycle_does_not_hang() {
        let got = parents_first(vec![
            e(Medium::CpuPinned, 1, Some(2)),
            e(Medium::CpuPinned, 2, Some(1)),
        ]);
        assert_eq!(got.len(), 2);
    }
}
