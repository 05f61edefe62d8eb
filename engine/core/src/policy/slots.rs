//! A per-slot table for the policies: one value per slot id, stored flat by slab and index
//! (slot ids are `slab << 32 | index`, dense within a slab), so a tracked block costs the
//! value alone, not a hash-map entry (key, value, control byte and spare capacity).
//!
//! The table grows to the highest index seen in each slab it was used in; a slot not
//! tracked holds the table's `vacant` value.

use super::SlotId;

/// Values by slot id.
#[derive(Debug)]
pub struct SlotTable<T> {
    slabs: Vec<Vec<T>>,
    vacant: T,
    len: usize,
}

impl<T: Copy + PartialEq> SlotTable<T> {
    /// An empty table; `vacant` marks an untracked slot (never a value inserted).
    pub fn new(vacant: T) -> Self {
        Self {
            slabs: Vec::new(),
            vacant,
            len: 0,
        }
    }

    fn parts(slot: SlotId) -> (usize, usize) {
        ((slot >> 32) as usize, (slot & 0xFFFF_FFFF) as usize)
    }

    /// The value of `slot`, if tracked.
    pub fn get(&self, slot: SlotId) -> Option<T> {
        let (slab, idx) = Self::parts(slot);
        let v = *self.slabs.get(slab)?.get(idx)?;
        (v != self.vacant).then_some(v)
    }

    /// The value of `slot`, to change, if tracked.
    pub fn get_mut(&mut self, slot: SlotId) -> Option<&mut T> {
        let (slab, idx) = Self::parts(slot);
        let vacant = self.vacant;
        self.slabs
            .get_mut(slab)?
            .get_mut(idx)
            .filter(|v| **v != vacant)
    }

    /// Tracks `slot` with `v`; returns its previous value.
    pub fn insert(&mut self, slot: SlotId, v: T) -> Option<T> {
        debug_assert!(v != self.vacant, "inserting the vacant value");
        let (slab, idx) = Self::parts(slot);
        if self.slabs.len() <= slab {
            self.slabs.resize_with(slab + 1, Vec::new);
        }
        let row = &mut self.slabs[slab];
        if row.len() <= idx {
            row.resize(idx + 1, self.vacant);
        }
        let old = std::mem::replace(&mut row[idx], v);
        if old == self.vacant {
            self.len += 1;
            None
        } else {
            Some(old)
        }
    }

    /// Forgets `slot`; returns its value if it was tracked.
    pub fn remove(&mut self, slot: SlotId) -> Option<T> {
        let (slab, idx) = Self::parts(slot);
        let vacant = self.vacant;
        let cell = self.slabs.get_mut(slab)?.get_mut(idx)?;
        if *cell == vacant {
            return None;
        }
        self.len -= 1;
        Some(std::mem::replace(cell, vacant))
    }

    /// Slots tracked.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is tracked.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::SlotTable;

    #[test]
    fn a_slot_table_tracks_what_a_map_would() {
        let mut t = SlotTable::new(u64::MAX);
        let mut m = std::collections::HashMap::new();
        let ids = [0u64, 5, (3 << 32) | 7, (1 << 32), 5, (3 << 32) | 7, 9];
        for (n, &id) in ids.iter().enumerate() {
            assert_eq!(t.insert(id, n as u64), m.insert(id, n as u64));
            assert_eq!(t.len(), m.len());
        }
        for id in [5u64, 4, (3 << 32) | 7, 1 << 40] {
            assert_eq!(t.remove(id), m.remove(&id));
            assert_eq!(t.get(id), None);
        }
        for (&id, &v) in &m {
            assert_eq!(t.get(id), Some(v));
            *t.get_mut(id).unwrap() += 1;
            assert_eq!(t.get(id), Some(v + 1));
        }
        assert_eq!(t.len(), m.len());
    }
}
