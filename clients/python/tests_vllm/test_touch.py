"""The vLLM connector touches the blocks vLLM's own prefix cache holds, inside a real vLLM 0.33.0
Scheduler, against real daemons; the daemon's `stats` DRAM `touched` counter is the witness.

A first request fills vLLM's prefix cache with its 4 blocks; a second request shares them and
has 2 more, all 6 in the daemon: its lookup (num_computed_tokens = 4 blocks) must touch exactly
the 4 local blocks (every segment) and load the other 2. With `touch_gpu_hits: false` nothing is
touched; with the daemon gone the request is still scheduled and the failed touch is counted.
Run: `KVNODE_BIN=... <vllm venv>/bin/python -m pytest clients/python/tests_vllm/test_touch.py`.
"""

import time

from conftest import BLOCK, EOS, make_request, make_scheduler, runner_output, vllm_config
from kvnode.vllm.keys import digest_of
from kvnode.wire import Connection
from test_scheduler_side import deposit, prompt


def dram_touched(socket: str) -> int:
    c = Connection(socket)
    try:
        return next(t for t in c.stats()["tiers"] if t["tier"] == "dram")["touched"]
    finally:
        c.close()


def settled(lookup, want: int, timeout: float = 10.0) -> dict:
    """The lookup thread's touch counters once `want` touches were answered or failed."""
    deadline = time.time() + timeout
    while True:
        t = lookup.touches.totals()
        if t["touches"] + t["touch_errors"] >= want or time.time() > deadline:
            return t
        time.sleep(0.01)


def barrier(lookup) -> bool:
    """Waits until every job queued on the lookup thread so far ran (the queue is FIFO)."""
    return lookup.submit(f"barrier{time.monotonic_ns()}", [], None).done.wait(10)


def cached_then_extended(s, seed: int):
    """Runs a 4-block request to the end (vLLM's prefix cache keeps its blocks) and returns a
    second request sharing those 4 blocks, with 2 more whole blocks and a 3-token tail."""
    first = make_request(f"first{seed}", prompt(seed, 4, tail=0) + [7, 8, 9])
    s.add_request(first)
    out = s.schedule()
    s.update_from_output(out, runner_output([first], token=EOS))
    return make_request(f"second{seed}", prompt(seed, 4, tail=0) + prompt(seed + 100, 2))


def test_lookup_touches_exactly_the_blocks_vllm_holds(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    nseg = len(s.connector.spec["segments"])
    second = cached_then_extended(s, 31)
    deposit(daemon.socket, s.connector.spec, second.block_hashes[:6])
    lookup = s.connector.sched.lookup
    assert barrier(lookup) and lookup.touches.totals()["touches"] == 0, "the first request had no local hits"
    before = dram_touched(daemon.socket)
    s.add_request(second)
    out = s.schedule()
    # vLLM computed blocks 0..3 itself; kvnode loads 4 and 5.
    assert second.num_computed_tokens == len(second.prompt_token_ids)
    assert out.num_scheduled_tokens["second31"] == len(second.prompt_token_ids) - 6 * BLOCK
    ids = s.kv_cache_manager.get_block_ids("second31")[0]
    (load,) = out.kv_connector_metadata.plan.loads
    assert load.digests == [digest_of(h) for h in second.block_hashes[4:6]] and load.block_ids == ids[4:6]
    t = settled(lookup, 1)
    assert dram_touched(daemon.socket) - before == 4 * nseg, "the daemon refreshed blocks 0..3"
    assert t == {"touches": 1, "touched_keys": 4 * nseg, "touch_errors": 0}, t
    stats = s.connector.get_kv_connector_stats().data
    assert (stats["touches"], stats["touched_blocks"]) == (1, 4)


def test_touches_are_off_with_touch_gpu_hits_false(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000, touch_gpu_hits=False))
    second = cached_then_extended(s, 41)
    deposit(daemon.socket, s.connector.spec, second.block_hashes[:6])
    before = dram_touched(daemon.socket)
    s.add_request(second)
    out = s.schedule()
    assert len(out.kv_connector_metadata.plan.loads[0].digests) == 2
    assert barrier(s.connector.sched.lookup)
    assert dram_touched(daemon.socket) == before
    assert s.connector.sched.lookup.touches.totals()["touches"] == 0


def test_a_failed_touch_is_counted_and_the_request_still_runs(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    second = cached_then_extended(s, 51)
    daemon.stop()  # the daemon is gone: the lookup answers 0 and the touch fails
    s.add_request(second)
    t0 = time.perf_counter()
    out = s.schedule()
    assert time.perf_counter() - t0 < 2.0
    assert out.num_scheduled_tokens["second51"] == len(second.prompt_token_ids) - 4 * BLOCK
    assert out.kv_connector_metadata.plan.loads == []
    t = settled(s.connector.sched.lookup, 1)
    assert t["touches"] == 0 and t["touch_errors"] == 1, t


# -- the secondary tier: vLLM's own `touch` seam (TieringOffloadingManager.touch) -------------

def test_tier_answers_vllms_touch_with_a_daemon_touch_of_those_chunks(daemon, model_dir):
    """vLLM 0.33's OffloadingConnector never calls the manager's `touch`; when vLLM does (its
    base class: "blocks cached by the GPU prefix cache"), the manager forwards it to every tier
    and the kvnode tier touches the chunks it holds (here 4 of the 5 keys, a leading run)."""
    from vllm.v1.kv_offload.base import ReqContext

    from tier_env import Engine, counters, keys_and_rows

    e = Engine(model_dir, daemon.socket)
    off = Engine(model_dir, daemon.socket, tier={"touch_gpu_hits": False})
    try:
        keys, rows, _ = keys_and_rows(4)
        e.store(keys, rows)
        absent, _, _ = keys_and_rows(1)
        before = dram_touched(daemon.socket)
        ctx = ReqContext(req_id="gpu-hits")
        with e.m.lock:
            e.m.on_new_request(ctx)
            e.m.touch(keys + absent, ctx)
        assert e.tier._sender.drain(10)
        assert dram_touched(daemon.socket) - before == 4
        c = counters(e.m.get_stats())
        assert (c["vllm:kv_offload_kvnode_touches"], c["vllm:kv_offload_kvnode_touched_keys"]) == (1, 4)
        with off.m.lock:
            off.m.on_new_request(ctx)
            off.m.touch(keys, ctx)
        assert off.tier._sender.drain(10)
        assert dram_touched(daemon.socket) - before == 4, "touch_gpu_hits false: nothing sent"
        assert off.tier.touches.totals()["touches"] == 0
    finally:
        e.close()
        off.close()
