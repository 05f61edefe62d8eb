//! Fetch-path unit tests through the fault-injecting transport: two in-process nodes (a store
//! and a peer service each, no engine), a real source over loopback TCP, and a destination
//! whose Nth received block is cut short or arrives corrupted; and a silent source that stops
//! mid-block, against the real reader's timeout.
//! Run: `cargo test --release -p kvnode-engine peer::tests`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnode_proto::peer::PullKey;
use kvnode_proto::pull::{KeyOutcome, OpReport, OpState};
use kvnode_proto::{Digest, Key, NamespaceId, NamespaceSpec};
use tokio::sync::watch;

use super::hashes::fingerprint;
use super::source::ahead::{MIN_AHEAD, SumsAhead};
use super::source::sums::{remembered, settled};
use super::source::{Batch, BlockSource};
use super::transport::FaultPlan;
use super::{Peers, TransportKind};
use crate::arena::Arena;
use crate::dram::{DramTier, TierConfig};
use crate::obs::Metrics;
use crate::policy::PolicyKind;
use crate::residency::Announcer;
use crate::store::Store;
use kvnode_blockmac::BlockMac;

/// Larger than two hash pieces, so a block is read and hashed in several pieces.
pub(super) const PAGE: usize = 300 << 10;
const IO_TIMEOUT_MS: u64 = 300;

fn spec() -> NamespaceSpec {
    NamespaceSpec {
        model: "fetch-faults".into(),
        page_size: 64,
        segments: vec![PAGE as u64],
        ..NamespaceSpec::default()
    }
}

pub(super) fn key(i: u8) -> Key {
    let mut d = [0u8; 32];
    d[0] = i;
    d[31] = 0xf7;
    Key::page(Digest(d))
}

pub(super) fn bytes(i: u8) -> Vec<u8> {
    (0..PAGE).map(|j| (j as u8).wrapping_mul(31) ^ i).collect()
}

/// One node: a 32 MiB store (DRAM only) and its peer service.
pub(super) struct Node {
    pub(super) store: Arc<Store>,
    pub(super) peers: Arc<Peers>,
}

/// A 32 MiB DRAM-only store (4 MiB slabs, LRU), as every peer unit test's node has.
pub(super) fn small_store() -> Arc<Store> {
    let arena = Arc::new(Arena::create(32 << 20, false).expect("arena"));
    let announcer = Announcer::new(None);
    let dram = Arc::new(DramTier::with_announcer(
        &TierConfig {
            capacity: arena.len(),
            slab_bytes: 4 << 20,
            policy: PolicyKind::Lru,
        },
        Arc::clone(&announcer),
    ));
    Store::new(arena, dram, None, announcer)
}

fn node(peer: &crate::peer::PeerConfig) -> Node {
    let store = small_store();
    let peers = Peers::new(peer, Arc::clone(&store), Arc::new(Metrics::default())).expect("peers");
    Node {
        store,
        peers: Arc::new(peers),
    }
}

pub(super) struct Pair {
    pub(super) src: Node,
    pub(super) sns: u32,
    pub(super) dst: Node,
    pub(super) ns: u32,
    hint: String,
    _stop: watch::Sender<bool>,
}

/// A destination that pulls from `port` with `plan`: (node, namespace, hint for `n` keys).
fn dest(port: u16, n: u8, plan: FaultPlan) -> (Node, u32, String) {
    dest_on(port, n, Some(plan), TransportKind::Tcp, 16)
}

