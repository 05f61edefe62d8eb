//! Two UCX contexts in one process stand in for two daemons; UCX's TCP transport over
//! loopback carries the GETs (as CI and the e2e tests run it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Access, Context, MemoryKind, Progress, Region, Remote, UcxError, Worker};

const MIB: usize = 1 << 20;

fn tcp() -> Context {
    Context::with_settings(&[("TLS", "tcp")]).expect("UCX over TCP initializes")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn register(ctx: &Context, buf: &mut [u8]) -> Region {
    // SAFETY: each test keeps `buf` alive (and unmoved) longer than the region.
    unsafe {
        Region::map(
            ctx,
            buf.as_mut_ptr(),
            buf.len(),
            MemoryKind::Host,
            Access::RemoteRead,
        )
    }
    .unwrap()
}

fn landing(ctx: &Context, buf: &mut [u8]) -> Region {
    // SAFETY: as in `register`.
    unsafe {
        Region::map(
            ctx,
            buf.as_mut_ptr(),
            buf.len(),
            MemoryKind::Host,
            Access::Local,
        )
    }
    .unwrap()
}

#[test]
fn gets_land_byte_identical_from_a_registered_peer_region() {
    let (src_ctx, dst_ctx) = (tcp(), tcp());
    let mut src = pattern(4 * MIB, 7);
    let src_reg = register(&src_ctx, &mut src);
    let serving = Progress::start(&src_ctx, "ucx-test-src").unwrap();
    let mut dst = vec![0u8; 4 * MIB];
    let dst_reg = Arc::new(landing(&dst_ctx, &mut dst));
    let key = src_reg.pack_rkey().unwrap();
    let mut r = Remote::connect(&dst_ctx, serving.address(), &key, dst_reg).unwrap();
    // Out of order, and one piece not at a block boundary.
    for (at, len) in [(3 * MIB, MIB), (0, MIB), (MIB + 5, 2 * MIB - 5), (MIB, 5)] {
        r.get(
            &mut dst[at..at + len],
            src_reg.base() + at as u64,
            Duration::from_secs(5),
        )
        .unwrap();
    }
    assert!(dst == src, "landed bytes differ from the source's");
    assert!(r.failed().is_none());
}

#[test]
fn a_peer_that_stops_progressing_costs_about_one_limit_and_the_get_is_given_back() {
    let (src_ctx, dst_ctx) = (tcp(), tcp());
    let mut src = pattern(MIB, 1);
    let src_reg = register(&src_ctx, &mut src);
    // A worker nobody progresses: a frozen (SIGSTOPped) source.
    let frozen = Worker::new(&src_ctx).unwrap();
    let mut dst = vec![0u8; MIB];
    let dst_reg = Arc::new(landing(&dst_ctx, &mut dst));
    let key = src_reg.pack_rkey().unwrap();
    let mut r = Remote::connect(&dst_ctx, &frozen.address().unwrap(), &key, dst_reg).unwrap();
    let limit = Duration::from_millis(300);
    let t = Instant::now();
    let e = r.get(&mut dst, src_reg.base(), limit).unwrap_err();
    let took = t.elapsed();
    assert!(
        matches!(e, UcxError::Timeout { .. }),
        "expected a cancelled timeout, got {e}"
    );
    assert!(took >= limit && took < limit * 3, "took {took:?}");
    // The endpoint is closed: later GETs fail at once.
    let e = r.get(&mut dst, src_reg.base(), limit).unwrap_err();
    assert!(matches!(e, UcxError::Closed(_)), "{e}");
}

#[test]
fn a_peer_that_goes_away_fails_the_get_within_the_limit() {
    let (src_ctx, dst_ctx) = (tcp(), tcp());
    let mut src = pattern(MIB, 2);
    let src_reg = register(&src_ctx, &mut src);
    let serving = Progress::start(&src_ctx, "ucx-test-gone").unwrap();
    let mut dst = vec![0u8; MIB];
    let dst_reg = Arc::new(landing(&dst_ctx, &mut dst));
    let key = src_reg.pack_rkey().unwrap();
    let mut r = Remote::connect(&dst_ctx, serving.address(), &key, dst_reg).unwrap();
    r.get(&mut dst, src_reg.base(), Duration::from_secs(5))
        .unwrap();
    drop(serving); // its worker (and connections) are destroyed
    let limit = Duration::from_millis(500);
    let t = Instant::now();
    let r2 = r.get(&mut dst, src_reg.base(), limit);
    assert!(r2.is_err(), "a GET from a destroyed worker succeeded");
    assert!(t.elapsed() < limit * 3, "took {:?}", t.elapsed());
}

#[test]
fn re_registration_gives_a_fresh_key_that_reads_the_same_memory() {
    let (src_ctx, dst_ctx) = (tcp(), tcp());
    let mut src = pattern(2 * MIB, 3);
    let first = register(&src_ctx, &mut src);
    let old_key = first.pack_rkey().unwrap();
    drop(first); // unmapped: the old key is revoked where the transport enforces keys
    let second = register(&src_ctx, &mut src);
    let new_key = second.pack_rkey().unwrap();
    assert!(!new_key.0.is_empty() && !old_key.0.is_empty());
    let serving = Progress::start(&src_ctx, "ucx-test-remap").unwrap();
    let mut dst = vec![0u8; 2 * MIB];
    let dst_reg = Arc::new(landing(&dst_ctx, &mut dst));
    let mut r = Remote::connect(&dst_ctx, serving.address(), &new_key, dst_reg).unwrap();
    r.get(&mut dst, second.base(), Duration::from_secs(5))
        .unwrap();
    assert!(dst == src);
}

#[test]
fn keys_and_addresses_never_print_and_cuda_memory_is_refused_as_not_built() {
    let ctx = tcp();
    let mut buf = vec![0u8; 4096];
    let reg = register(&ctx, &mut buf);
    let key = reg.pack_rkey().unwrap();
    assert_eq!(
        format!("{key:?}"),
        format!("PackedRkey(<{} bytes>)", key.0.len())
    );
    let w = Worker::new(&ctx).unwrap();
    let a = w.address().unwrap();
    assert_eq!(
        format!("{a:?}"),
        format!("WorkerAddress(<{} bytes>)", a.0.len())
    );
    assert!(reg.contains(reg.base(), 4096) && !reg.contains(reg.base() + 1, 4096));
    // SAFETY: refused before anything is registered.
    let e = unsafe {
        Region::map(
            &ctx,
            buf.as_mut_ptr(),
            4096,
            MemoryKind::Cuda { device: 0 },
            Access::RemoteRead,
        )
    }
    .unwrap_err();
    assert!(e.to_string().contains("not built"), "{e}");
    assert!(
        Context::version().starts_with("1."),
        "{}",
        Context::version()
    );
}

#[test]
fn many_gets_in_flight_at_once_each_land_byte_identical_under_their_tag() {
    let (src_ctx, dst_ctx) = (tcp(), tcp());
    let mut src = pattern(16 * MIB, 5);
    let src_reg = register(&src_ctx, &mut src);
    let serving = Progress::start(&src_ctx, "ucx-test-many").unwrap();
    let mut dst = vec![0u8; 16 * MIB];
    let dst_reg = Arc::new(landing(&dst_ctx, &mut dst));
    let key = src_reg.pack_rkey().unwrap();
    let mut r = Remote::connect(&dst_ctx, serving.address(), &key, dst_reg).unwrap();
    let base = dst.as_mut_ptr();
    // Posted back to front, all before any is waited for.
    for i in (0..16u64).rev() {
        let at = i as usize * MIB;
        // SAFETY: `dst` outlives every GET (all land below) and is not touched meanwhile.
        unsafe { r.post_get(base.add(at), MIB, src_reg.base() + at as u64, i) }.unwrap();
    }
    assert_eq!(r.in_flight(), 16);
    let mut seen = Vec::new();
    while r.in_flight() > 0 {
        let (tag, res) = r.land_one(Duration::from_secs(5)).expect("lands in time");
        res.unwrap();
        seen.push(tag);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..16).collect::<Vec<_>>());
    assert!(dst == src, "landed bytes differ from the source's");
    assert!(
        r.land_one(Duration::from_millis(10)).is_none(),
        "nothing left"
    );
}

