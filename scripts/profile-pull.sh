#!/usr/bin/env bash
# Where a peer pull's CPU time goes, per daemon (issue 24 §1): `kvnode bench pull` runs 64 x 1 MiB
# pulls between two daemons it starts; in a window in the middle of them `perf record` samples
# both daemons' threads (user and kernel), `perf stat` counts their syscalls and context
# switches, and the daemons' own counters give the blocks pulled. Prints, per daemon, CPU-s per
# pulled GB split by what the samples were doing, and syscalls / context switches per block.
# Needs perf (linux-perf), iperf3 not used. Root (or perf_event_paranoid <= 1).
# Usage: scripts/profile-pull.sh [BIN] [CONNECTIONS] [SERVE_FLAG...]
#   e.g. scripts/profile-pull.sh target/release/kvnode 1 --cluster-key=/tmp/key
set -euo pipefail
cd "$(dirname "$0")/.."
DEFAULT_CONNECTIONS=1
source scripts/lib-pull.sh
pull_args "$@"
tmp=$(mktemp -d /tmp/kvnode-pull-prof.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT
WINDOW=${WINDOW:-5}
pull_start "$tmp"
i0=$(pull_inserts)
ev=task-clock,context-switches,raw_syscalls:sys_enter
perf stat -x, -e "$ev" -p "$src" -o "$tmp/src.stat" -- sleep "$WINDOW" &
s1=$!
perf stat -x, -e "$ev" -p "$dst" -o "$tmp/dst.stat" -- sleep "$WINDOW" &
s2=$!
perf record -q -F 1999 -p "$src" -o "$tmp/src.data" -- sleep "$WINDOW" 2>/dev/null &
r1=$!
perf record -q -F 1999 -p "$dst" -o "$tmp/dst.data" -- sleep "$WINDOW" 2>/dev/null
wait "$s1" "$s2" "$r1"
i1=$(pull_inserts)
kill "$bench" "$src" "$dst" 2>/dev/null || true
wait "$bench" 2>/dev/null || true
for d in src dst; do
  perf report -i "$tmp/$d.data" --stdio --no-children --sort sym -F overhead,sym \
    --percent-limit 0 2>/dev/null >"$tmp/$d.samples"
done
python3 - "$src" "$dst" "$((i1 - i0))" "$tmp" "$WINDOW" <<'PY'
import collections, re, sys
src, dst, blocks, tmp, window = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
gb = blocks * 1048576 / 1e9
CATS = [  # first match wins
    ("BLAKE3 (hash of each pulled byte; source: first pull only)", r"blake3"),
    # This VM has no PMU: perf samples on cpu-clock (an hrtimer), so time spent with interrupts
    # off is charged to the place they come back on (spin_unlock_irq*, softirq exit).
    ("locks, wake-ups, vCPU kicks (irq-off time lands here)", r"spin_unlock_irq|spin_lock|queued_spin|kvm_kick|pv_native|safe_halt|^try_to_wake|wake_up|^__wake|^ttwu"),
    ("softirq: loopback TCP receive processing", r"handle_softirqs|__do_softirq|net_rx_action"),
    ("AES-GCM (sealed headers; bodies when encrypted)", r"aes|gcm|ghash|polyval|gf128"),
    ("kernel copy user<->socket", r"copy_user|_copy_to_iter|_copy_from_iter|copyout|copyin|rep_movs|copy_page_to_iter|copy_page_from_iter|skb_copy_datagram|memcpy_orig|memcpy_erms|csum_partial_copy"),
    ("user memcpy/memset", r"^(__)?mem(cpy|move|set)|__memcpy|__memmove|__memset"),
    ("TCP/IP stack (loopback, both directions)", r"^tcp_|^__tcp|^ip_|^__ip|^ipv4|skb|^__netif|^netif|^net_rx|^__napi|^napi|loopback|^__dev_|^dev_|^sock_|^__sock|^inet_|^__inet|^sk_|^__sk|^lock_sock|^release_sock|^tcp|^nf_|^__kfree_skb|^kfree_skb|^validate_xmit|^process_backlog|^__local_bh|^do_softirq|^__do_softirq|^irq_exit|^raw_local|^sch_direct|^qdisc|^__qdisc|^pfifo|^ktime_get|^bpf_|^neigh_|^eth_|^__x86_indirect"),
    ("syscall entry/exit, fd lookup, readiness", r"entry_SYSCALL|syscall_exit|do_syscall|^__x64_sys|^__sys_|^ksys_|^__fget|^fget|^fput|^__fdget|^vfs_|^sock_read|^sock_write|^sockfd|^import_iovec|^rw_copy|^__import|^iovec|^_copy_from_user|^syscall_|^exit_to_user|^__rseq|^rseq|^switch_fpu|^restore_fpregs|^ep_|^__ep|^do_epoll|^sys_epoll|^mio::|^tokio::io|epoll"),
    ("scheduler, wake-ups, futexes", r"schedule|^__schedule|wake_up|^try_to_wake|futex|^pick_next|^finish_task|^enqueue|^dequeue|^update_(curr|load|cfs)|^select_task|^ttwu|^__switch_to|^switch_mm|^psi_|^cpuacct|^native_sched|^prepare_task|^set_next|^put_prev|^__update|^reweight|^check_preempt|^resched|^idle|^mwait|^hrtimer|^__hrtimer|^tick_|^sched_|^newidle|^load_balance|^update_rq|^__wake|^autoremove_wake|^wait_woken|^sk_wait|^parking_lot|^std::sys::pal::unix::futex|^std::thread::park|^tokio::runtime::park"),
    ("memory: allocation, page faults", r"malloc|^free$|^cfree|^_int_|^__libc_|^tcache|^kmem_|^kmalloc|^kfree|^__kmalloc|^alloc_pages|^__alloc|^get_page|^__free|^free_|^page_|^__page|^rmqueue|^__rmqueue|^handle_mm|^do_fault|^__handle_mm|^exc_page_fault|^do_user_addr|^clear_page|^__mod_|^mod_|^memcg|^__memcg|^refill|^try_charge|^uncharge|^folio|^__folio|^lru_|^__lru|^release_pages|^__count_memcg|^obj_cgroup|^mem_cgroup|^__get_user_pages|^__mm_"),
    ("tokio runtime", r"^tokio::|^<tokio::"),
]
cre = [(n, re.compile(p)) for n, p in CATS]
counts = {src: collections.Counter(), dst: collections.Counter()}
syms = {src: collections.Counter(), dst: collections.Counter()}
line_re = re.compile(r"^\s*([0-9.]+)%\s+\[[.k]\]\s+(.*?)\s*$")
for pid, which in ((src, "src"), (dst, "dst")):
    for line in open(f"{tmp}/{which}.samples", errors="replace"):
        m = line_re.match(line)
        if not m:
            continue
        share, sym = float(m.group(1)), m.group(2)
        for n, r in cre:
            if r.search(sym):
                counts[pid][n] += share
                break
        else:
            counts[pid]["other"] += share
        syms[pid][sym] += share
def stat(path):
    out = {}
    for l in open(path):
        f = l.strip().split(",")
        if len(f) > 2 and f[0] and f[0][0].isdigit():
            out[f[2]] = float(f[0])
    return out
print(f"pulled {blocks} blocks of 1 MiB in the {window:.0f} s window: {gb / window:.2f} GB/s")
for name, pid in (("source", src), ("destination", dst)):
    st = stat(f"{tmp}/{'src' if pid == src else 'dst'}.stat")
    cpu = st.get("task-clock", 0) / 1e3
    tot = sum(counts[pid].values()) or 1
    print(f"\n{name} (pid {pid}): {cpu:.2f} CPU-s = {cpu / gb:.3f} CPU-s/GB; "
          f"{st.get('raw_syscalls:sys_enter', 0) / max(blocks, 1):.1f} syscalls and "
          f"{st.get('context-switches', 0) / max(blocks, 1):.2f} context switches per block")
    for n, c in counts[pid].most_common():
        print(f"  {100 * c / tot:5.1f} %  {cpu / gb * c / tot:.3f} CPU-s/GB  {n}")
    print("  top symbols: " + "; ".join(f"{s} {100 * c / tot:.1f} %" for s, c in syms[pid].most_common(8)))
PY
