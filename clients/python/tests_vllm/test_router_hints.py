"""Router hints through vLLM: a Dynamo `kv.fetch` envelope in the request's `kv_transfer_params`
makes the scheduler-side lookup start the daemon's pull from the named peer; the request waits
(None from get_num_new_matched_tokens) until the pulled blocks are local, then loads them. A
hint naming a dead peer costs at most the daemon's declared timeout, then the prefix is computed.
"""

import time

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from conftest import BLOCK, Daemon, free_port, make_request, make_scheduler, vllm_config
from test_scheduler_side import deposit, present, prompt


def envelope(port: int, block_hashes) -> dict:
    """Dynamo's kv.fetch hint (interop.md §3), with vLLM's own KV-event hashes."""
    return {"protocol_version": "0.1", "message_id": "m-1", "actions": [{
        "action_id": "a-1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": f"tcp://127.0.0.1:{port}", "mode": "copy",
                    "block_hashes": [maybe_convert_block_hash(h) for h in block_hashes]}}]}


def schedule_until(s, req_id: str, limit_s: float):
    t0 = time.perf_counter()
    nones = 0
    while time.perf_counter() - t0 < limit_s:
        out = s.schedule()
        if req_id in out.num_scheduled_tokens:
            return out, nones, time.perf_counter() - t0
        nones += 1
        time.sleep(0.005)
    raise AssertionError(f"{req_id} not scheduled within {limit_s}s")


def test_kv_fetch_hint_pulls_the_prefix_from_the_peer_then_loads_it(tmp_path, model_dir):
    pa, dead = free_port(), free_port()
    a = Daemon(tmp_path / "a", extra=("--peer-listen", f"127.0.0.1:{pa}", "--advertise", f"tcp://127.0.0.1:{pa}", "--peer-keyless-serves-every-local-user"))
    b = Daemon(tmp_path / "b", extra=("--peers", f"tcp://127.0.0.1:{pa},tcp://127.0.0.1:{dead}"))
    try:
        s = make_scheduler(vllm_config(model_dir, b.socket, lookup_wait_ms=0))
        spec = s.connector.spec
        toks = prompt(21, 6)
        probe = make_request("probe", toks)
        deposit(a.socket, spec, probe.block_hashes[:4])
        assert present(b.socket, spec, probe.block_hashes) == 0

        # Dynamo's envelope, directly in kv_transfer_params (the OpenAI field of the same name).
        req = make_request("hinted", toks, kv_transfer_params=envelope(pa, probe.block_hashes[:4]))
        s.add_request(req)
        out, nones, _ = schedule_until(s, "hinted", 10)
        assert out.num_scheduled_tokens["hinted"] == len(toks) - 4 * BLOCK
        assert [len(m.block_ids) for m in out.kv_connector_metadata.plan.loads] == [4]
        assert present(b.socket, spec, probe.block_hashes) == 4, "pulled blocks are local on B"
        assert s.connector.sched.lookup.served >= 1

        # The same hint under "kv_router_hint", naming a daemon that is not there: a bounded miss.
        toks2 = prompt(22, 3)
        probe2 = make_request("probe2", toks2)
        deposit(a.socket, spec, probe2.block_hashes)
        req2 = make_request("deadpeer", toks2,
                            kv_transfer_params={"kv_router_hint": envelope(dead, probe2.block_hashes)})
        s.add_request(req2)
        out, _, took = schedule_until(s, "deadpeer", 10)
        assert out.num_scheduled_tokens["deadpeer"] == len(toks2), "dead peer: the prefix is computed"
        assert out.kv_connector_metadata.plan.loads == []
        c = s.connector.sched.lookup
        assert took < 3.0, f"a dead peer held the request {took:.2f}s"
        assert c.served >= 2
    finally:
        a.stop()
        b.stop()
