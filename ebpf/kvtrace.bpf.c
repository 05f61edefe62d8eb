// kvtrace BPF programs: kvnode USDT probes and io_uring raw tracepoints -> log2 latency
// histograms in maps, stall events in a ring buffer. Built by tools/kvtrace/build.rs.
// Client ops take one probe hit each (op_done carries the daemon's latency) and land in a
// per-CPU array: no hash update, no ring buffer output on the hot path.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/usdt.bpf.h>
#include "kvtrace.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

/* Completed ops slower than this emit a KVT_EV_OP_SLOW event (0 = never). */
const volatile __u64 op_slow_ns = 0;
/* 1: op latency measured in the kernel from op_start to op_done (op_start attached too). */
const volatile __u8 pair_ops = 0;
/* 1: stall / lease events go to the ring buffer (kvtrace stalls); else they are only counted. */
const volatile __u8 events_on = 0;
/* 1: every traced daemon's op_done note is kvnode_proto::obs::OP_DONE_X86_ARGS (argument i in
 * the i-th of rdi rsi rdx rcx r8 r9 r10 r11): read them from ctx, not through the USDT spec. */
const volatile __u8 op_done_regs = 0;
/* 1: one daemon traced: its op histograms start at op_hists[0], no cookie lookup. */
const volatile __u8 one_daemon = 0;
/* io_uring completions slower than this emit KVT_EV_URING_SLOW (0 = io_uring not traced). */
const volatile __u64 uring_slow_ns = 0;

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, struct kvt_hist_key);
    __type(value, struct kvt_hist);
} hists SEC(".maps");

/* Client op histograms: index = USDT cookie (the daemon's index in kvtrace's pid list) *
 * KVT_OPS + op code. kvtrace sizes it to KVT_OPS x daemons before loading. */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, KVT_OPS);
    __type(key, __u32);
    __type(value, struct kvt_hist);
} op_hists SEC(".maps");

/* Op start times, only with pair_ops (kvtrace sizes it to 1 otherwise). */
struct op_key { __u32 tgid; __u32 pad; __u64 conn; __u64 req; };

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 65536);
    __type(key, struct op_key);
    __type(value, __u64);
} inflight SEC(".maps");

/* Traced processes (filled by kvtrace): io_uring tracepoints are global. */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 256);
    __type(key, __u32);
    __type(value, __u8);
} pids SEC(".maps");

struct uring_start { __u64 ts; __u32 tgid; __u32 pad; };

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 65536);
    __type(key, __u64);
    __type(value, struct uring_start);
} uring_inflight SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, KVT_C_N);
    __type(key, __u32);
    __type(value, __u64);
} counters SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, 256 * 1024);
} events SEC(".maps");

static const struct kvt_hist zero_hist;

static __always_inline __u32 tgid(void) { return bpf_get_current_pid_tgid() >> 32; }

/* floor(log2(v)), 0 for v <= 1. Branchless: clang 14 rejects a 63-step loop here. */
static __always_inline __u32 log2_u64(__u64 v) {
    __u32 r, s;
    r = (v > 0xFFFFFFFFULL) << 5; v >>= r;
    s = (v > 0xFFFF) << 4; v >>= s; r |= s;
    s = (v > 0xFF) << 3; v >>= s; r |= s;
    s = (v > 0xF) << 2; v >>= s; r |= s;
    s = (v > 0x3) << 1; v >>= s; r |= s;
    r |= (__u32)(v >> 1);
    return r;
}

static __always_inline void count(__u32 idx, __u64 n) {
    __u64 *c = bpf_map_lookup_elem(&counters, &idx);
    if (c) __sync_fetch_and_add(c, n);
}

/* Atomic even in per-CPU values: a uprobe program runs with migration, not preemption, off. */
static __always_inline void add(struct kvt_hist *h, __u64 ns, __u64 bytes) {
    __u32 slot = log2_u64(ns) & (KVT_SLOTS - 1);
    __sync_fetch_and_add(&h->slots[slot], 1);
    __sync_fetch_and_add(&h->count, 1);
    __sync_fetch_and_add(&h->sum_ns, ns);
    __sync_fetch_and_add(&h->bytes, bytes);
    if (ns > h->max_ns) h->max_ns = ns; /* racy max: good enough for a display */
}

