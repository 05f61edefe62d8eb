//! Hinted `GetToRegion` (what SGLang's HiCache backend sends) through real daemons: the keys
//! the destination lacks are pulled from the hinted peer and each is copied into the client's
//! memfd region as soon as it has landed verified:
//! - a real source: every key lands bitwise at its offset, local hits first, and the reply
//!   carries the pull's report;
//! - a scripted source that holds back block 1 until the test has seen block 0 in the region:
//!   the copy onward overlaps the pull (not pull-then-copy);
//! - a bad extent is refused before anything is pulled.
//!
//! Run: `cargo test --release -p kvnode-e2e --test region_pulled`.

use std::net::TcpListener;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use kvnode_e2e::peerwire::{accept_pull, send_block, wait_until};
use kvnode_e2e::shm::Shm;
use kvnode_e2e::{block, free_port, hint, key, peer_dest, peer_source, spec};
use kvnode_proto::Key;
use kvnode_proto::client::ErrorCode;
use kvnode_proto::peer::PeerMsg;
use kvnode_proto::pull::{KeyOutcome, OpState};

const PAGE: usize = 64 << 10;

#[test]
fn a_hinted_get_to_region_pulls_the_missing_keys_into_their_offsets() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let keys: Vec<Key> = (0..8).map(key).collect();
    let data: Vec<Vec<u8>> = (0..8).map(|i| block(i, PAGE)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let mut s = src.client();
    let sns = s.register(&spec("m", PAGE as u64)).unwrap().ns;
    s.put(sns, &keys, &refs).unwrap();

    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    c.put(ns, &keys[..1], &refs[..1]).unwrap();
    let shm = Shm::new("kvnode-test-region-pulled", 8 * PAGE);
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    // Reverse order in the region: key i at slot 7 - i.
    let offs: Vec<u64> = (0..8).map(|i| ((7 - i) * PAGE) as u64).collect();
    let lens = vec![PAGE as u64; 8];
    let (got, pull) = c
        .get_to_region_hinted(
            ns,
            &keys,
            region,
            &offs,
            &lens,
            &hint(port, &keys),
            Some(10_000),
        )
        .unwrap();
    assert_eq!(got, vec![Some(PAGE as u64); 8]);
    let pull = pull.expect("a hinted GetToRegion reports its pull");
    assert_eq!(pull.state, OpState::Done, "{pull:?}");
    assert_eq!(pull.results[0], KeyOutcome::HitLocal);
    assert!(pull.results[1..].iter().all(|r| *r == KeyOutcome::Pulled));
    let mut back = vec![0u8; 8 * PAGE];
    std::fs::File::from(shm.fd.try_clone().unwrap())
        .read_exact_at(&mut back, 0)
        .unwrap();
    for (i, want) in data.iter().enumerate() {
        let at = (7 - i) * PAGE;
        assert_eq!(&back[at..at + PAGE], &want[..], "key {i}");
    }

    // A destination outside the region is refused before any pull starts.
    match c.get_to_region_hinted(
        ns,
        &keys[..1],
        region,
        &[(8 * PAGE) as u64],
        &lens[..1],
        &hint(port, &keys),
        None,
    ) {
        Err(kvnode_client::ClientError::Server { code, message }) => {
            assert_eq!(code, ErrorCode::Invalid);
            assert!(message.contains("outside"), "{message}");
        }
        other => panic!("an extent outside the region must be refused: {other:?}"),
    }
    let st = c.stats().unwrap();
    assert_eq!(
        (st.tiers[0].blocks, st.tiers[0].reserved, st.tiers[0].leases),
        (8, 0, 0)
    );
}

#[test]
fn keys_are_copied_into_the_region_while_later_blocks_are_still_on_the_wire() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let dst = peer_dest(
        &format!("tcp://127.0.0.1:{port}"),
        &["--peer-io-timeout-ms", "2000"],
    );
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let shm = Shm::new("kvnode-test-region-stream", 4 * PAGE);
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    let watched = std::fs::File::from(shm.fd.try_clone().unwrap());
    let keys: Vec<Key> = (0..2).map(key).collect();
    let src = std::thread::spawn(move || {
        let (mut w, req, _) = accept_pull(&l);
        send_block(&mut w, req, 0, &block(0, PAGE));
        // Block 1 is held back until block 0 is in the region (slot 2).
        let (want, mut now) = (block(0, PAGE), vec![0u8; PAGE]);
        let seen = wait_until(|| {
            watched.read_exact_at(&mut now, (2 * PAGE) as u64).unwrap();
            now == want
        });
        send_block(&mut w, req, 1, &block(1, PAGE));
        w.send(&PeerMsg::Done { req }, &[]).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        seen
    });
    let offs = [(2 * PAGE) as u64, 0];
    let lens = [PAGE as u64; 2];
    let (got, pull) = c
        .get_to_region_hinted(
            ns,
            &keys,
            region,
            &offs,
            &lens,
            &hint(port, &keys),
            Some(20_000),
        )
        .unwrap();
    assert!(
        src.join().unwrap(),
        "block 0 never reached the region before block 1 was sent: the get waited for the whole pull"
    );
    assert_eq!(got, vec![Some(PAGE as u64); 2], "{pull:?}");
}
