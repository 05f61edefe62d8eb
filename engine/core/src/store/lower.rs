//! The NVMe tier arrives after the store serves (issue 42, item 4): rebuilding the spill
//! index takes time in proportion to the blocks on disk (0.66 µs a block, 6.6 s at 10 M),
//! and a start or a takeover that waited for it stopped the service that long. The files
//! are opened and locked before the daemon serves (what can refuse a start still does); the
//! index is rebuilt on a thread of its own while DRAM serves, and the tier is attached here
//! when it is ready.
//!
//! ```text
//!  Off ──────────────────────────────────── no spill directory
//!  Recovering ─ attach (index rebuilt) ──> Ready
//!             └ fail (rebuild failed) ───> Failed (DRAM only; logged, /metrics)
//! ```
//!
//! While it recovers, the store behaves as one without a lower tier: lookups see DRAM only
//! (a block only on NVMe is a miss, which an engine recomputes), puts stay in DRAM, and
//! nothing is demoted. A delete or clear is remembered and applied to the tier before it is
//! attached, so no block deleted meanwhile is found again (at most [`REMEMBERED_KEYS_MAX`]
//! deleted keys; a clear drops the deletes it covers; a delete beyond that is refused with
//! `LimitReached` and changes nothing). Work that needs the tier (the
//! demoter, write-behind, adopting a predecessor's KV events) waits for it.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use kvnode_proto::{Key, NamespaceId};
use tokio::sync::watch;

use crate::nvme::NvmeTier;

/// Where the store's NVMe tier stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpillPhase {
    /// No spill directory is configured.
    Off,
    /// The spill index is being rebuilt; DRAM serves alone meanwhile.
    Recovering,
    /// The NVMe tier serves.
    Ready,
    /// The rebuild failed: DRAM serves alone until a restart.
    Failed,
}

/// A delete or clear made while the tier recovered.
#[derive(Debug)]
enum Missed {
    Delete(NamespaceId, Vec<Key>),
    Clear(Option<NamespaceId>),
}

/// Most deleted keys remembered while the tier recovers (~48 MB); a delete beyond them is
/// refused, changing nothing, until the tier is attached. The window is seconds long, but a
/// client deleting without pause would otherwise grow the list without bound.
pub(super) const REMEMBERED_KEYS_MAX: usize = 1 << 20;

/// What waits for the tier while it recovers.
#[derive(Default)]
struct Pending {
    missed: Vec<Missed>,
    /// Keys in `missed`'s deletes.
    keys: usize,
    work: Vec<OnAttach>,
}

impl Pending {
    /// Remembers a clear. Every delete or clear remembered before it that it covers is
    /// dropped: applied first, it would find nothing the clear leaves (the tier takes no
    /// writes while it recovers).
    fn clear(&mut self, id: Option<NamespaceId>) {
        self.missed.retain(|m| match (m, id) {
            (_, None) => false,
            (Missed::Delete(ns, _) | Missed::Clear(Some(ns)), Some(c)) => *ns != c,
            (Missed::Clear(None), Some(_)) => true,
        });
        self.keys = self
            .missed
            .iter()
            .map(|m| match m {
                Missed::Delete(_, k) => k.len(),
                Missed::Clear(_) => 0,
            })
            .sum();
        self.missed.push(Missed::Clear(id));
    }
}

/// A delete that found too many deleted keys remembered already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Backlog {
    pub remembered: usize,
}

/// Work run once, when the tier is attached (or with `None`, when it never will be).
type OnAttach = Box<dyn FnOnce(Option<&Arc<NvmeTier>>) + Send>;

/// The lower tier's slot in the store.
pub(super) struct Lower {
    tier: OnceLock<Arc<NvmeTier>>,
    phase: watch::Sender<SpillPhase>,
    /// `Some` while recovering: deletes and clears to apply, work to run at attach.
    pending: Mutex<Option<Pending>>,
    /// The thread rebuilding the index (joined by [`Lower::settled`]).
    opener: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Lower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lower")
            .field("phase", &*self.phase.borrow())
            .finish_non_exhaustive()
    }
}

impl Lower {
    /// A slot holding `tier` (or none) from the start.
    pub(super) fn now(tier: Option<Arc<NvmeTier>>) -> Self {
        let phase = if tier.is_some() {
            SpillPhase::Ready
        } else {
            SpillPhase::Off
        };
        let cell = OnceLock::new();
        if let Some(t) = tier {
            let _ = cell.set(t);
        }
        Self {
            tier: cell,
            phase: watch::Sender::new(phase),
            pending: Mutex::new(None),
            opener: Mutex::new(None),
        }
    }

