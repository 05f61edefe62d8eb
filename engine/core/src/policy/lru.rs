//! Least-recently-used, as an index-linked list keyed by slot id (O(1) per operation); the
//! links sit in a flat per-slot table (16 bytes a block, slots.rs).

use super::slots::SlotTable;
use super::{BatchHint, EvictionPolicy, SlotId};

const NIL: SlotId = SlotId::MAX;
/// The links of an untracked slot (no slot has this id, and no link points to it).
const VACANT: (SlotId, SlotId) = (SlotId::MAX - 1, SlotId::MAX - 1);

/// LRU list: head is most recent, tail is the next victim.
#[derive(Debug)]
pub struct Lru {
    links: SlotTable<(SlotId, SlotId)>,
    head: SlotId,
    tail: SlotId,
}

impl Default for Lru {
    fn default() -> Self {
        Self {
            links: SlotTable::new(VACANT),
            head: NIL,
            tail: NIL,
        }
    }
}

impl Lru {
    fn unlink(&mut self, s: SlotId) -> bool {
        let Some((prev, next)) = self.links.remove(s) else {
            return false;
        };
        if prev == NIL {
            self.head = next;
        } else if let Some(l) = self.links.get_mut(prev) {
            l.1 = next;
        }
        if next == NIL {
            self.tail = prev;
        } else if let Some(l) = self.links.get_mut(next) {
            l.0 = prev;
        }
        true
    }

    fn push_front(&mut self, s: SlotId) {
        let old = self.head;
        self.links.insert(s, (NIL, old));
        if old == NIL {
            self.tail = s;
        } else if let Some(l) = self.links.get_mut(old) {
            l.0 = s;
        }
        self.head = s;
    }
}

impl EvictionPolicy for Lru {
    fn insert(&mut self, slot: SlotId, _key_hash: u64, _hint: BatchHint) {
        self.unlink(slot);
        self.push_front(slot);
    }

    fn touch(&mut self, slot: SlotId, _hint: BatchHint) {
        if self.head != slot && self.unlink(slot) {
            self.push_front(slot);
        }
    }

    fn remove(&mut self, slot: SlotId) {
        self.unlink(slot);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId> {
        let mut s = self.tail;
        while s != NIL {
            let prev = self.links.get(s).expect("a listed slot is tracked").0;
            if evictable(s) {
                self.unlink(s);
                return Some(s);
            }
            s = prev;
        }
        None
    }

    fn len(&self) -> usize {
        self.links.len()
    }
}
