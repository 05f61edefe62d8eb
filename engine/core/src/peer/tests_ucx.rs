//! The UCX transport between two in-process nodes: the destination GETs each block from the
//! source's registered arena (UCX picks its transport from `UCX_*`; CI sets `UCX_TLS=tcp`).
//! Run: `UCX_TLS=tcp cargo test --release -p kvnode-engine peer::tests_ucx`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvnode_proto::Key;
use kvnode_proto::pull::{KeyOutcome, OpState};

use super::TransportKind::{Tcp, Ucx};
use super::tests::{PAGE, Pair, failed_with, key, pair_gets, pair_on};

/// Waits until the source holds no lease (the destination's `Landed` arrived).
async fn leases_drain(p: &Pair) {
    let t = Instant::now();
    while p.src.store.snapshot().0.tier.leases != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "source leases never released"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_gets_every_block_byte_identical_and_the_source_releases_its_leases() {
    let p = pair_on(6, None, Ucx, Ucx).await;
    let r = p.pull(6).await;
    assert_eq!(r.state, OpState::Done, "{r:?}");
    assert_eq!(p.held(6).await, vec![true; 6]);
    let served = p
        .src
        .peers
        .counters
        .ucx_slots_served
        .load(Ordering::Relaxed);
    assert_eq!(served, 6, "blocks were not answered as UCX slots");
    leases_drain(&p).await;
    assert_eq!(p.reserved(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_without_ucx_declines_and_the_pull_goes_over_tcp() {
    let p = pair_on(3, None, Tcp, Ucx).await;
    let r = p.pull(3).await;
    assert_eq!(r.state, OpState::Done, "{r:?}");
    assert_eq!(p.held(3).await, vec![true; 3]);
    assert_eq!(
        p.src
            .peers
            .counters
            .ucx_slots_served
            .load(Ordering::Relaxed),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_registration_revokes_the_key_and_open_connections_get_the_new_one() {
    let p = pair_on(4, None, Ucx, Ucx).await;
    assert_eq!(p.pull(2).await.state, OpState::Done);
    let before = p.src.peers.ucx().unwrap().generation();
    let after = p.src.peers.revoke_remote_access().unwrap().unwrap();
    assert_eq!(after, before + 1);
    // The pooled connection gets the new key in band, before its next Slot.
    let r = p.pull(4).await;
    assert_eq!(r.state, OpState::Done, "{r:?}");
    assert_eq!(
        &r.results[..2],
        &[KeyOutcome::HitLocal, KeyOutcome::HitLocal]
    );
    assert_eq!(p.held(4).await, vec![true; 4]);
    leases_drain(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_changed_at_the_source_after_it_was_hashed_is_refused_and_not_committed() {
    let p = pair_on(3, None, Ucx, Ucx).await;
    assert_eq!(
        p.pull(3).await.state,
        OpState::Done,
        "the source hashed all"
    );
    leases_drain(&p).await;
    // Scribble on the source's copy of key 1, as a client holding the arena mapping could.
    let keys: Vec<Key> = (0..3).map(key).collect();
    let at = p.src.store.lease(p.sns, &keys[1..2]).await.unwrap()[0]
        .as_ref()
        .unwrap()
        .extent();
    // SAFETY: a test writing one byte of a block it owns; no one else touches it now.
    unsafe { p.src.store.arena().slice_mut(at.offset, at.len)[PAGE / 2] ^= 0xff };
    // The source answers with the remembered hash; the GET lands the changed bytes, which
    // the destination refuses before commit.
    p.dst.store.delete(p.ns, &keys).unwrap();
    let r = p.pull(3).await;
    assert_eq!(r.state, OpState::Partial, "{r:?}");
    assert!(failed_with(&r.results[1], "checksum mismatch"), "{r:?}");
    assert_eq!(p.held(3).await, vec![true, false, true]);
    assert_eq!(p.reserved(), 0);
    leases_drain(&p).await;
}

/// Pulls 40 blocks with a window of `gets` GETs; the most the destination had in flight.
async fn most_in_flight(gets: u32) -> usize {
    let p = pair_gets(40, None, Ucx, Ucx, gets).await;
    let r = p.pull(40).await;
    assert_eq!(r.state, OpState::Done, "{r:?}");
    assert_eq!(p.held(40).await, vec![true; 40]);
    leases_drain(&p).await;
    assert_eq!(p.reserved(), 0);
    p.dst.peers.ucx().unwrap().max_gets_in_flight()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_keeps_a_window_of_gets_in_flight_and_every_block_lands() {
    // 40 blocks are 3 requests of 16: the window runs across request boundaries.
    assert_eq!(most_in_flight(8).await, 8, "GETs were not pipelined");
    assert_eq!(
        most_in_flight(1).await,
        1,
        "a window of 1 had more in flight"
    );
}
