//! The daemon's USDT probes (provider `kvnode`): one function per probe, a nop until traced.
//!
//! Every probe point in kvnode goes through this module so that `docs/observability.md`,
//! `ebpf/kvtrace.bpf.c` and the code agree. Arguments are integers only (USDT); codes are
//! [`kvnode_proto::obs`] values. Probes survive `strip` (they live in `.note.stapsdt`).
//! Latencies are nanoseconds, measured by the caller with a monotonic clock.

use kvnode_proto::obs::{OpKind, OpStatus, StallKind, TierCode};

pub(crate) mod site;

/// A client op began: connection id, request id, op, namespace handle, pages (keys).
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn op_start(conn: u64, req: u64, op: OpKind, ns: u32, pages: u32) {
    site::usdt!(kvnode, op_start, conn, req, op.code(), ns, pages);
}

/// A client op ended (its reply is written): bytes moved, status, latency since `op_start`.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
#[expect(clippy::too_many_arguments, reason = "one USDT argument per field")]
pub fn op_done(
    conn: u64,
    req: u64,
    op: OpKind,
    ns: u32,
    pages: u32,
    bytes: u64,
    status: OpStatus,
    latency_ns: u64,
) {
    site::usdt!(
        kvnode,
        op_done,
        conn,
        req,
        op.code(),
        ns,
        pages,
        bytes,
        status.code(),
        latency_ns
    );
}

/// A block was evicted from `tier` to make room.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn evict(tier: TierCode, ns: u32, bytes: u64) {
    site::usdt!(kvnode, evict, tier.code(), ns, bytes);
}

/// A lease is held past `lease_age_limit_s` (fired once per lease).
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn lease_overdue(conn: u64, lease: u64, pages: u64, age_ns: u64) {
    site::usdt!(kvnode, lease_overdue, conn, lease, pages, age_ns);
}

/// Something stopped making progress: what, its id (connection, peer, queue...), how long
/// it has been stuck, and one kind-specific detail (op code, queue depth, ...).
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn stall(kind: StallKind, id: u64, age_ns: u64, detail: u64) {
    site::usdt!(kvnode, stall, kind.code(), id, age_ns, detail);
}

/// Spill I/O direction argument.
pub const SPILL_READ: u32 = 0;
/// Spill I/O direction argument.
pub const SPILL_WRITE: u32 = 1;

/// A spill read or write was submitted (`dir` = [`SPILL_READ`] / [`SPILL_WRITE`]).
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn spill_submit(dir: u32, id: u64, bytes: u64) {
    site::usdt!(kvnode, spill_submit, dir, id, bytes);
}

/// A spill read or write completed: `status` is 0 or a negative errno.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn spill_complete(dir: u32, id: u64, bytes: u64, status: i64, latency_ns: u64) {
    site::usdt!(kvnode, spill_complete, dir, id, bytes, status, latency_ns);
}

/// A pull from peer index `peer` began.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn peer_pull_start(peer: u32, id: u64, pages: u32) {
    site::usdt!(kvnode, peer_pull_start, peer, id, pages);
}

/// A pull from a peer ended with `status` (an [`OpStatus`] code).
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn peer_pull_done(
    peer: u32,
    id: u64,
    pages: u32,
    bytes: u64,
    status: OpStatus,
    latency_ns: u64,
) {
    site::usdt!(
        kvnode,
        peer_pull_done,
        peer,
        id,
        pages,
        bytes,
        status.code(),
        latency_ns
    );
}

/// A block left DRAM for a lower tier.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn demote(ns: u32, bytes: u64) {
    site::usdt!(kvnode, demote, ns, bytes);
}

/// A block came back into DRAM; latency of the read that brought it.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn promote(ns: u32, bytes: u64, latency_ns: u64) {
    site::usdt!(kvnode, promote, ns, bytes, latency_ns);
}

/// A client cancelled request `req` covering `pages`.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn cancel(conn: u64, req: u64, pages: u32) {
    site::usdt!(kvnode, cancel, conn, req, pages);
}

/// The cancel fence of `req` returned: nothing writes its buffers any more.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn fence(conn: u64, req: u64, latency_ns: u64) {
    site::usdt!(kvnode, fence, conn, req, latency_ns);
}

/// A fetch plan was answered: keys the daemon could serve, keys planned, the reason
/// (`kvnode_proto::plan::PlanReason`: all 0, slower 1, probe 2, nothing 3) and the predicted
/// microseconds to fetch the planned keys and to recompute them instead.
#[inline(never)] // one probe site per probe: a discarded inlined copy leaves a bogus USDT note
pub fn plan(
    conn: u64,
    ns: u32,
    available: u32,
    keys: u32,
    reason: u32,
    fetch_us: u64,
    recompute_us: u64,
) {
    site::usdt!(
        kvnode,
        plan,
        conn,
        ns,
        available,
        keys,
        reason,
        fetch_us,
        recompute_us
    );
}

/// A stable 64-bit name hash (FNV-1a), used to number peers in probes.
pub fn hash_name(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn op_done_note_names_the_fixed_registers_kvtrace_reads() {
        op_done(1, 2, OpKind::Get, 3, 4, 5, OpStatus::Ok, 6);
        let exe = std::fs::read("/proc/self/exe").unwrap();
        let note = format!("kvnode\0op_done\0{}\0", kvnode_proto::obs::OP_DONE_X86_ARGS);
        assert!(exe.windows(note.len()).any(|w| w == note.as_bytes()));
    }
}
