"""Failures of the kvnode tier end in a failed job and a recompute, never in a wrong hit: a daemon
killed or frozen (SIGSTOP) between the lookup and the load, and a spill file corrupted on disk
under a block that only the NVMe tier holds."""

import signal
import time

from vllm.v1.kv_offload.base import ReqContext

from conftest import Daemon
from tier_env import Engine, freeze, keys_and_rows, until_promotions_pending


def _evicted(e, n):
    keys, rows, _ = keys_and_rows(n)
    e.store(keys, rows)
    filler, frows, _ = keys_and_rows(8)
    e.store(filler, frows)
    ctx = ReqContext(req_id="r")
    with e.m.lock:
        e.m.on_new_request(ctx)
    assert not any(e.in_primary(k, ctx) for k in keys)
    return keys, rows, ctx


def _assert_recomputed(e, keys, ctx, n_failed):
    failed = e.failed_loads()
    assert len(failed) == 1 and failed[0].successful_keys is None, failed
    hits, _, _ = e.lookup(keys, ctx)
    assert hits == 0, "a failed load is a miss: vLLM recomputes the prefix"
    assert not any(e.in_primary(k, ctx) for k in keys), "no failed row became a primary hit"
    c = e.tier.get_stats().reduce()
    assert c["vllm:kv_offload_kvnode_load_failed_blocks:('1:KvnodeTier',)"] == n_failed


def test_a_daemon_killed_before_the_load_fails_the_job_and_vllm_recomputes(daemon, model_dir):
    e = Engine(model_dir, daemon.socket, chunks=8)
    try:
        keys, _, ctx = _evicted(e, 4)
        until_promotions_pending(e, keys, ctx)
        daemon.proc.kill()
        daemon.proc.wait()
        e.settle()
        _assert_recomputed(e, keys, ctx, 4)
    finally:
        e.close()


def test_a_frozen_daemon_fails_the_load_after_the_io_timeout(daemon, model_dir):
    e = Engine(model_dir, daemon.socket, chunks=8, tier={"io_timeout_s": 1.0})
    try:
        keys, _, ctx = _evicted(e, 4)
        until_promotions_pending(e, keys, ctx)
        freeze(daemon.proc)
        try:
            t0 = time.monotonic()
            e.settle()
            took = time.monotonic() - t0
            assert 0.9 < took < 5.0, f"the frozen daemon held the load {took:.2f}s"
            _assert_recomputed(e, keys, ctx, 4)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        e.close()


def _spill_daemon(tmp):
    return Daemon(tmp, extra=("--spill-dir", str(tmp / "spill"), "--spill-size", "16MiB",
                              "--spill-engine", "psync"))


def test_a_corrupted_spill_file_fails_only_that_block_and_it_is_recomputed(tmp_path, model_dir):
    (tmp_path / "d" / "spill").mkdir(parents=True)
    d = _spill_daemon(tmp_path / "d")
    e = Engine(model_dir, d.socket, chunks=8)
    e2 = None
    try:
        keys, rows, _ = keys_and_rows(4)
        e.store(keys, rows)
        d.proc.send_signal(signal.SIGTERM)  # flushes every DRAM block to the spill file, exits
        d.proc.wait(30)
        d.log.close()
        d = _spill_daemon(tmp_path / "d")  # cold DRAM: the blocks are on the NVMe tier only
        spill = tmp_path / "d" / "spill" / "kvnode-spill.dat"
        data = spill.read_bytes()
        at = data.find(rows[0][:256])
        assert at >= 0 and data.find(rows[0][:256], at + 1) < 0, "block 0's payload found once"
        with open(spill, "r+b") as f:  # one flipped byte under the running daemon
            f.seek(at + 1000)
            b = f.read(1)
            f.seek(at + 1000)
            f.write(bytes([b[0] ^ 0xFF]))
            f.flush()
        e2 = Engine(model_dir, d.socket, chunks=8)
        ctx = ReqContext(req_id="r")
        with e2.m.lock:
            e2.m.on_new_request(ctx)
        until_promotions_pending(e2, keys, ctx)  # the index still lists all four blocks
        e2.settle()
        failed = e2.failed_loads()
        assert len(failed) == 1 and set(failed[0].successful_keys) == set(keys[1:]), failed
        hits, _, _ = e2.lookup(keys, ctx)
        assert hits == 0, "block 0 is a miss: the whole prefix is recomputed"
        assert not e2.in_primary(keys[0], ctx)
        assert e2.read_loaded(keys[1:], ctx) == rows[1:], "the intact blocks loaded byte-identical"
    finally:
        e.close()
        if e2 is not None:
            e2.close()
        d.stop()
