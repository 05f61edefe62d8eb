"""Router actions other than kv.fetch through vLLM, against a real daemon: a request whose
envelope carries kv.retain, an action kvnode does not know and a kv.retain deferred to
request_completion. The immediate retain reaches the daemon at the request's first lookup (the
connector's on_new_request / get_num_new_matched_tokens, the tier's lookup), the unknown
action's refusal is logged and counted, and the deferred retain runs only once the request ends
(the connector's request_finished, the tier's on_request_finished).

Run: `$(bash scripts/py-venv.sh vllm | tail -1) -m pytest clients/python/tests_vllm/test_router_actions.py`.
"""

import logging
import time

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_hints import KvHintsEnvelope
from vllm.v1.kv_hints.protocol import KvHintAction
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.request import RequestStatus

from conftest import EOS, make_request, make_scheduler, runner_output, vllm_config
from kvnode.vllm_tier.namespace import wire_key
from kvnode.wire import Connection
from test_scheduler_side import deposit, prompt
from tier_env import ROW, Engine, counters, keys_and_rows


def actions(hashes):
    """kv.retain of blocks 0-1 now, an unknown action, kv.retain of blocks 2-3 at completion."""
    routed = [maybe_convert_block_hash(h) for h in hashes]
    return [("keep", "kv.retain", {"block_hashes": routed[:2], "ttl_seconds": 60}),
            ("odd", "kv.unheard", {"block_hashes": routed[:1]}),
            ("later", "kv.retain", {"block_hashes": routed[2:4], "ttl_seconds": 60,
                                    "execute_at": "request_completion"})]


def retained(socket) -> int:
    c = Connection(socket)
    try:
        return next(t for t in c.stats()["tiers"] if t["tier"] == "dram")["retained_blocks"]
    finally:
        c.close()


def until(what, limit_s: float = 10.0):
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < limit_s, "not reached in time"
        time.sleep(0.01)


def refusals(caplog):
    return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


def test_connector_retains_at_arrival_counts_the_unknown_refusal_and_retains_deferred_blocks_after_finish(daemon, model_dir, caplog):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    conn = s.connector
    nseg = len(conn.spec["segments"])
    toks = prompt(41, 5)
    probe = make_request("probe", toks)
    deposit(daemon.socket, conn.spec, probe.block_hashes[:5])
    env = {"protocol_version": "0.1", "message_id": "req-7", "actions": [
        {"action_id": i, "action_type": t, "action_version": "1.0", "payload": p}
        for i, t, p in actions(probe.block_hashes)]}
    req = make_request("acted", toks, max_tokens=40, kv_transfer_params=env)
    log = conn.sched.lookup.actions
    with caplog.at_level(logging.WARNING, logger="kvnode.vllm"):
        s.add_request(req)
        out = s.schedule()
        assert out.num_scheduled_tokens["acted"] == len(toks) - 5 * 16
        until(lambda: log.take()["actions_sent"] == 2)
        assert retained(daemon.socket) == 2 * nseg, "kv.retain ran at the request's first lookup"
        assert log.take() == {"actions_sent": 2, "actions_refused": 1}
        assert len(refusals(caplog)) == 1 and "'odd' (kv.unheard)" in refusals(caplog)[0]
        s.schedule()  # later scheduler calls for the same request send nothing again
        time.sleep(0.2)
        assert log.take() == {"actions_sent": 2, "actions_refused": 1}
        assert retained(daemon.socket) == 2 * nseg, "the request_completion retain waits for the end"

        s.finish_requests("acted", RequestStatus.FINISHED_ABORTED)
        until(lambda: log.take()["actions_sent"] == 3)
    assert retained(daemon.socket) == 4 * nseg, "the deferred kv.retain ran once the request ended"
    assert log.take() == {"actions_sent": 3, "actions_refused": 1}
    stats = conn.get_kv_connector_stats().data
    assert (stats["actions_sent"], stats["actions_refused"]) == (3, 1)
    conn.shutdown()


def test_connector_holds_deferred_actions_until_the_workers_report_the_requests_offloads_done(daemon, model_dir):
    s = make_scheduler(vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000))
    conn = s.connector
    nseg = len(conn.spec["segments"])
    req = make_request("saved", prompt(42, 3), max_tokens=1)
    routed = [maybe_convert_block_hash(h) for h in req.block_hashes]
    req.kv_transfer_params = {"protocol_version": "0.1", "message_id": "req-9", "actions": [
        {"action_id": "later", "action_type": "kv.retain", "action_version": "1.0",
         "payload": {"block_hashes": routed[:2], "ttl_seconds": 60, "execute_at": "request_completion"}}]}
    log = conn.sched.lookup.actions
    s.add_request(req)
    out = s.schedule()
    assert [len(m.block_ids) for m in out.kv_connector_metadata.plan.saves] == [3]
    s.update_from_output(out, runner_output([req], token=EOS))
    assert req.is_finished() and conn.sched.awaiting_free == {"saved"}
    deposit(daemon.socket, conn.spec, req.block_hashes[:3])  # what the workers' offloads store
    out = s.schedule()
    s.update_from_output(out, runner_output([]))
    time.sleep(0.2)
    assert log.take()["actions_sent"] == 0, "sent before the workers reported the offloads done"
    out = s.schedule()
    s.update_from_output(out, runner_output([], finished_sending={"saved"}))
    until(lambda: log.take()["actions_sent"] == 1)
    assert retained(daemon.socket) == 2 * nseg, "the deferred kv.retain found the offloaded blocks"
    conn.shutdown()


def test_tier_retains_at_its_lookup_counts_the_unknown_refusal_and_retains_deferred_blocks_after_finish(daemon, model_dir, caplog):
    e = Engine(model_dir, daemon.socket)
    try:
        keys, rows, hashes = keys_and_rows(5)
        c = Connection(daemon.socket)  # in the daemon (another engine stored them), not in primary
        ns = c.register(e.tier._namespace())["ns"]
        assert c.put(ns, [wire_key(k) for k in keys], rows) == ["Stored"] * 5
        assert len(rows[0]) == ROW
        c.close()
        env = KvHintsEnvelope(protocol_version="0.1", message_id="req-8", actions=[
            KvHintAction(action_id=i, action_type=t, action_version="1.0", payload=p)
            for i, t, p in actions(hashes)])
        ctx = ReqContext(req_id="acted", kv_hints=env)
        with caplog.at_level(logging.WARNING, logger="kvnode.vllm_tier"):
            with e.m.lock:
                e.m.on_new_request(ctx)
            assert retained(daemon.socket) == 0
            assert e.lookup(keys, ctx)[0] == 5
            assert retained(daemon.socket) == 2, "kv.retain ran at the request's tier lookup"
            assert e.tier.actions.take() == {"actions_sent": 2, "actions_refused": 1}
            assert len(refusals(caplog)) == 1 and "'odd' (kv.unheard)" in refusals(caplog)[0]
            e.step()
            time.sleep(0.2)
            assert retained(daemon.socket) == 2, "the request_completion retain waits for the end"

            with e.m.lock:
                e.m.on_request_finished(ctx)
            until(lambda: e.tier.actions.take()["actions_sent"] == 3)
        assert retained(daemon.socket) == 4, "the deferred kv.retain ran once the request ended"
        assert e.tier.actions.take() == {"actions_sent": 3, "actions_refused": 1}
        c = counters(e.m.get_stats())
        assert c["vllm:kv_offload_kvnode_actions_sent"] == 3
        assert c["vllm:kv_offload_kvnode_actions_refused"] == 1
    finally:
        e.close()