#[test]
fn gets_in_flight_to_a_frozen_peer_are_all_given_back_by_abandon() {
    let (src_ctx, dst_ctx) = (tcp(), tcp());
    let mut src = pattern(4 * MIB, 6);
    let src_reg = register(&src_ctx, &mut src);
    let frozen = Worker::new(&src_ctx).unwrap();
    let mut dst = vec![0u8; 4 * MIB];
    let dst_reg = Arc::new(landing(&dst_ctx, &mut dst));
    let key = src_reg.pack_rkey().unwrap();
    let mut r = Remote::connect(&dst_ctx, &frozen.address().unwrap(), &key, dst_reg).unwrap();
    let base = dst.as_mut_ptr();
    for i in 0..4u64 {
        let at = i as usize * MIB;
        // SAFETY: `dst` outlives the GETs: abandon below gives every one back (asserted).
        unsafe { r.post_get(base.add(at), MIB, src_reg.base() + at as u64, i) }.unwrap();
    }
    let limit = Duration::from_millis(300);
    let t = Instant::now();
    assert!(
        r.land_one(limit).is_none(),
        "a GET from a frozen peer landed"
    );
    let kept = r.abandon(limit);
    assert!(kept.is_empty(), "UCX kept GETs {kept:?}");
    assert!(t.elapsed() < limit * 3, "took {:?}", t.elapsed());
    assert_eq!(r.in_flight(), 0);
    // SAFETY: as above; the endpoint is closed, so this fails at once.
    let e = unsafe { r.post_get(base, MIB, src_reg.base(), 9) }.unwrap_err();
    assert!(matches!(e, UcxError::Closed(_)), "{e}");
}

#[test]
fn registrations_are_never_remote_writable_and_local_ones_pack_no_key() {
    use crate::sys;
    assert_eq!(
        Access::RemoteRead.prot(),
        sys::UCP_MEM_MAP_PROT_LOCAL_READ
            | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
            | sys::UCP_MEM_MAP_PROT_REMOTE_READ
    );
    assert_eq!(
        Access::Local.prot(),
        sys::UCP_MEM_MAP_PROT_LOCAL_READ | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
    );
    for a in [Access::RemoteRead, Access::Local] {
        assert_eq!(a.prot() & sys::UCP_MEM_MAP_PROT_REMOTE_WRITE, 0, "{a:?}");
    }
    let ctx = tcp();
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives the region.
    let local = unsafe {
        Region::map(
            &ctx,
            buf.as_mut_ptr(),
            buf.len(),
            MemoryKind::Host,
            Access::Local,
        )
    }
    .unwrap();
    assert_eq!(local.access(), Access::Local);
    assert!(matches!(local.pack_rkey(), Err(UcxError::Invalid(_))));
    assert!(register(&ctx, &mut buf).pack_rkey().is_ok());
}
