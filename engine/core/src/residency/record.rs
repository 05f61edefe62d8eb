//! Unit tests of the event order around a clear, with a recorder in place of the sink that
//! can stall one call (as a preempted thread would) while another thread clears.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvnode_events::{BlockStored, Medium};

use super::{Announcer, Out, RouterMeta};

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
    let a = Arc::new(Announcer {
        sink: Some(Out::Record(Arc::clone(&r))),
        epoch: std::sync::RwLock::new(0),
        policy: super::Policy::all(),
    });
    (a, r)
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
    let r = a.reside(Medium::Disk, Some(&meta(7))).unwrap();
    clearer.join().unwrap();
    drop(r);
    let log = rec.log.lock().unwrap().clone();
    replay(&log).unwrap();
}

#[test]
fn a_removal_racing_a_clear_lands_before_it() {
    let (a, rec) = announcer();
    let r = a.reside(Medium::CpuPinned, Some(&meta(9))).unwrap();
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
    let old = a.reside(Medium::CpuPinned, Some(&meta(1))).unwrap();
    a.clear_all();
    let new = a.reside(Medium::CpuPinned, Some(&meta(1))).unwrap();
    drop(old);
    drop(new);
    let log = rec.log.lock().unwrap().clone();
    assert_eq!(
        log,
        vec![Ev::Stored(1), Ev::Cleared, Ev::Stored(1), Ev::Removed(1)]
    );
}
