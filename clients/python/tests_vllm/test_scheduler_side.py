"""KvnodeConnector's scheduler side inside a real vLLM 0.33.0 Scheduler, against real daemons.

Blocks are deposited in the daemon under the namespace and keys the connector derives (what a
worker's offload stores), then requests go through vLLM's own scheduling loop: matched-token
counts, the onload plan (which vLLM blocks receive which kvnode blocks), the offload plan,
deferred frees, pending lookups, router hints and refusals are checked on what vLLM does.
"""

import os
import signal
import time

import pytest
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from conftest import (BLOCK, EOS, kv_cache_config, make_request, make_scheduler, runner_output,
                      vllm_config)
from kvnode.vllm.config import ConfigError
from kvnode.vllm.keys import digest_of
from kvnode.vllm.plan import BlockMove
from kvnode.wire import Connection


def deposit(socket: str, spec: dict, block_hashes, fill: int = 0x5A) -> int:
    """Stores whole blocks under the connector's namespace, as a worker offload would."""
    c = Connection(socket)
    try:
        ns = c.register(spec)["ns"]
        keys = [[digest_of(h), s] for h in block_hashes for s in range(len(spec["segments"]))]
        sizes = [spec["segments"][k[1]] for k in keys]
        res = c.put(ns, keys, [bytes([fill]) * n for n in sizes])
        assert set(res) <= {"Stored", "Exists"}, res
        return ns
    finally:
        c.close()


def present(socket: str, spec: dict, block_hashes) -> int:
    c = Connection(socket)
    try:
        ns = c.register(spec)["ns"]
        return c.exists(ns, [[digest_of(h), 0] for h in block_hashes])
    finally:
        c.close()


def prompt(seed: int, blocks: int, tail: int = 3):
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(blocks * BLOCK + tail)]


