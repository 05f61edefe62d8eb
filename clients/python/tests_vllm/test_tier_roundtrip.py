"""KvnodeTier inside vLLM 0.33's real OffloadingConnector / TieringOffloadingManager, real daemons.

The connector is built from a VllmConfig naming the tier by `type` and `module_path`, as an
operator configures it; rows are written into the real primary tier (the /dev/shm region vLLM
maps), cascaded to kvnode by the manager, evicted from the primary tier and promoted back."""

import time

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tier_env import ROW, Engine, counters, keys_and_rows


def test_the_tier_loads_by_module_path_in_a_real_offloading_connector(daemon, model_dir):
    e = Engine(model_dir, daemon.socket)
    try:
        assert type(e.sched.connector).__name__ == "OffloadingConnector"
        assert type(e.tier).__name__ == "KvnodeTier" and isinstance(e.tier, SecondaryTierManager)
        assert e.tier.block_size_bytes == ROW
        assert e.tier.copy_mode == "region", "vLLM's primary tier is /dev/shm: zero copy"
        tiers = e.sched.vllm_config.kv_transfer_config.kv_connector_extra_config["secondary_tiers"]
        defs = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": tiers})
        assert "vllm:kv_offload_kvnode_load_blocks" in defs
        assert defs["vllm:kv_offload_kvnode_load_blocks"].labelnames == ("tier",)
    finally:
        e.close()


@pytest.mark.parametrize("copy", ["region", "arena"])
def test_store_evict_from_the_primary_tier_then_load_back_byte_identical(daemon, model_dir, copy):
    e = Engine(model_dir, daemon.socket, chunks=8, tier={"copy": copy})
    try:
        assert e.tier.copy_mode == copy
        keys, rows, _ = keys_and_rows(6)
        e.store(keys, rows)
        assert not e.failed_loads() and all(r.success for r in e.finished), e.finished
        filler, frows, _ = keys_and_rows(8)
        e.store(filler, frows)  # 8 chunks: every first-round key is evicted from the primary
        ctx = ReqContext(req_id="back")
        with e.m.lock:
            e.m.on_new_request(ctx)
        assert not any(e.in_primary(k, ctx) for k in keys), "evicted from the primary tier"
        hits, steps, _ = e.lookup(keys, ctx)
        assert hits == 6 and steps >= 2, (hits, steps)  # retry, promotion pending, then hit
        assert e.read_loaded(keys, ctx) == rows
        loads = [r for r in e.finished if r.transfer_bytes == 6 * ROW]
        assert loads and all(r.success for r in loads)
        c = counters(e.m.get_stats())
        assert c["vllm:kv_offload_kvnode_load_blocks"] == 6
        assert c["vllm:kv_offload_kvnode_store_blocks"] == 14
        assert c["vllm:kv_offload_kvnode_lookup_hits"] >= 6
        with e.m.lock:
            e.m.on_request_finished(ctx)
    finally:
        e.close()


def test_two_engines_on_one_daemon_share_blocks_and_other_models_do_not(daemon, model_dir):
    a = Engine(model_dir, daemon.socket)
    b = Engine(model_dir, daemon.socket)
    other = Engine(model_dir, daemon.socket, tier={"model_name": "another-model"})
    try:
        keys, rows, _ = keys_and_rows(4)
        a.store(keys, rows)
        ctx = ReqContext(req_id="b-1")
        with b.m.lock:
            b.m.on_new_request(ctx)
        hits, _, _ = b.lookup(keys, ctx)
        assert hits == 4
        assert b.read_loaded(keys, ctx) == rows
        octx = ReqContext(req_id="o-1")
        with other.m.lock:
            other.m.on_new_request(octx)
        assert other.lookup(keys, octx)[0] == 0, "another namespace shares nothing"
        # A key absent from kvnode ends the prefix: MISS, no job.
        ctx2 = ReqContext(req_id="b-2")
        missing, _, _ = keys_and_rows(1)
        with b.m.lock:
            b.m.on_new_request(ctx2)
            assert b.m.lookup(missing[0], ctx2) is LookupResult.RETRY
        assert b.lookup(missing + keys, ctx2)[0] == 0
    finally:
        for e in (a, b, other):
            e.close()


def test_a_request_through_vllms_scheduler_gets_its_prefix_from_kvnode(daemon, model_dir):
    """The whole scheduler path: OffloadingConnectorScheduler's lookups (None until decided),
    the promotion from kvnode into the primary tier, then the request scheduled with the loaded
    prefix counted as computed and a load planned from the primary tier."""
    from vllm.v1.kv_offload.base import make_offload_key

    from conftest import BLOCK, make_request
    from test_scheduler_side import prompt

    a = Engine(model_dir, daemon.socket)
    b = Engine(model_dir, daemon.socket, extra={"sync_load_budget_bytes": 1 << 20})  # load before the forward
    try:
        toks = prompt(7, 4)
        req = make_request("sched", toks)
        keys = [make_offload_key(h, 0) for h in req.block_hashes[:4]]
        _, rows, _ = keys_and_rows(4)
        a.store(keys, rows)
        b.sched.add_request(req)
        for step in range(500):
            out = b.sched.schedule()
            if "sched" in out.num_scheduled_tokens:
                break
            time.sleep(0.005)
        else:
            raise AssertionError("request never scheduled")
        assert step >= 1, "the first steps wait for the tier's lookup and promotion"
        assert out.num_scheduled_tokens["sched"] == len(toks) - 4 * BLOCK
        assert out.kv_connector_metadata is not None
        check = ReqContext(req_id="check")
        assert b.read_loaded(keys, check) == rows, "the primary tier holds kvnode's bytes"
    finally:
        a.close()
        b.close()