static __always_inline void record(__u32 pid, __u32 kind, __u32 sub, __u32 aux, __u64 ns, __u64 bytes) {
    struct kvt_hist_key k = { .tgid = pid, .kind = kind, .sub = sub, .aux = aux };
    struct kvt_hist *h = bpf_map_lookup_elem(&hists, &k);
    if (!h) {
        bpf_map_update_elem(&hists, &k, &zero_hist, BPF_NOEXIST);
        h = bpf_map_lookup_elem(&hists, &k);
        if (!h) return;
    }
    add(h, ns, bytes);
}

static __always_inline void emit(__u32 kind, __u32 pid, __u64 a, __u64 b, __u64 c, __u64 d, __u64 e) {
    if (!events_on) return;
    struct kvt_event *ev = bpf_ringbuf_reserve(&events, sizeof(*ev), 0);
    if (!ev) { count(KVT_C_EV_DROPPED, 1); return; }
    ev->kind = kind; ev->tgid = pid; ev->ts_ns = bpf_ktime_get_ns();
    ev->a = a; ev->b = b; ev->c = c; ev->d = d; ev->e = e;
    bpf_ringbuf_submit(ev, 0);
}

SEC("usdt")
int BPF_USDT(op_start, __u64 conn, __u64 req, __u32 op, __u32 ns, __u32 pages) {
    struct op_key k = { .tgid = tgid(), .conn = conn, .req = req };
    __u64 now = bpf_ktime_get_ns();
    bpf_map_update_elem(&inflight, &k, &now, BPF_ANY);
    return 0;
}

/* op_done argument positions (engine/core/src/probes/mod.rs). Through the USDT spec each read
 * costs a spec lookup and a helper call, so the hot path reads only the three it needs. */
#define OPD_CONN 0
#define OPD_REQ 1
#define OPD_OP 2
#define OPD_BYTES 5
#define OPD_STATUS 6
#define OPD_LATENCY 7

static __always_inline __u64 usdt_arg(struct pt_regs *ctx, __u64 i) {
    long v = 0;
    bpf_usdt_arg(ctx, i, &v);
    return v;
}

static __always_inline __u64 op_done_arg(struct pt_regs *ctx, int i) {
    if (!op_done_regs) return usdt_arg(ctx, i);
    switch (i) {
    case 0: return ctx->di;
    case 1: return ctx->si;
    case 2: return ctx->dx;
    case 3: return ctx->cx;
    case 4: return ctx->r8;
    case 5: return ctx->r9;
    case 6: return ctx->r10;
    default: return ctx->r11;
    }
}

SEC("usdt")
int op_done(struct pt_regs *ctx) {
    __u32 op = op_done_arg(ctx, OPD_OP);
    __u64 bytes = op_done_arg(ctx, OPD_BYTES);
    __u64 lat = op_done_arg(ctx, OPD_LATENCY);
    if (pair_ops) {
        struct op_key k = {
            .tgid = tgid(), .conn = op_done_arg(ctx, OPD_CONN), .req = op_done_arg(ctx, OPD_REQ)
        };
        __u64 *t0 = bpf_map_lookup_elem(&inflight, &k);
        if (t0) {
            lat = bpf_ktime_get_ns() - *t0;
            bpf_map_delete_elem(&inflight, &k);
        } else {
            count(KVT_C_UNMATCHED, 1);
        }
    }
    __u32 i = (one_daemon ? 0 : (__u32)bpf_usdt_cookie(ctx) * KVT_OPS) + (op & (KVT_OPS - 1));
    struct kvt_hist *h = bpf_map_lookup_elem(&op_hists, &i);
    if (h) add(h, lat, bytes);
    if (op_slow_ns && lat > op_slow_ns) {
        count(KVT_C_OP_SLOW, 1);
        emit(KVT_EV_OP_SLOW, tgid(), op, op_done_arg(ctx, OPD_CONN), lat,
             op_done_arg(ctx, OPD_REQ), op_done_arg(ctx, OPD_STATUS));
    }
    return 0;
}

