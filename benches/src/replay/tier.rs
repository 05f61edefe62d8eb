//! One DRAM tier as the daemon drives its eviction policy, modelled over a set of slots, for
//! the offline simulation ([`super::offline::simulate`]) and the replay's model
//! ([`super::model`]).
//!
//! The order of the policy calls is the daemon's (`engine/core/src/dram/state.rs`):
//!
//! ```text
//!  get(keys)      the held keys leased as one batch: each touched, hint = its place among
//!                 the held keys (store/prefix.rs leases what its plan found in DRAM)
//!  put(keys)      in ops of PUT_KEYS keys (the replay's engines offload so):
//!                   reserve: each key not held takes a free slot or the policy's victim
//!                            (victims are chosen before any key of the op enters the policy)
//!                   commit:  each reserved key inserted in order, hint = its place in the op
//! ```
//!
//! Slots are numbered as the daemon's first slab numbers them, taken from a free list in the
//! same order, so that ties the policy breaks by slot id break the same way.

use std::collections::HashMap;

use kvnode_engine::policy::{BatchHint, EvictionPolicy, Policy, PolicyKind, SlotId};

/// Keys per put: the replay's engines offload a request's computed pages in puts of this many
/// keys (`engine.rs`), and each put is one reserve-then-commit in the daemon.
pub const PUT_KEYS: usize = 64;

/// A modelled DRAM tier: `capacity` slots and the daemon's policy.
#[derive(Debug)]
pub struct Tier {
    policy: Policy,
    slot: HashMap<u64, SlotId>,
    block_of: HashMap<SlotId, u64>,
    free: Vec<SlotId>,
}

impl Tier {
    /// An empty tier of `capacity` slots run by `kind`.
    pub fn new(kind: PolicyKind, capacity: usize) -> Self {
        Self {
            policy: Policy::new(kind),
            slot: HashMap::new(),
            block_of: HashMap::new(),
            free: (0..capacity as SlotId).rev().collect(),
        }
    }

    /// Whether block `b` is resident.
    pub fn holds(&self, b: u64) -> bool {
        self.slot.contains_key(&b)
    }

    /// Reads `b` if held; `hint` is its place in the daemon's batch.
    pub fn touch(&mut self, b: u64, hint: BatchHint) {
        if let Some(&s) = self.slot.get(&b) {
            self.policy.touch(s, hint);
        }
    }

    /// A get of `blocks`: the store leases the blocks its plan found in DRAM as one batch
    /// (`store/prefix.rs`, one window without NVMe), so each held block is touched at its place
    /// among the held ones.
    pub fn lease(&mut self, blocks: &[u64]) {
        let held: Vec<u64> = blocks.iter().copied().filter(|&b| self.holds(b)).collect();
        for (i, &b) in held.iter().enumerate() {
            self.touch(b, BatchHint::at(i, held.len()));
        }
    }

    /// One put op of `blocks`: reserve a slot for each block not held, then commit them in
    /// order. `evicted` is told each victim's block. Returns, per block, whether it was stored.
    pub fn put_op(&mut self, blocks: &[u64], mut evicted: impl FnMut(u64)) -> Vec<bool> {
        let mut reserved: Vec<Option<SlotId>> = Vec::with_capacity(blocks.len());
        for &b in blocks {
            if self.holds(b) {
                reserved.push(None);
                continue;
            }
            let s = match self.free.pop() {
                Some(s) => Some(s),
                None => self.policy.victim(&mut |_| true).inspect(|v| {
                    let old = self.block_of.remove(v).expect("a victim holds a block");
                    self.slot.remove(&old);
                    evicted(old);
                }),
            };
            reserved.push(s);
        }
        let n = blocks.len();
        blocks
            .iter()
            .zip(reserved)
            .enumerate()
            .map(|(i, (&b, s))| {
                let Some(s) = s else { return false };
                if self.holds(b) {
                    // The key came twice in the op: the second commit finds the first
                    // (`Duplicate`) and its slot goes back to the free list.
                    self.free.push(s);
                    return false;
                }
                self.policy.insert(s, b, BatchHint::at(i, n));
                self.slot.insert(b, s);
                self.block_of.insert(s, b);
                true
            })
            .collect()
    }

    /// A put of `blocks` as the replay's engines send it: ops of [`PUT_KEYS`] keys. Returns how
    /// many blocks were stored.
    pub fn put(&mut self, blocks: &[u64], mut evicted: impl FnMut(u64)) -> u64 {
        blocks
            .chunks(PUT_KEYS)
            .map(|op| {
                let stored = self.put_op(op, &mut evicted);
                stored.iter().filter(|&&s| s).count() as u64
            })
            .sum()
    }
}
