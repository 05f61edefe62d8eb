/* Structs and codes shared by the BPF programs and kvtrace's `abi.rs` (keep both in step;
 * `abi.rs` has size tests). Codes match docs/observability.md and kvnode_proto::obs. */
#ifndef KVTRACE_H
#define KVTRACE_H

#define KVT_SLOTS 64
#define KVT_OPS 16 /* op codes (1..13) per daemon in op_hists */

/* hist_key.kind */
#define KVT_OP 1      /* client op (op_hists, not hists): sub = op code */
#define KVT_SPILL 2   /* spill io: sub = tier (1 = nvme), aux = 0 read / 1 write */
#define KVT_PEER 3    /* peer pull: sub = peer index, aux = status */
#define KVT_URING 4   /* io_uring request, submit -> complete (kernel tracepoints) */
#define KVT_PROMOTE 5 /* promotion into DRAM: sub = 0 */

/* event.kind */
#define KVT_EV_STALL 1         /* daemon `stall` probe: a = stall kind, b = id, c = age ns, d = detail */
#define KVT_EV_LEASE 2         /* daemon `lease_overdue`: a = 0, b = conn, c = age ns, d = lease, e = pages */
#define KVT_EV_OP_SLOW 3       /* op done slower than --op-slow: a = op, b = conn, c = latency ns, d = req, e = status */
#define KVT_EV_URING_SLOW 4    /* io_uring completion slower than --uring-slow: c = latency ns, e = res */

/* counters[] index */
#define KVT_C_UNMATCHED 0  /* pair_ops: op_done without op_start (attached mid-op): daemon latency used */
#define KVT_C_EVICT 1
#define KVT_C_EVICT_BYTES 2
#define KVT_C_LEASE_OVERDUE 3
#define KVT_C_STALL 4
#define KVT_C_EV_DROPPED 5
#define KVT_C_DEMOTE 6
#define KVT_C_CANCEL 7
#define KVT_C_FENCE 8
#define KVT_C_URING_SLOW 9
#define KVT_C_OP_SLOW 10
#define KVT_C_N 16

struct kvt_hist_key {
    __u32 tgid;
    __u32 kind;
    __u32 sub;
    __u32 aux;
};

struct kvt_hist {
    __u64 slots[KVT_SLOTS]; /* slot i counts latencies in [2^i, 2^(i+1)) ns; slot 0 also 0 */
    __u64 count;
    __u64 sum_ns;
    __u64 bytes;
    __u64 max_ns;
};

struct kvt_event {
    __u32 kind;
    __u32 tgid;
    __u64 ts_ns; /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
    __u64 a;
    __u64 b;
    __u64 c;
    __u64 d;
    __u64 e;
};

#endif
