//! Per-peer UCX counters for `stats` (`stats.peer`) and `/metrics`
//! (`kvnode_peer_ucx_{gets,slots_served,fallbacks}_total{peer}`).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use kvnode_proto::stats::PeerStats;

use super::Peers;

impl Peers {
    /// Counts `n` blocks answered as UCX `Slot`s to the destination named `dst`.
    pub(super) fn count_slots_served(&self, dst: &str, n: u64) {
        self.counters
            .ucx_slots_served
            .fetch_add(n, Ordering::Relaxed);
        let mut m = self.counters.ucx_served_by.lock().expect("served lock");
        if let Some(v) = m.get_mut(dst) {
            *v += n;
        } else {
            m.insert(dst.to_owned(), n);
        }
    }

    /// One entry per peer pulled from (by the name it was dialled as) or served (by the
    /// identity its handshake gave), sorted by name.
    pub fn peer_stats(&self) -> Vec<PeerStats> {
        let mut by: BTreeMap<String, PeerStats> = BTreeMap::new();
        for l in self.wires.links() {
            let e = at(&mut by, &l.name);
            e.peer_ucx_gets_total += l.ucx_gets.load(Ordering::Relaxed);
            e.peer_ucx_fallbacks_total += l.ucx_fallbacks.load(Ordering::Relaxed);
        }
        let served = self
            .counters
            .ucx_served_by
            .lock()
            .expect("served lock")
            .clone();
        for (name, n) in served {
            at(&mut by, &name).peer_ucx_slots_served_total += n;
        }
        by.into_values().collect()
    }
}

fn at<'a>(by: &'a mut BTreeMap<String, PeerStats>, name: &str) -> &'a mut PeerStats {
    by.entry(name.to_owned()).or_insert_with(|| PeerStats {
        peer: name.to_owned(),
        ..PeerStats::default()
    })
}