    /// A slot whose tier is being recovered.
    pub(super) fn recovering() -> Self {
        Self {
            tier: OnceLock::new(),
            phase: watch::Sender::new(SpillPhase::Recovering),
            pending: Mutex::new(Some(Pending::default())),
            opener: Mutex::new(None),
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Option<Pending>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn get(&self) -> Option<&Arc<NvmeTier>> {
        self.tier.get()
    }

    pub(super) fn phase(&self) -> SpillPhase {
        *self.phase.borrow()
    }

    pub(super) fn watch(&self) -> watch::Receiver<SpillPhase> {
        self.phase.subscribe()
    }

    pub(super) fn set_opener(&self, h: std::thread::JoinHandle<()>) {
        *self.opener.lock().unwrap_or_else(PoisonError::into_inner) = Some(h);
    }

    /// A delete while recovering is remembered (`Ok(None)`), or refused when
    /// [`REMEMBERED_KEYS_MAX`] keys are remembered already; otherwise the tier to apply it to.
    pub(super) fn delete_or_remember(
        &self,
        id: NamespaceId,
        keys: &[Key],
    ) -> Result<Option<&Arc<NvmeTier>>, Backlog> {
        let mut p = self.pending();
        match p.as_mut() {
            Some(p) if p.keys + keys.len() > REMEMBERED_KEYS_MAX => {
                Err(Backlog { remembered: p.keys })
            }
            Some(p) => {
                p.keys += keys.len();
                p.missed.push(Missed::Delete(id, keys.to_vec()));
                Ok(None)
            }
            None => Ok(self.tier.get()),
        }
    }

    /// A clear while recovering is remembered (`None`); otherwise the tier to apply it to.
    pub(super) fn clear_or_remember(&self, id: Option<NamespaceId>) -> Option<&Arc<NvmeTier>> {
        let mut p = self.pending();
        match p.as_mut() {
            Some(p) => {
                p.clear(id);
                None
            }
            None => self.tier.get(),
        }
    }

    /// Runs `f` with the tier once it is attached (now, when it is; with `None` when there
    /// is none and will be none).
    pub(super) fn on_attach(&self, f: OnAttach) {
        let mut p = self.pending();
        if let Some(p) = p.as_mut() {
            p.work.push(f);
            return;
        }
        drop(p);
        f(self.tier.get());
    }

    /// The rebuilt tier: the work waiting for it runs, the deletes and clears made meanwhile
    /// are applied, and only then is it visible to lookups.
    pub(super) fn attach(&self, tier: Arc<NvmeTier>) {
        // Work first, outside the lock (adopting a predecessor's announcements can be long);
        // work queued meanwhile is taken in the loop.
        loop {
            let work = match self.pending().as_mut() {
                Some(p) => std::mem::take(&mut p.work),
                None => return,
            };
            if work.is_empty() {
                break;
            }
            for f in work {
                f(Some(&tier));
            }
        }
        let mut p = self.pending();
        let Some(Pending { missed, work, .. }) = p.take() else {
            return;
        };
        for m in missed {
            match m {
                Missed::Delete(id, keys) => {
                    for k in &keys {
                        tier.delete(id, k);
                    }
                }
                Missed::Clear(id) => {
                    tier.clear(id);
                }
            }
        }
        let tier = self.tier.get_or_init(move || tier);
        drop(p);
        for f in work {
            f(Some(tier));
        }
        self.phase.send_replace(SpillPhase::Ready);
    }

    /// The rebuild failed: the store serves from DRAM alone; the waiting work runs without
    /// a tier.
    pub(super) fn fail(&self) {
        let work = self.pending().take().map(|p| p.work).unwrap_or_default();
        for f in work {
            f(None);
        }
        self.phase.send_replace(SpillPhase::Failed);
    }

    /// Waits until the tier is attached or failed (the rebuilding thread has ended).
    pub(super) async fn settled(&self) {
        let mut rx = self.watch();
        let _ = rx.wait_for(|p| *p != SpillPhase::Recovering).await;
        let h = self
            .opener
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = h {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
    }

    /// Waits until the tier is attached (`Some`), or until `stop` flips or the tier
    /// failed or there is none (`None`).
    pub(super) async fn ready(&self, stop: &mut watch::Receiver<bool>) -> Option<Arc<NvmeTier>> {
        let mut rx = self.watch();
        tokio::select! {
            r = rx.wait_for(|p| *p != SpillPhase::Recovering) => { r.ok()?; }
            _ = stop.wait_for(|s| *s) => return None,
        }
        self.tier.get().cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: usize) -> Vec<Key> {
        (0..n as u64)
            .map(|i| {
                let mut d = [0u8; 32];
                d[..8].copy_from_slice(&i.to_le_bytes());
                Key::page(kvnode_proto::Digest(d))
            })
            .collect()
    }

    #[test]
    fn deletes_remembered_while_recovering_are_bounded_and_a_refused_one_changes_nothing() {
        let l = Lower::recovering();
        let ns = NamespaceId(7);
        let big = keys(REMEMBERED_KEYS_MAX / 2);
        assert!(matches!(l.delete_or_remember(ns, &big), Ok(None)));
        assert!(matches!(l.delete_or_remember(ns, &big), Ok(None)));
        assert_eq!(
            l.delete_or_remember(ns, &keys(1)).err(),
            Some(Backlog {
                remembered: REMEMBERED_KEYS_MAX
            })
        );
        let p = l.pending();
        let p = p.as_ref().unwrap();
        assert_eq!((p.missed.len(), p.keys), (2, REMEMBERED_KEYS_MAX));
    }

    #[test]
    fn a_clear_remembered_drops_the_deletes_and_clears_it_covers() {
        let l = Lower::recovering();
        let (a, b) = (NamespaceId(1), NamespaceId(2));
        for ns in [a, b] {
            assert!(matches!(l.delete_or_remember(ns, &keys(10)), Ok(None)));
        }
        assert!(l.clear_or_remember(Some(a)).is_none());
        {
            let p = l.pending();
            let p = p.as_ref().unwrap();
            assert_eq!(p.keys, 10, "a's deletes dropped, b's kept");
            assert!(matches!(
                p.missed.as_slice(),
                [Missed::Delete(n, _), Missed::Clear(Some(c))] if *n == b && *c == a
            ));
        }
        assert!(l.clear_or_remember(None).is_none());
        let p = l.pending();
        let p = p.as_ref().unwrap();
        assert_eq!(p.keys, 0);
        assert!(matches!(p.missed.as_slice(), [Missed::Clear(None)]));
    }
}