def free_blocks(s) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_blocks_in_the_daemon_are_matched_and_planned_into_the_allocated_vllm_blocks(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    conn = s.connector
    req = make_request("a", prompt(1, 5), max_tokens=40)  # 83 tokens: 5 full blocks
    deposit(daemon.socket, conn.spec, req.block_hashes[:3])
    s.add_request(req)
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == len(req.prompt_token_ids) - 3 * BLOCK
    assert req.num_computed_tokens == len(req.prompt_token_ids)
    assert out.has_sync_kv_loads, "vLLM runs start_load_kv before this step's forward"
    plan = out.kv_connector_metadata.plan
    ids = s.kv_cache_manager.get_block_ids("a")[0]
    digests = [digest_of(h) for h in req.block_hashes]
    assert plan.loads == [BlockMove("a", digests[:3], ids[:3])]
    # Blocks 3 and 4 become full in this step, but they were computed on top of the loaded
    # blocks: they are offered only once the step's outcome is back (no load error), i.e. in
    # the next step; 0..2 are in kvnode already. Block 5 is offered when it fills.
    assert plan.saves == []
    saves = []
    for step in range(BLOCK):
        s.update_from_output(out, runner_output([req], token=9))
        out = s.schedule()
        saves.append(out.kv_connector_metadata.plan.saves)
        assert not out.kv_connector_metadata.plan.loads
    ids = s.kv_cache_manager.get_block_ids("a")[0]
    digests = [digest_of(h) for h in req.block_hashes]
    assert saves[0] == [BlockMove("a", digests[3:5], ids[3:5])]
    assert [m for st in saves[1:] for m in st] == [BlockMove("a", [digests[5]], [ids[5]])]


def test_a_failed_load_is_recomputed_and_only_then_offloaded(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    req = make_request("e", prompt(12, 5), max_tokens=8)  # 83 tokens: 5 full blocks
    d = [digest_of(h) for h in req.block_hashes]
    deposit(daemon.socket, s.connector.spec, req.block_hashes[:3])
    s.add_request(req)
    out = s.schedule()
    ids = s.kv_cache_manager.get_block_ids("e")[0]
    assert out.kv_connector_metadata.plan.loads == [BlockMove("e", d[:3], ids[:3])]
    assert out.kv_connector_metadata.plan.saves == []
    # A worker reports block 1 of the load failed (say, evicted between lookup and onload).
    s.update_from_output(out, runner_output([req], invalid_block_ids={ids[1]}))
    assert req.num_computed_tokens == BLOCK, "vLLM keeps only the blocks before the failed one"
    out = s.schedule()
    assert out.num_scheduled_tokens["e"] == len(req.prompt_token_ids) - BLOCK
    plan = out.kv_connector_metadata.plan
    assert plan.loads == []
    # Blocks 1..4 are recomputed in this step and offered once (never the step-1 versions).
    assert plan.saves == [BlockMove("e", d[1:5], ids[1:5])]


def test_with_async_scheduling_offloads_wait_until_the_load_steps_output_is_back(daemon, model_dir):
    vc = vllm_config(model_dir, daemon.socket, async_scheduling=True, lookup_wait_ms=5000)
    s = make_scheduler(vc)
    assert vc.max_concurrent_batches == 2 and s.connector.sched.steps_in_flight == 2
    req = make_request("as", prompt(13, 5), max_tokens=40)
    deposit(daemon.socket, s.connector.spec, req.block_hashes[:3])
    s.add_request(req)
    out1 = s.schedule()
    assert len(out1.kv_connector_metadata.plan.loads) == 1
    out2 = s.schedule()  # built before step 1's output (and any load error) is back
    assert out2.kv_connector_metadata.plan.saves == []
    s.update_from_output(out1, runner_output([req], token=9))
    out3 = s.schedule()
    ids = s.kv_cache_manager.get_block_ids("as")[0]
    assert out3.kv_connector_metadata.plan.saves == [
        BlockMove("as", [digest_of(h) for h in req.block_hashes[3:5]], ids[3:5])]


def test_a_prompt_entirely_in_the_daemon_leaves_one_token_to_compute(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    req = make_request("full", prompt(2, 4, tail=0))  # exactly 4 blocks
    deposit(daemon.socket, s.connector.spec, req.block_hashes)
    s.add_request(req)
    out = s.schedule()
    assert out.num_scheduled_tokens["full"] == 1
    plan = out.kv_connector_metadata.plan
    assert len(plan.loads[0].block_ids) == 4, "the last block is loaded whole, its last token recomputed"


def test_local_prefix_hits_are_not_reloaded_and_misses_load_nothing(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    first = make_request("p1", prompt(3, 4))
    deposit(daemon.socket, s.connector.spec, first.block_hashes[:2])
    s.add_request(first)
    out = s.schedule()
    assert out.num_scheduled_tokens["p1"] == len(first.prompt_token_ids) - 2 * BLOCK
    s.update_from_output(out, runner_output([first], token=EOS))
    # Same prompt again: vLLM's own prefix cache has all 4 blocks; kvnode only 2 (and the 2
    # just offloaded are not in the daemon: no worker ran). Nothing is loaded from kvnode.
    again = make_request("p2", prompt(3, 4))
    s.add_request(again)
    out = s.schedule()
    assert out.num_scheduled_tokens["p2"] == len(again.prompt_token_ids) - 4 * BLOCK
    assert out.kv_connector_metadata.plan.loads == []
    miss = make_request("p3", prompt(4, 3))
    s.add_request(miss)
    out = s.schedule()
    assert out.num_scheduled_tokens["p3"] == len(miss.prompt_token_ids)
    assert out.kv_connector_metadata.plan.loads == []


def test_pending_lookup_returns_none_without_blocking_the_scheduler(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=0))
    req = make_request("slow", prompt(5, 4))
    deposit(daemon.socket, s.connector.spec, req.block_hashes[:3])
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # the daemon answers nothing until SIGCONT
    try:
        s.add_request(req)
        t0 = time.perf_counter()
        for _ in range(3):
            out = s.schedule()
            assert "slow" not in out.num_scheduled_tokens, "scheduled before kvnode answered"
        assert s.connector.get_num_new_matched_tokens(req, 0) == (None, False)
        took = time.perf_counter() - t0
        assert took < 1.0, f"three scheduler steps took {took:.3f}s with the daemon stopped"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert s.connector.sched.lookup.get("slow").done.wait(10)
    out = s.schedule()
    assert out.num_scheduled_tokens["slow"] == len(req.prompt_token_ids) - 3 * BLOCK
    assert s.connector.sched.pending_answers >= 4


def test_finished_request_keeps_its_blocks_until_workers_report_the_offloads(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    total = free_blocks(s)
    req = make_request("done", prompt(6, 3), max_tokens=1)
    s.add_request(req)
    out = s.schedule()
    assert [len(m.block_ids) for m in out.kv_connector_metadata.plan.saves] == [3]
    s.update_from_output(out, runner_output([req], token=EOS))
    assert req.is_finished()
    held = total - free_blocks(s)
    assert held == 4, "3 full blocks + the tail block stay allocated while offloads run"
    for _ in range(2):  # workers have not finished: still held
        out = s.schedule()
        s.update_from_output(out, runner_output([]))
        assert total - free_blocks(s) == held
    out = s.schedule()
    s.update_from_output(out, runner_output([], finished_sending={"done"}))
    assert free_blocks(s) == total, "blocks freed once the workers reported the offloads done"
    assert not s.connector.sched.awaiting_free


def test_a_request_that_offloaded_nothing_is_freed_at_once(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, kv_role="kv_consumer", lookup_wait_ms=5000))
    total = free_blocks(s)
    req = make_request("ro", prompt(7, 3), max_tokens=1)
    s.add_request(req)
    out = s.schedule()
    assert out.kv_connector_metadata.plan.saves == []
    s.update_from_output(out, runner_output([req], token=EOS))
    assert free_blocks(s) == total


def test_cache_salt_separates_keys_and_router_hashes_are_vllms_event_hashes(daemon, model_dir):
    toks = prompt(8, 3)
    a, b, c = (make_request("s1", toks, cache_salt="tenant-a"), make_request("s2", toks, cache_salt="tenant-b"),
               make_request("s3", toks, cache_salt="tenant-a"))
    assert [digest_of(h) for h in a.block_hashes] == [digest_of(h) for h in c.block_hashes]
    assert not set(map(digest_of, a.block_hashes)) & set(map(digest_of, b.block_hashes))
    for h in a.block_hashes:
        assert int.from_bytes(digest_of(h)[:8], "big") == maybe_convert_block_hash(h)
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    deposit(daemon.socket, s.connector.spec, a.block_hashes)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens["s2"] == len(toks), "another salt never hits"


def test_reset_prefix_cache_clears_the_namespace_in_the_daemon(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    req = make_request("r", prompt(9, 3))
    deposit(daemon.socket, s.connector.spec, req.block_hashes)
    assert present(daemon.socket, s.connector.spec, req.block_hashes) == 3
    assert s.reset_prefix_cache(reset_connector=True)
    assert present(daemon.socket, s.connector.spec, req.block_hashes) == 0


def test_hybrid_models_and_bad_config_are_refused_with_the_reason(daemon, model_dir):
    kcc = kv_cache_config()
    full = kcc.kv_cache_groups[0]
    swa = KVCacheGroupSpec(["model.layers.1.self_attn.attn"], SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=full.kv_cache_spec.dtype, sliding_window=64))
    kcc.kv_cache_groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full.kv_cache_spec), swa]
    with pytest.raises(ValueError, match="2 KV cache groups"):
        make_scheduler(vllm_config(model_dir, daemon.socket), kcc)
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys"):
        make_scheduler(vllm_config(model_dir, daemon.socket, sokcet="/x"))
    assert isinstance(full.kv_cache_spec, FullAttentionSpec)


def test_a_dead_daemon_means_compute_not_stall(tmp_path, model_dir):
    s = make_scheduler(vllm_config(model_dir, str(tmp_path / "nobody.sock"), lookup_wait_ms=5000))
    req = make_request("nodaemon", prompt(10, 3))
    s.add_request(req)
    t0 = time.perf_counter()
    out = s.schedule()
    assert time.perf_counter() - t0 < 1.0
    assert out.num_scheduled_tokens["nodaemon"] == len(req.prompt_token_ids)
    assert out.kv_connector_metadata.plan.loads == []
