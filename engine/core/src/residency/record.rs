//! Unit tests of the event order around a clear, with a recorder in place of the sink that
//! can stall one call (as a preempted thread would) while another thread clears.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvnode_events::{BlockStored, Medium};

use super::{Announcer, Out, Residency, RouterMeta};

/// One recorded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ev {
    Stored(u64),
    Removed(u64),
    Cleared,
}

/// Where a call stalls, and whom it tells.
#[derive(Debug)]
enum Stall {
    /// Right after recording the store (where the old code then read the epoch).
    AfterStore(mpsc::Sender<()>),
    /// Right before recording a removal (after the old code compared the epoch).
    BeforeRemove(mpsc::Sender<()>),
}

/// Records events in publication order.
#[derive(Debug, Default)]
pub(super) struct Recorder {
    log: Mutex<Vec<Ev>>,
    stall: Mutex<Option<Stall>>,
}

/// Long enough for the clearing thread to run if nothing holds it back.
const STALL: Duration = Duration::from_millis(200);

impl Recorder {
    fn push(&self, e: Ev) {
        self.log.lock().unwrap().push(e);
    }

    pub(super) fn stored(&self, ev: &BlockStored) {
        for &h in &ev.block_hashes {
            self.push(Ev::Stored(h));
        }
        if let Some(Stall::AfterStore(tx)) = self.stall.lock().unwrap().take() {
            tx.send(()).unwrap();
            std::thread::sleep(STALL);
        }
    }

    pub(super) fn removed(&self, hash: u64) {
        if let Some(Stall::BeforeRemove(tx)) = self.stall.lock().unwrap().take() {
            tx.send(()).unwrap();
            std::thread::sleep(STALL);
        }
        self.push(Ev::Removed(hash));
    }

    pub(super) fn cleared(&self) {
        self.push(Ev::Cleared);
    }
}

fn announcer() -> (Arc<Announcer>, Arc<Recorder>) {
    let r = Arc::new(Recorder::default());
    let a = Announcer::of(super::Policy::all(), true);
    record_into(&a, &r);
    (a, r)
}

/// Attaches a recorder as the sink of `a` (a pending announcer's attach, in tests).
fn record_into(a: &Arc<Announcer>, r: &Arc<Recorder>) {
    assert!(a.sink.set(Out::Record(Arc::clone(r))).is_ok());
}

fn key(hash: u64) -> kvnode_proto::BlockKey {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&hash.to_be_bytes());
    kvnode_proto::BlockKey {
        ns: kvnode_proto::NamespaceId(1),
        digest: kvnode_proto::Digest(d),
        segment: 0,
    }
}

fn meta(hash: u64) -> Arc<RouterMeta> {
    Arc::new(RouterMeta {
        hash,
        parent: None,
        tokens: vec![1, 2, 3, 4],
        block_size: 4,
        salt: None,
        charge: None,
    })
}

/// Replays `log` as a router does: a removal needs a store since the last clear.
fn replay(log: &[Ev]) -> Result<(), String> {
    let mut held = std::collections::HashSet::new();
    for e in log {
        match *e {
            Ev::Stored(h) => {
                if !held.insert(h) {
                    return Err(format!("double store of {h} in {log:?}"));
                }
            }
            Ev::Removed(h) => {
                if !held.remove(&h) {
                    return Err(format!("remove of {h} without a store in {log:?}"));
                }
            }
            Ev::Cleared => held.clear(),
        }
    }
    Ok(())
}

#[test]
fn a_store_racing_a_clear_is_never_followed_by_an_orphan_removal() {
    let (a, rec) = announcer();
    let (tx, rx) = mpsc::channel();
    *rec.stall.lock().unwrap() = Some(Stall::AfterStore(tx));
    let a2 = Arc::clone(&a);
    let clearer = std::thread::spawn(move || {
        rx.recv().unwrap();
        a2.clear_all();
    });
    let r = a.reside(Medium::Disk, &key(7), Some(&meta(7))).unwrap();
    clearer.join().unwrap();
    drop(r);
    let log = rec.log.lock().unwrap().clone();
    replay(&log).unwrap();
}