/// A destination on transport `t` (with `plan`, if any, and up to `gets` UCX GETs in
/// flight per connection) pulling from `port`.
fn dest_on(
    port: u16,
    n: u8,
    plan: Option<FaultPlan>,
    t: TransportKind,
    gets: u32,
) -> (Node, u32, String) {
    let dst = node(&crate::peer::PeerConfig {
        peers: vec![format!("tcp://127.0.0.1:{port}")],
        connections: 1,
        io_timeout_ms: IO_TIMEOUT_MS,
        debug_fault: plan,
        transport: t,
        ucx_gets_in_flight: gets,
        ucx_insecure_software_rma: true,
        ..crate::peer::PeerConfig::default()
    });
    let ns = dst.store.register(&spec()).unwrap().ns;
    let hashes: Vec<String> = (0..n).map(|i| key(i).0.router_hash().to_string()).collect();
    let hint = format!(
        r#"{{"source_control_endpoint":"tcp://127.0.0.1:{port}","block_hashes":[{}]}}"#,
        hashes.join(",")
    );
    (dst, ns, hint)
}

/// A source holding `n` blocks, served on loopback, and a destination with `plan`.
async fn pair(n: u8, plan: FaultPlan) -> Pair {
    pair_on(n, Some(plan), TransportKind::Tcp, TransportKind::Tcp).await
}

/// A source holding `n` blocks on transport `st`, and a destination on `dt` with `plan`.
pub(super) async fn pair_on(
    n: u8,
    plan: Option<FaultPlan>,
    st: TransportKind,
    dt: TransportKind,
) -> Pair {
    pair_gets(n, plan, st, dt, 16).await
}

/// [`pair_on`] with a destination keeping up to `gets` UCX GETs in flight per connection.
pub(super) async fn pair_gets(
    n: u8,
    plan: Option<FaultPlan>,
    st: TransportKind,
    dt: TransportKind,
    gets: u32,
) -> Pair {
    // Loopback over UCX's software transports (no RDMA device here): the explicit switch,
    // and a listener address so the source exposes its arena.
    let src = node(&crate::peer::PeerConfig {
        transport: st,
        listen: Some("127.0.0.1:0".into()),
        ucx_insecure_software_rma: true,
        ..crate::peer::PeerConfig::default()
    });
    let sns = src.store.register(&spec()).unwrap().ns;
    let keys: Vec<Key> = (0..n).map(key).collect();
    let res = src
        .store
        .reserve(1, sns, &keys, &vec![PAGE as u64; keys.len()])
        .unwrap();
    for (i, r) in res.into_iter().enumerate() {
        let mut r = r.unwrap();
        r.bytes_mut().copy_from_slice(&bytes(i as u8));
        r.commit();
    }
    let l = src.peers.transport().bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (stop, rx) = watch::channel(false);
    tokio::spawn(super::source::serve(Arc::clone(&src.peers), l, rx));
    let (dst, ns, hint) = dest_on(port, n, plan, dt, gets);
    Pair {
        src,
        sns,
        dst,
        ns,
        hint,
        _stop: stop,
    }
}

impl Pair {
    pub(super) async fn pull(&self, n: u8) -> OpReport {
        self.pull_op(n, false).await.report()
    }

    /// Pulls keys `0..n` into an op that keeps each pulled block's commit lease (as a hinted
    /// GPU onload's does) or not, and waits for it to end.
    async fn pull_op(&self, n: u8, hand_leases: bool) -> Arc<super::PullOp> {
        let keys: Vec<Key> = (0..n).map(key).collect();
        let op = self
            .dst
            .peers
            .start(super::PullRequest {
                conn: 1,
                ns: self.ns,
                keys: &keys,
                hint: &self.hint,
                into: Vec::new(),
                deadline_ms: Some(5000),
                hand_leases,
                actions: Vec::new(),
            })
            .await;
        op.wait(Duration::from_secs(10)).await;
        op
    }

    /// Which keys the destination holds, checking their bytes.
    pub(super) async fn held(&self, n: u8) -> Vec<bool> {
        let keys: Vec<Key> = (0..n).map(key).collect();
        let leased = self.dst.store.lease(self.ns, &keys).await.unwrap();
        leased
            .iter()
            .enumerate()
            .map(|(i, l)| {
                l.as_ref().is_some_and(|b| {
                    assert_eq!(
                        b.bytes(),
                        bytes(i as u8).as_slice(),
                        "key {i} committed wrong bytes"
                    );
                    true
                })
            })
            .collect()
    }

