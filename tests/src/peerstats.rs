//! What `kvnode stats --json` says about a daemon's peer transport: under the UCX pass of the
//! peer suites (`KVNODE_E2E_PEER_TRANSPORT=ucx`), a pull must have moved its pages with UCX
//! GETs and never fallen back to TCP, which a log line written at negotiation cannot show.
//!
//! The counters are the `peer` section of `stats --json` (one entry per peer):
//! `peer_ucx_gets_total`, `peer_ucx_slots_served_total` and `peer_ucx_fallbacks_total`. They are summed over
//! every entry, wherever the section nests them, so the check does not depend on whether the
//! peers are a list or a map keyed by address.
//!
//! A check of one pull in a longer test takes a [`UcxCounts`] snapshot before it and asserts
//! what moved since ([`assert_gets_since`]): the cumulative check alone would pass on the
//! GETs of an earlier pull while a later one (after a restart, a re-key) went over TCP.

use std::path::Path;
use std::process::Command;

use crate::{Daemon, kvnode_bin, peer_transport};

/// A daemon's UCX counters (`stats.peer`), summed over its peers or for one peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UcxCounts {
    /// Blocks read with UCX GETs (`peer_ucx_gets_total`).
    pub gets: u64,
    /// Blocks answered with a UCX `Slot` (`peer_ucx_slots_served_total`).
    pub slots_served: u64,
    /// Connections wanted on UCX that pull over TCP (`peer_ucx_fallbacks_total`).
    pub fallbacks: u64,
}

impl UcxCounts {
    /// `d`'s counters summed over every peer it pulled from or served.
    pub fn of(d: &Daemon) -> Self {
        Self::matching(d, |_| true)
    }

    /// `d`'s counters for the peer named `peer` (as dialled: `tcp://host:port`); all zeros
    /// when `d` has no entry for it.
    pub fn of_peer(d: &Daemon, peer: &str) -> Self {
        Self::matching(d, |p| p == peer)
    }

    fn matching(d: &Daemon, want: impl Fn(&str) -> bool) -> Self {
        let stats = d.client().stats().expect("stats");
        stats
            .peer
            .iter()
            .filter(|p| want(&p.peer))
            .fold(Self::default(), |a, p| Self {
                gets: a.gets + p.peer_ucx_gets_total,
                slots_served: a.slots_served + p.peer_ucx_slots_served_total,
                fallbacks: a.fallbacks + p.peer_ucx_fallbacks_total,
            })
    }
}

/// Under the UCX pass: at least `blocks` blocks reached `dst` by UCX GETs since `before` (a
/// [`UcxCounts::of`] snapshot of `dst`), and no connection of `dst` fell back to TCP since.
/// On a UCX connection every block comes by GET, so this says the pull after `before` ran
/// over UCX. `what` names the pull in the failure. Does nothing under the TCP pass.
pub fn assert_gets_since(dst: &Daemon, before: UcxCounts, blocks: u64, what: &str) {
    if peer_transport() != "ucx" {
        return;
    }
    let now = UcxCounts::of(dst);
    let (gets, fallbacks) = (now.gets - before.gets, now.fallbacks - before.fallbacks);
    assert!(
        gets >= blocks && fallbacks == 0,
        "{what}: not pulled over UCX GETs alone: {gets} blocks by GET (want at least {blocks}), \
         {fallbacks} connections fell back to TCP since the snapshot ({before:?} -> {now:?})\n\
         destination log:\n{}",
        dst.log()
    );
}

/// Under the UCX pass: `dst` pulled nothing by GET and counted a fallback to TCP, as it does
/// when the source declines UCX (a scripted source, a TCP-only one). Does nothing under the
/// TCP pass.
pub fn assert_declined_to_tcp(dst: &Daemon) {
    if peer_transport() != "ucx" {
        return;
    }
    let c = UcxCounts::of(dst);
    assert!(
        c.gets == 0 && c.fallbacks >= 1,
        "a source that declines UCX must leave the destination on TCP: {c:?}\n{}",
        dst.log()
    );
}

/// `kvnode stats --json` of the daemon at `socket`, parsed.
pub fn stats_json(socket: &Path) -> serde_json::Value {
    let out = Command::new(kvnode_bin())
        .args(["stats", "--json", "--socket"])
        .arg(socket)
        .output()
        .expect("run kvnode stats --json");
    assert!(
        out.status.success(),
        "kvnode stats --json: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stats --json is JSON")
}

/// The sum of counter `key` over every object under the `peer` section of `stats` (the
/// report's own `stats` object), or `None` when no object there has the key.
pub fn peer_counter(stats: &serde_json::Value, key: &str) -> Option<u64> {
    fn walk(v: &serde_json::Value, key: &str, sum: &mut Option<u64>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(n) = m.get(key).and_then(serde_json::Value::as_u64) {
                    *sum = Some(sum.unwrap_or(0) + n);
                }
                m.values().for_each(|x| walk(x, key, sum));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, key, sum)),
            _ => {}
        }
    }
    let mut sum = None;
    walk(stats.get("stats")?.get("peer")?, key, &mut sum);
    sum
}

/// Under the UCX pass: `dst` pulled with UCX GETs (its `ucx_gets_total` moved), `src` served
/// slots for them (`ucx_slots_served_total` moved), and neither fell back to TCP
/// (`ucx_fallbacks_total` 0). Does nothing under the TCP pass.
pub fn assert_pulled_over_ucx(dst: &Daemon, src: &Daemon) {
    if peer_transport() != "ucx" {
        return;
    }
    let (d, s) = (stats_json(&dst.socket), stats_json(&src.socket));
    let need = |v: &serde_json::Value, who: &str, key: &str| {
        peer_counter(v, key)
            .unwrap_or_else(|| panic!("{who}'s stats --json has no peer[].{key}: {v:#}"))
    };
    let gets = need(&d, "destination", "peer_ucx_gets_total");
    let served = need(&s, "source", "peer_ucx_slots_served_total");
    let fallbacks = need(&d, "destination", "peer_ucx_fallbacks_total")
        + peer_counter(&s, "peer_ucx_fallbacks_total").unwrap_or(0);
    assert!(
        gets > 0 && served > 0 && fallbacks == 0,
        "the pull did not run over UCX GETs alone: destination ucx_gets_total {gets}, source \
         ucx_slots_served_total {served}, ucx_fallbacks_total {fallbacks}\ndestination log:\n{}",
        dst.log()
    );
}
