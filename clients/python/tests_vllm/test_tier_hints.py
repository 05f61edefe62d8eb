"""Router hints through the kvnode tier: a request whose ReqContext.kv_hints carries Dynamo's
kv.fetch (vLLM's KvHintsEnvelope, as the in-tree kvcr tier reads it) makes the daemon pull the
named peer's blocks; they then load like local hits. A frozen peer (SIGSTOP) costs at most
`hint_wait_s`, then the prefix is computed and no load job is submitted."""

import signal

from vllm.v1.kv_offload.base import ReqContext

from conftest import Daemon, free_port
from tier_env import Engine, counters, freeze, hint_envelope, keys_and_rows


def test_a_hinted_request_pulls_from_a_second_daemon_and_a_frozen_peer_is_a_bounded_miss(tmp_path, model_dir):
    pa = free_port()
    a = Daemon(tmp_path / "a", extra=("--peer-listen", f"127.0.0.1:{pa}", "--advertise", f"tcp://127.0.0.1:{pa}", "--peer-keyless-serves-every-local-user"))
    b = Daemon(tmp_path / "b", extra=("--peers", f"tcp://127.0.0.1:{pa}"))
    ea = Engine(model_dir, a.socket)
    eb = Engine(model_dir, b.socket, tier={"hint_wait_s": 1.5})
    try:
        keys, rows, hashes = keys_and_rows(5)
        ea.store(keys, rows)
        plain = ReqContext(req_id="plain")
        with eb.m.lock:
            eb.m.on_new_request(plain)
        assert eb.lookup(keys, plain)[0] == 0, "not on B without a hint"

        ctx = ReqContext(req_id="hinted", kv_hints=hint_envelope(pa, hashes))
        with eb.m.lock:
            eb.m.on_new_request(ctx)
        hits, _, _ = eb.lookup(keys, ctx)
        assert hits == 5
        assert eb.read_loaded(keys, ctx) == rows, "pulled blocks loaded byte-identical"
        c = counters(eb.m.get_stats())
        assert c["vllm:kv_offload_kvnode_hinted_pulls"] == 1
        assert c["vllm:kv_offload_kvnode_hinted_pulled_blocks"] == 5

        keys2, rows2, hashes2 = keys_and_rows(3)
        ea.store(keys2, rows2)
        freeze(a.proc)
        try:
            jobs_before = len(eb.finished)
            frozen = ReqContext(req_id="frozen", kv_hints=hint_envelope(pa, hashes2))
            with eb.m.lock:
                eb.m.on_new_request(frozen)
            hits, _, took = eb.lookup(keys2, frozen)
            assert hits == 0, f"a frozen peer is a miss: the prefix is computed ({took:.2f}s, {counters(eb.m.get_stats())})"
            assert took < 1.5 + 2.0, f"the frozen peer held the lookup {took:.2f}s"
            assert len(eb.finished) == jobs_before, "no load job for a prefix that is not local"
        finally:
            a.proc.send_signal(signal.SIGCONT)
    finally:
        ea.close()
        eb.close()
        a.stop()
        b.stop()