    /// The checksum each key's block carries in `node`'s store.
    async fn checksums(node: &Node, ns: u32, n: u8) -> Vec<Option<u64>> {
        let keys: Vec<Key> = (0..n).map(key).collect();
        let leased = node.store.lease(ns, &keys).await.unwrap();
        leased
            .iter()
            .map(|l| l.as_ref().and_then(crate::store::Lease::fingerprint))
            .collect()
    }

    pub(super) fn reserved(&self) -> u64 {
        self.dst.store.snapshot().0.tier.reserved
    }

    /// Flips byte `at` of the source's copy of key `i`, as a client holding the arena
    /// mapping could.
    async fn scribble(&self, i: u8, at: usize) {
        let e = self.src.store.lease(self.sns, &[key(i)]).await.unwrap()[0]
            .as_ref()
            .unwrap()
            .extent();
        // SAFETY: a test writing one byte of a block it owns; no one else touches it now.
        unsafe { self.src.store.arena().slice_mut(e.offset, e.len)[at] ^= 0xff };
    }

    /// Blocks the source did not send because their bytes changed.
    fn changed_blocks(&self) -> u64 {
        self.src
            .peers
            .counters
            .changed_blocks
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub(super) fn failed_with(r: &KeyOutcome, want: &str) -> bool {
    matches!(r, KeyOutcome::Failed(why) if why.message.contains(want))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_transport_pulls_every_block_byte_identical() {
    let p = pair(4, FaultPlan::default()).await;
    let r = p.pull(4).await;
    assert_eq!(r.state, OpState::Done, "{r:?}");
    assert_eq!(p.held(4).await, vec![true; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_block_fails_only_its_key_and_is_not_committed() {
    let p = pair(
        4,
        FaultPlan {
            corrupt_block: Some(2),
            ..FaultPlan::default()
        },
    )
    .await;
    let r = p.pull(4).await;
    assert_eq!(r.state, OpState::Partial, "{r:?}");
    assert_eq!(r.results[0], KeyOutcome::Pulled);
    assert!(failed_with(&r.results[1], "checksum mismatch"), "{r:?}");
    assert_eq!(&r.results[2..], &[KeyOutcome::Pulled, KeyOutcome::Pulled]);
    assert_eq!(p.held(4).await, vec![true, false, true, true]);
    assert_eq!(p.reserved(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_cut_mid_piece_fails_the_open_keys_commits_nothing_partial_then_recovers() {
    let cut_after = 200_000;
    let p = pair(
        4,
        FaultPlan {
            cut_block: Some(2),
            cut_after,
            ..FaultPlan::default()
        },
    )
    .await;
    let r = p.pull(4).await;
    assert_eq!(r.results[0], KeyOutcome::Pulled, "{r:?}");
    let want = format!("after {cut_after} of {PAGE} bytes");
    assert!(
        r.results[1..].iter().all(|o| failed_with(o, &want)),
        "{r:?}"
    );
    assert_eq!(p.held(4).await, vec![true, false, false, false]);
    assert_eq!(
        p.reserved(),
        0,
        "the cut block's reservation was handed back"
    );
    // The cut connection is not pooled; the next pull dials afresh and completes.
    let again = p.pull(4).await;
    assert_eq!(again.state, OpState::Done, "{again:?}");
    assert_eq!(again.results[0], KeyOutcome::HitLocal);
    assert_eq!(p.held(4).await, vec![true; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_block_costs_about_the_io_timeout_and_leaks_no_reservation() {
    use kvnode_proto::peer::{HASH_LEN, PeerMsg};
    // A source that authenticates, takes the pull, sends one block header and 100 KiB of its
    // body, then falls silent with the connection open: only the reader's timeout ends it.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let mut w = super::transport::TcpConn::new(s).unwrap();
        let me = super::Identity {
            node: "silent".into(),
            advertised: None,
        };
        let limit = Duration::from_secs(5);
        super::auth::accept_handshake(&mut w, None, &me, false, limit)
            .await
            .unwrap();
        let (PeerMsg::Pull { req, .. }, _) = w.recv(limit).await.unwrap() else {
            panic!("no Pull")
        };
        let body = bytes(0);
        let msg = PeerMsg::Block {
            req,
            idx: 0,
            len: PAGE as u32,
            hash: blake3::hash(&body).as_bytes().to_vec(),
            seal: vec![],
            meta: None,
        };
        assert_eq!(HASH_LEN, 32);
        w.send_cut(&msg, &body, 100 << 10).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(w);
    });
    let (dst, ns, hint) = dest(port, 3, FaultPlan::default());
    let keys: Vec<Key> = (0..3).map(key).collect();
    let t = Instant::now();
    let op = dst
        .peers
        .start(super::PullRequest {
            conn: 1,
            ns,
            keys: &keys,
            hint: &hint,
            into: Vec::new(),
            deadline_ms: Some(5000),
            hand_leases: false,
            actions: Vec::new(),
        })
        .await;
    op.wait(Duration::from_secs(10)).await;
    let took = t.elapsed();
    let r = op.report();
    assert_eq!(r.state, OpState::Failed, "{r:?}");
    assert!(
        r.results
            .iter()
            .all(|o| failed_with(o, "peer block bytes timed out")),
        "{r:?}"
    );
    // Ended by the reader's io timeout (300 ms), not by the op's 5 s deadline: the upper bound
    // is half that deadline, so a loaded CI machine (the suite runs twice, over UCX too) has
    // headroom while a pull that waited for the deadline still fails the check.
    let io = Duration::from_millis(IO_TIMEOUT_MS);
    assert!(
        took >= io && took < Duration::from_millis(2500),
        "a stalled block should cost one io timeout ({io:?}) of the real reader, not the 5 s \
         op deadline; took {took:?}"
    );
    let leased = dst.store.lease(ns, &keys).await.unwrap();
    assert!(leased.iter().all(Option::is_none), "nothing committed");
    assert_eq!(dst.store.snapshot().0.tier.reserved, 0);
    silent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_and_pulled_blocks_keep_their_verified_checksum() {
    let p = pair(3, FaultPlan::default()).await;
    assert_eq!(
        Pair::checksums(&p.src, p.sns, 3).await,
        vec![None; 3],
        "puts hash nothing"
    );
    assert_eq!(p.pull(2).await.state, OpState::Done);
    let want: Vec<Option<u64>> = (0..3)
        .map(|i| (i < 2).then(|| super::hashes::fingerprint(blake3::hash(&bytes(i)).as_bytes())))
        .collect();
    assert_eq!(
        Pair::checksums(&p.src, p.sns, 3).await,
        want,
        "the source kept what it sent"
    );
    assert_eq!(
        Pair::checksums(&p.dst, p.ns, 2).await,
        want[..2].to_vec(),
        "the destination kept what it verified"
    );
    assert_eq!(
        p.src.peers.hashes.len(),
        2,
        "the source remembers both hashes"
    );
    assert_eq!(
        p.dst.peers.hashes.len(),
        2,
        "the destination remembers what it verified"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_changed_on_the_source_after_they_were_hashed_are_never_committed() {
    let p = pair(2, FaultPlan::default()).await;
    assert_eq!(
        p.pull(2).await.state,
        OpState::Done,
        "the source hashed both"
    );
    let keys: Vec<Key> = (0..2).map(key).collect();
    p.scribble(0, 10).await;
    // With the hash remembered, the source sends the changed bytes under the old hash and
    // the destination refuses them.
    p.dst.store.delete(p.ns, &keys).unwrap();
    let r = p.pull(2).await;
    assert!(failed_with(&r.results[0], "checksum mismatch"), "{r:?}");
    assert_eq!(r.results[1], KeyOutcome::Pulled, "{r:?}");
    assert_eq!(p.held(2).await, vec![false, true]);
    // With the hash forgotten, the source hashes again, sees that the bytes no longer match
    // the fingerprint its slot kept, and answers Miss.
    p.src.peers.hashes.clear();
    let r = p.pull(2).await;
    assert_eq!(r.results[0], KeyOutcome::Missed, "{r:?}");
    assert_eq!(p.changed_blocks(), 1);
    assert_eq!(p.held(2).await, vec![false, true]);
    assert_eq!(p.reserved(), 0);
}

/// The same through the threads summing ahead (a request large enough to hand off): the
/// changed block is answered Miss, the others are pulled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_changed_on_the_source_are_refused_when_summed_ahead_too() {
    let p = pair(7, FaultPlan::default()).await;
    assert_eq!(p.pull(7).await.state, OpState::Done);
    let keys: Vec<Key> = (0..7).map(key).collect();
    p.scribble(3, 7).await;
    p.src.peers.hashes.clear();
    p.dst.store.delete(p.ns, &keys).unwrap();
    let r = p.pull(7).await;
    for (i, o) in r.results.iter().enumerate() {
        let want = if i == 3 {
            KeyOutcome::Missed
        } else {
            KeyOutcome::Pulled
        };
        assert_eq!(*o, want, "key {i}: {r:?}");
    }
    assert_eq!(p.changed_blocks(), 1);
    assert_eq!(
        p.src.peers.hashes.len(),
        6,
        "the unchanged six hashed again"
    );
    assert_eq!(p.reserved(), 0);
}

/// The source's first `n` blocks leased as a send shares them with the threads summing
/// ahead, with their wire namespace and keys.
async fn shared_leases(
    pair: &Pair,
    n: u8,
) -> (
    NamespaceId,
    Vec<PullKey>,
    Vec<Option<Arc<crate::store::Lease>>>,
) {
    let store = &pair.src.store;
    let ns = store.namespace_id(pair.sns).unwrap();
    let keys: Vec<PullKey> = (0..n).map(|i| PullKey(key(i).0, key(i).1)).collect();
    let leased = BlockSource::lease(store, ns, &keys)
        .await
        .into_iter()
        .map(|l| l.map(Arc::new))
        .collect();
    (ns, keys, leased)
}

/// `source::ahead::SumsAhead`: the blocks of a request with no sums yet, but for the first
/// (the send's own), are summed on several threads with hash and tag, and later leases find
/// them remembered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_summed_ahead_on_several_threads_are_remembered_with_hash_and_tag() {
    let pair = pair_on(7, None, TransportKind::Tcp, TransportKind::Tcp).await;
    let (p, store) = (&pair.src.peers, &pair.src.store);
    let (ns, keys, leased) = shared_leases(&pair, 7).await;
    let mac = BlockMac::for_key(9, b"a cluster key for the sums test").map(Arc::new);
    for (i, l) in leased.iter().enumerate() {
        let b = l.as_ref().expect("leased");
        assert!(remembered(&p.hashes, ns, keys[i], b, mac.as_deref()).is_none());
    }
    let total: u64 = leased.iter().flatten().skip(1).map(|b| b.len()).sum();
    assert!(
        total >= MIN_AHEAD,
        "the test's blocks must be worth summing ahead"
    );
    let batch = Batch {
        peers: p,
        ns,
        keys: &keys,
        mac: mac.as_ref(),
    };
    let mut ahead = SumsAhead::start(&batch, &leased, 3);
    assert_eq!(ahead.take(0).await, None, "the first is left to the send");
    for (i, l) in leased.into_iter().enumerate().skip(1) {
        let b = l.expect("leased");
        let got = ahead
            .take(i)
            .await
            .expect("summed ahead")
            .expect("bytes unchanged");
        assert_eq!(ahead.take(i).await, None, "taken once");
        assert_eq!(got.hash, *blake3::hash(b.bytes()).as_bytes(), "block {i}");
        // The send finds them remembered (a later lease sees the slot's fingerprint).
        let (b, again) = settled(p, b, Some(got)).expect("sums");
        assert_eq!(again, got);
        drop(b);
        let relet = BlockSource::lease(store, ns, &keys[i..=i]).await;
        let b = relet[0].as_ref().expect("leased again");
        assert_eq!(b.fingerprint(), Some(fingerprint(&got.hash)));
        assert_eq!(
            remembered(&p.hashes, ns, keys[i], b, mac.as_deref()),
            Some(got)
        );
        if let Some(m) = &mac {
            assert_eq!(got.tag_for(9), Some(m.tag(b.bytes())), "block {i}");
            assert_eq!(got.tag_for(10), None);
        }
    }
}

/// A request whose blocks to sum hold less than `MIN_AHEAD` bytes is summed by the send in
/// line, with no thread woken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_request_is_summed_in_line() {
    let pair = pair_on(7, None, TransportKind::Tcp, TransportKind::Tcp).await;
    let (ns, keys, leased) = shared_leases(&pair, 2).await;
    let p = &pair.src.peers;
    assert!(
        leased
            .iter()
            .flatten()
            .skip(1)
            .map(|b| b.len())
            .sum::<u64>()
            < MIN_AHEAD
    );
    let batch = Batch {
        peers: p,
        ns,
        keys: &keys,
        mac: None,
    };
    let mut ahead = SumsAhead::start(&batch, &leased, 3);
    for i in 0..2 {
        assert_eq!(ahead.take(i).await, None, "block {i}");
    }
}

impl Pair {
    /// [`Pair::pull_op`] that must end `Done`.
    async fn pull_handing(&self, n: u8, hand_leases: bool) -> Arc<super::PullOp> {
        let op = self.pull_op(n, hand_leases).await;
        assert_eq!(op.report().state, OpState::Done, "{:?}", op.report());
        op
    }

    /// Puts other blocks worth twice the destination's DRAM tier, so every block no one
    /// leases is evicted.
    fn flood(&self) {
        for i in 0..2 * (32 << 20) / PAGE {
            let mut d = [0u8; 32];
            d[..8].copy_from_slice(&(i as u64).to_le_bytes());
            d[31] = 0x1f;
            let k = Key::page(Digest(d));
            let r = self.dst.store.reserve(2, self.ns, &[k], &[PAGE as u64]);
            if let Some(Ok(mut r)) = r.ok().and_then(|mut v| v.pop()) {
                r.bytes_mut().fill(0x5a);
                r.commit();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulled_blocks_handed_to_the_consumer_stay_leased_until_taken() {
    let p = pair(4, FaultPlan::default()).await;
    let op = p.pull_handing(4, true).await;
    p.flood();
    // The blocks were leased by their commits (no lookup after the landing), so the flood
    // could not evict them before the consumer took them.
    let leases = op.take_leases(0..4);
    for (i, l) in leases.iter().enumerate() {
        let b = l
            .as_ref()
            .unwrap_or_else(|| panic!("key {i}: no lease handed over"));
        assert_eq!(b.bytes(), bytes(i as u8).as_slice(), "key {i}");
    }
    assert!(
        op.take_leases(0..4).iter().all(Option::is_none),
        "taken twice"
    );
    drop(leases);
    p.flood();
    assert_eq!(
        p.held(4).await,
        vec![false; 4],
        "released once the consumer is done"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_that_hands_no_leases_leaves_its_pulled_blocks_evictable() {
    let p = pair(4, FaultPlan::default()).await;
    let op = p.pull_handing(4, false).await;
    assert!(op.take_leases(0..4).iter().all(Option::is_none));
    p.flood();
    assert_eq!(p.held(4).await, vec![false; 4]);
}