#[test]
fn a_removal_racing_a_clear_lands_before_it() {
    let (a, rec) = announcer();
    let r = a
        .reside(Medium::CpuPinned, &key(9), Some(&meta(9)))
        .unwrap();
    let (tx, rx) = mpsc::channel();
    *rec.stall.lock().unwrap() = Some(Stall::BeforeRemove(tx));
    let a2 = Arc::clone(&a);
    let clearer = std::thread::spawn(move || {
        rx.recv().unwrap();
        a2.clear_all();
    });
    drop(r);
    clearer.join().unwrap();
    let log = rec.log.lock().unwrap().clone();
    replay(&log).unwrap();
    assert_eq!(log, vec![Ev::Stored(9), Ev::Removed(9), Ev::Cleared]);
}

#[test]
fn residencies_from_before_a_clear_end_silently_and_later_ones_do_not() {
    let (a, rec) = announcer();
    let old = a
        .reside(Medium::CpuPinned, &key(1), Some(&meta(1)))
        .unwrap();
    a.clear_all();
    let new = a
        .reside(Medium::CpuPinned, &key(1), Some(&meta(1)))
        .unwrap();
    drop(old);
    drop(new);
    let log = rec.log.lock().unwrap().clone();
    assert_eq!(
        log,
        vec![Ev::Stored(1), Ev::Cleared, Ev::Stored(1), Ev::Removed(1)]
    );
}

/// The (medium, hash) pairs a snapshot would copy now.
fn registered(a: &Announcer) -> Vec<(Medium, u64)> {
    let mut v: Vec<(Medium, u64)> = a
        .registry()
        .copy()
        .iter()
        .map(|(m, b)| (*m, b.hash()))
        .collect();
    v.sort_by_key(|&(m, h)| (h, m == Medium::Disk));
    v
}

#[test]
fn the_registry_holds_exactly_what_is_announced_and_a_clear_empties_it() {
    use kvnode_events::Announced;
    let (a, _rec) = announcer();
    let r1 = a
        .reside(Medium::CpuPinned, &key(1), Some(&meta(1)))
        .unwrap();
    let r2 = a.reside(Medium::Disk, &key(1), Some(&meta(1))).unwrap();
    let r3 = a
        .reside(Medium::CpuPinned, &key(3), Some(&meta(3)))
        .unwrap();
    assert_eq!(
        registered(&a),
        [
            (Medium::CpuPinned, 1),
            (Medium::Disk, 1),
            (Medium::CpuPinned, 3)
        ]
    );
    drop(r1);
    assert_eq!(registered(&a), [(Medium::Disk, 1), (Medium::CpuPinned, 3)]);
    // A freed slot is reused, and the residency that took it is the one removed later.
    let r4 = a.reside(Medium::Disk, &key(4), Some(&meta(4))).unwrap();
    drop(r2);
    assert_eq!(registered(&a), [(Medium::CpuPinned, 3), (Medium::Disk, 4)]);
    a.clear_all();
    assert!(registered(&a).is_empty());
    // Residencies announced before the clear end silently and leave newer slots alone.
    let r5 = a
        .reside(Medium::CpuPinned, &key(5), Some(&meta(5)))
        .unwrap();
    drop((r3, r4));
    assert_eq!(registered(&a), [(Medium::CpuPinned, 5)]);
    assert_eq!(r5.meta().stored(Medium::Disk).block_hashes, [5]);
}