SEC("usdt")
int evict(struct pt_regs *ctx) {
    count(KVT_C_EVICT, 1);
    count(KVT_C_EVICT_BYTES, usdt_arg(ctx, 2)); /* tier, ns, bytes */
    return 0;
}

SEC("usdt")
int BPF_USDT(lease_overdue, __u64 conn, __u64 lease, __u64 pages, __u64 age_ns) {
    count(KVT_C_LEASE_OVERDUE, 1);
    emit(KVT_EV_LEASE, tgid(), 0, conn, age_ns, lease, pages);
    return 0;
}

SEC("usdt")
int BPF_USDT(stall, __u32 kind, __u64 id, __u64 age_ns, __u64 detail) {
    count(KVT_C_STALL, 1);
    emit(KVT_EV_STALL, tgid(), kind, id, age_ns, detail, 0);
    return 0;
}

SEC("usdt")
int BPF_USDT(spill_complete, __u32 dir, __u64 id, __u64 bytes, __s64 status, __u64 ns) {
    record(tgid(), KVT_SPILL, 1, dir, ns, bytes);
    return 0;
}

SEC("usdt")
int BPF_USDT(peer_pull_done, __u32 peer, __u64 id, __u32 pages, __u64 bytes, __u32 status, __u64 ns) {
    record(tgid(), KVT_PEER, peer, status, ns, bytes);
    return 0;
}

SEC("usdt")
int BPF_USDT(promote, __u32 ns_handle, __u64 bytes, __u64 ns) {
    record(tgid(), KVT_PROMOTE, 0, 0, ns, bytes);
    return 0;
}

/* Counters only: no argument is read. */
SEC("usdt")
int demote(struct pt_regs *ctx) {
    count(KVT_C_DEMOTE, 1);
    return 0;
}

SEC("usdt")
int cancel(struct pt_regs *ctx) {
    count(KVT_C_CANCEL, 1);
    return 0;
}

SEC("usdt")
int fence(struct pt_regs *ctx) {
    count(KVT_C_FENCE, 1);
    return 0;
}

/* Raw tracepoints need no tracefs. io_uring_submit_req(req); io_uring_complete(ctx, req, ...):
 * `req` is the same pointer and its position is stable across kernels 5.19 .. 6.18. */
SEC("raw_tp/io_uring_submit_req")
int uring_submit(struct bpf_raw_tracepoint_args *ctx) {
    if (!uring_slow_ns) return 0;
    __u32 pid = tgid();
    if (!bpf_map_lookup_elem(&pids, &pid)) return 0;
    __u64 req = ctx->args[0];
    struct uring_start st = { .ts = bpf_ktime_get_ns(), .tgid = pid };
    bpf_map_update_elem(&uring_inflight, &req, &st, BPF_ANY);
    return 0;
}

SEC("raw_tp/io_uring_complete")
int uring_complete(struct bpf_raw_tracepoint_args *ctx) {
    if (!uring_slow_ns) return 0;
    __u64 req = ctx->args[1];
    struct uring_start *st = bpf_map_lookup_elem(&uring_inflight, &req);
    if (!st) return 0; /* not one of ours (completion may run in any task's context) */
    __u64 lat = bpf_ktime_get_ns() - st->ts;
    __u32 pid = st->tgid;
    bpf_map_delete_elem(&uring_inflight, &req);
    record(pid, KVT_URING, 0, 0, lat, 0);
    if (lat > uring_slow_ns) {
        count(KVT_C_URING_SLOW, 1);
        emit(KVT_EV_URING_SLOW, pid, 0, req, lat, 0, 0);
    }
    return 0;
}