/// Prints what a snapshot costs: bytes per registry slot, and the time the epoch lock is
/// held for writing to copy N entries (`cargo test --release -p kvnode-engine
/// snapshot_copy_cost -- --nocapture`).
#[test]
fn snapshot_copy_cost() {
    const N: u64 = 1_000_000;
    let slot = std::mem::size_of::<Option<(Medium, Arc<RouterMeta>, kvnode_proto::BlockKey)>>();
    let (a, rec) = announcer();
    let held: Vec<Residency> = (0..N)
        .map(|h| {
            a.reside(Medium::CpuPinned, &key(h), Some(&meta(h)))
                .unwrap()
        })
        .collect();
    rec.log.lock().unwrap().clear();
    let t0 = std::time::Instant::now();
    let copy = {
        let _epoch = a.epoch.write().unwrap();
        a.registry().copy()
    };
    let took = t0.elapsed();
    assert_eq!(copy.len() as u64, N);
    let slots = a.registry().slots.capacity();
    let hashes: Vec<u64> = (0..N).collect();
    let t1 = std::time::Instant::now();
    let found = a.resolve(kvnode_proto::NamespaceId(1), &hashes);
    let resolve = t1.elapsed();
    assert!(found.iter().all(Option::is_some));
    eprintln!(
        "registry of {N} blocks: {slot} bytes/slot, {:.1} bytes/block in the slab (capacity \
         {slots}) plus a 16-byte entry a block in the hash index's B-tree; copy under the \
         write lock {took:?}; resolving all {N} hashes {resolve:?}",
        (slots * slot) as f64 / N as f64,
    );
    drop((copy, held));
}

#[test]
fn announced_blocks_resolve_by_hash_in_their_namespace_until_the_last_residency_ends() {
    let (a, _) = announcer();
    let ns = kvnode_proto::NamespaceId(1);
    let dram = a
        .reside(Medium::CpuPinned, &key(5), Some(&meta(5)))
        .unwrap();
    let disk = a.reside(Medium::Disk, &key(5), Some(&meta(5))).unwrap();
    let other = a
        .reside(Medium::CpuPinned, &key(6), Some(&meta(6)))
        .unwrap();
    let d5 = Some(key(5).digest);
    assert_eq!(a.resolve(ns, &[5, 6, 7]), [d5, Some(key(6).digest), None]);
    assert_eq!(a.resolve(kvnode_proto::NamespaceId(2), &[5]), [None]);
    drop(dram);
    assert_eq!(a.resolve(ns, &[5]), [d5], "still on disk");
    drop(disk);
    assert_eq!(a.resolve(ns, &[5]), [None]);
    a.clear_all();
    assert_eq!(a.resolve(ns, &[6]), [None], "a clear forgets everything");
    drop(other);
    let again = a
        .reside(Medium::CpuPinned, &key(6), Some(&meta(6)))
        .unwrap();
    assert_eq!(a.resolve(ns, &[6]), [Some(key(6).digest)]);
    drop(again);
}

/// A live takeover's successor builds under a pending announcer: blocks are registered (the
/// donor announced them), a slot the donor changed meanwhile is unregistered, nothing is
/// published; once the sink is attached, a removal is published as usual, and a new
/// stream can announce what was registered.
#[test]
fn a_pending_announcer_registers_silently_until_its_sink_is_attached() {
    let a = Announcer::of(super::Policy::all(), true);
    assert!(!a.enabled(), "no sink yet");
    let kept = a
        .reside(Medium::CpuPinned, &key(1), Some(&meta(1)))
        .expect("registered while pending");
    let changed = a
        .reside(Medium::CpuPinned, &key(2), Some(&meta(2)))
        .expect("registered while pending");
    let on_disk = a.reside(Medium::Disk, &key(3), Some(&meta(3))).unwrap();
    drop(changed);
    assert_eq!(
        registered(&a),
        vec![(Medium::CpuPinned, 1), (Medium::Disk, 3)]
    );
    assert_eq!(a.registry().disk.len(), 1, "the NVMe slot is listed apart");
    let rec = Arc::new(Recorder::default());
    record_into(&a, &rec);
    assert!(a.enabled());
    assert!(
        rec.log.lock().unwrap().is_empty(),
        "nothing sent while pending"
    );
    assert_eq!(a.announce_registered(), 2);
    drop(kept);
    drop(on_disk);
    assert_eq!(
        rec.log.lock().unwrap().clone(),
        vec![Ev::Stored(1), Ev::Stored(3), Ev::Removed(1), Ev::Removed(3)]
    );
    assert!(registered(&a).is_empty() && a.registry().disk.is_empty());
    // An announcer without events registers nothing.
    let off = Announcer::of(super::Policy::all(), false);
    assert!(
        off.reside(Medium::CpuPinned, &key(1), Some(&meta(1)))
            .is_none()
    );
}
