"""`Touch` from Python: the SGLang backend touches the pages SGLang already holds, and the op
holds up against hostile input, against real daemons; the daemon's `stats` DRAM `touched`
counter is the witness.

SGLang: its own lookup loop (`HiCacheController._storage_hit_query`, sglang 0.5.23) asks the
backend in batches of STORAGE_BATCH_SIZE pages, each later batch's `prefix_keys` extended by the
batch before; only the first batch's prefix (the pages matched on device and host) is touched,
once. Attack: keys never stored, a run with a gap, a namespace that does not exist or belongs to
another tenant, malformed keys, a key list near and over the daemon's 16 MiB frame limit, and the
integrations' MAX_TOUCH_KEYS bound; the daemon keeps serving after each.
Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_touch.py`.
"""

import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import (STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo,
                                                  PoolTransferResult)
from sglang.srt.mem_cache.utils import get_storage_hash_str

import sglang_pools as sp
from conftest import Daemon
from kvnode import touch as touch_mod
from kvnode.touch import MAX_TOUCH_KEYS, TouchLog
from kvnode.wire import MAX_HEADER, Connection, KvnodeError, touched_count
from test_sglang_backend import storage

SLOT = 4096


def dram(c: Connection) -> dict:
    return next(t for t in c.stats()["tiers"] if t["tier"] == "dram")


def touched(socket: str) -> int:
    c = Connection(socket)
    try:
        return dram(c)["touched"]
    finally:
        c.close()


def chain(pages: int, seed: int = 0):
    """(tokens, SGLang's storage page hashes of them) for `pages` pages of 4 tokens."""
    tokens = [(seed * 7919 + i * 131) % 150_000 for i in range(4 * pages)]
    return tokens, get_storage_hash_str(tokens, None, page_size=4)


def stored(s, hashes):
    """Stores pages under the backend's KV namespace, as an earlier batch_set would."""
    b = s._binding("kv")
    c = Connection(s.socket_path)
    try:
        res = c.put(b.ns, b.keys(hashes), [bytes(b.page_bytes // b.seg_n)] * (len(hashes) * b.seg_n))
        assert set(res) <= {"Stored", "Exists"}, res
    finally:
        c.close()


def sglang_lookup(s, tokens, matched_pages: int, prefix_keys):
    """SGLang's own L3 lookup of the tokens after the `matched_pages` it holds (device + host):
    the real `_storage_hit_query` on a controller that only has the backend and page size."""
    ctl = SimpleNamespace(storage_backend=s, page_size=4)
    last = get_storage_hash_str(tokens[:4 * matched_pages], None, page_size=4)[-1]
    op = SimpleNamespace(last_hash=last, token_ids=tokens[4 * matched_pages:], prefix_keys=prefix_keys,
                         kv_hints=None)
    return HiCacheController._storage_hit_query(ctl, op)


# -- SGLang ----------------------------------------------------------------------------------

def test_sglang_lookup_touches_the_pages_sglang_holds_once_per_lookup(daemon):
    s = storage(daemon, sp.mha_pool())
    assert s.touch_local_hits
    tokens, hashes = chain(5 + STORAGE_BATCH_SIZE + 2, seed=1)
    held, new = hashes[:5], hashes[5:]
    # SGLang holds 5 pages; the daemon holds those 5 and the next batch, so SGLang asks a second
    # batch whose prefix_keys are the 5 plus the first batch (L3 pages, not SGLang's hits).
    stored(s, held + new[:STORAGE_BATCH_SIZE])
    before = touched(daemon.socket)
    found, _ = sglang_lookup(s, tokens, 5, list(held))
    assert found == new[:STORAGE_BATCH_SIZE]
    assert touched(daemon.socket) - before == 5 * s.seg_n
    assert s.touches.totals() == {"touches": 1, "touched_keys": 5 * s.seg_n, "touch_errors": 0}
    # The next lookup of the same request touches again (SGLang still serves those pages).
    sglang_lookup(s, tokens, 5, list(held))
    assert touched(daemon.socket) - before == 10 * s.seg_n


def test_sglang_v2_lookup_touches_the_prefix_too(daemon):
    s = storage(daemon, sp.mha_pool())
    tokens, hashes = chain(6, seed=2)
    stored(s, hashes)
    before = touched(daemon.socket)
    res = s.batch_exists_v2(hashes[3:], [], HiCacheStorageExtraInfo(prefix_keys=hashes[:3]))
    assert isinstance(res, PoolTransferResult) and res.kv_hit_pages == 3, res
    assert touched(daemon.socket) - before == 3 * s.seg_n


def test_sglang_touches_nothing_without_prefix_keys_or_when_turned_off(daemon):
    tokens, hashes = chain(6, seed=3)
    on = storage(daemon, sp.mha_pool())
    off = storage(daemon, sp.mha_pool(), touch_local_hits=False)
    stored(on, hashes)
    before = touched(daemon.socket)
    # SGLang's default (hicache_storage_pass_prefix_keys false): no prefix_keys, nothing to touch.
    assert sglang_lookup(on, tokens, 3, None)[0] == hashes[3:]
    assert sglang_lookup(off, tokens, 3, list(hashes[:3]))[0] == hashes[3:]
    assert touched(daemon.socket) == before
    assert on.touches.totals()["touches"] == 0 and off.touches.totals()["touches"] == 0
    with pytest.raises(ValueError, match="touch_local_hits must be true or false"):
        storage(daemon, sp.mha_pool(), touch_local_hits="yes")


def test_sglang_lookup_with_the_daemon_gone_counts_the_touch_and_raises_only_the_lookup(daemon):
    s = storage(daemon, sp.mha_pool())
    tokens, hashes = chain(4, seed=4)
    daemon.stop()
    with pytest.raises(OSError):
        sglang_lookup(s, tokens, 2, list(hashes[:2]))  # the lookup's own failure, as before
    assert s.touches.totals()["touch_errors"] == 1


# -- the op against hostile input -------------------------------------------------------------

def spec(model: str = "touch-attack") -> dict:
    return {"model": model, "page_size": 4, "segments": [SLOT]}


def keys(n: int, tag: int = 0):
    return [[i.to_bytes(28, "little") + tag.to_bytes(4, "little"), 0] for i in range(n)]


def healthy(socket: str) -> None:
    """A new connection stores and reads a block: the daemon kept serving."""
    c = Connection(socket)
    try:
        ns = c.register(spec("health"))["ns"]
        k = keys(1, tag=0xFEED)
        assert c.put(ns, k, [b"\x01" * SLOT]) in (["Stored"], ["Exists"])
        assert c.get(ns, k) == [b"\x01" * SLOT]
    finally:
        c.close()


def test_touch_counts_only_the_leading_run_held_and_unknown_keys_touch_nothing(daemon):
    c = Connection(daemon.socket)
    ns = c.register(spec())["ns"]
    held = keys(4)
    c.put(ns, held, [bytes(SLOT)] * 4)
    before = dram(c)["touched"]
    assert c.touch(ns, keys(3, tag=9)) == 0, "keys never stored"
    assert c.touch(ns, []) == 0
    assert c.touch(ns, [held[0], keys(1, tag=9)[0], held[1]]) == 1, "the run ends at the gap"
    assert c.touch(ns, held) == 4
    assert dram(c)["touched"] - before == 5
    c.close()


def test_touch_of_a_namespace_that_does_not_exist_is_refused(daemon):
    c = Connection(daemon.socket)
    with pytest.raises(KvnodeError) as e:
        c.touch(0xFFFF_FFF0, keys(2))
    assert e.value.code == "UnknownNamespace"
    assert c.touch(c.register(spec())["ns"], keys(1)) == 0, "the connection stays usable"
    c.close()
    healthy(daemon.socket)


def as_other_tenant(socket: str, job) -> dict:
    """Runs `job(conn)` in a child process as uid 64009 (gid 0: the socket is 0660 root's group)
    and returns what it returned (a dict of ints)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        code = 0
        try:
            os.setgroups([])
            os.setgid(0)
            os.setuid(64009)
            c = Connection(socket)
            out = job(c)
            os.write(w, repr(out).encode())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, repr({"error": repr(e)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return eval(data.decode())  # noqa: S307 - our own child's repr of a dict of ints/strings


def test_touch_of_another_tenants_namespace_is_refused_like_an_unknown_one(tmp_path):
    """Tenant `other` is uid 64009; this root process is tenant `default` (and the operator,
    who sees every counter in `stats`). The socket sits in a 0755 directory outside pytest's
    0700 tree so that uid 64009 can reach it."""
    assert os.geteuid() == 0, "the cross-tenant test forks a child with another uid: run it as root"
    cfg = tmp_path / "kvnode.toml"
    cfg.write_text('[[tenants.tenant]]\nname = "other"\nuids = [64009]\n')
    run = Path(tempfile.mkdtemp(prefix="kvnode-touch-"))
    os.chmod(run, 0o755)
    d = Daemon(run, extra=("--config", str(cfg)))
    try:
        def owner(c):
            ns = c.register(spec("other-tenant"))["ns"]
            k = keys(3, tag=7)
            c.put(ns, k, [bytes(SLOT)] * 3)
            return {"ns": ns, "count": c.touch(ns, k)}

        got = as_other_tenant(d.socket, owner)
        assert got.get("count") == 3, got
        c = Connection(d.socket)
        before = dram(c)["touched"]
        with pytest.raises(KvnodeError) as e:
            c.touch(got["ns"], keys(3, tag=7))
        assert e.value.code == "UnknownNamespace", "another tenant's handle reads as unknown"
        assert dram(c)["touched"] == before, "a refused touch refreshes nothing"
        c.close()
        healthy(d.socket)
    finally:
        d.stop()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(f"{run}-admin", ignore_errors=True)  # the daemon's takeover socket dir


def test_malformed_keys_are_refused_and_the_connection_keeps_serving(daemon):
    c = Connection(daemon.socket)
    ns = c.register(spec())["ns"]
    for bad, why in [([[b"\x00" * 31, 0]], "32 bytes"), ([[b"\x00" * 32]], "2 elements"),
                     ([["not bytes", 0]], "32-byte page digest"), ([[b"\x00" * 32, -1]], "u16")]:
        with pytest.raises(KvnodeError) as e:
            c.touch(ns, bad)
        assert e.value.code == "Malformed" and why in e.value.message, e.value
        assert c.touch(ns, keys(1)) == 0, "the same connection is still served"
    c.close()
    healthy(daemon.socket)


def test_a_huge_key_list_is_answered_or_refused_and_the_daemon_keeps_serving(daemon):
    c = Connection(daemon.socket, timeout=60)
    ns = c.register(spec())["ns"]
    held = keys(2)
    c.put(ns, held, [bytes(SLOT)] * 2)
    # ~14 MiB of header: under the 16 MiB frame limit, answered (the run stops at the first miss).
    big = held + keys(400_000, tag=3)
    t0 = time.perf_counter()
    assert c.touch(ns, big) == 2
    assert time.perf_counter() - t0 < 30
    # ~18 MiB: over the limit; the client refuses to send it, and the connection stays usable.
    with pytest.raises(KvnodeError) as e:
        c.touch(ns, keys(500_000, tag=4))
    assert e.value.code == "FrameTooLarge" and "fewer keys" in e.value.message
    assert c.touch(ns, held) == 2
    # A client that announces such a header anyway loses its own connection, nobody else's.
    raw = Connection(daemon.socket)
    raw.sock.sendall(struct.pack("<II", MAX_HEADER + 1, 0))
    name, body, _ = raw._read_rest(raw._recv_exact(8))
    assert name == "Error" and "frame header length" in body["message"], (name, body)
    assert raw.sock.recv(1) == b"", "then the daemon closes the offending connection"
    raw.close()
    assert c.touch(ns, held) == 2
    c.close()
    healthy(daemon.socket)


def test_integrations_send_at_most_max_touch_keys(daemon, monkeypatch):
    monkeypatch.setattr(touch_mod, "MAX_TOUCH_KEYS", 64)
    c = Connection(daemon.socket)
    ns = c.register(spec())["ns"]
    held = keys(100)
    c.put(ns, held, [bytes(SLOT)] * 100)
    before = dram(c)["touched"]
    log = TouchLog(touch_mod.logging.getLogger("test"))
    assert log.send(c, ns, held * 3) == 64
    assert dram(c)["touched"] - before == 64
    assert len(touch_mod.leading_keys([k[0] for k in held], 3)) == 64
    assert MAX_TOUCH_KEYS == 8192
    c.close()


def test_touched_reply_decoder_accepts_only_a_u32_count():
    assert touched_count("Touched", {"count": 0}) == 0
    assert touched_count("Touched", {"count": (1 << 32) - 1}) == (1 << 32) - 1
    import random
    rng = random.Random(40)
    for _ in range(500):
        n = rng.randrange(1 << 32)
        assert touched_count("Touched", {"count": n}) == n
    for name, body in [("Deleted", {"count": 1}), ("Touched", {}), ("Touched", None),
                       ("Touched", {"count": -1}), ("Touched", {"count": 1 << 32}),
                       ("Touched", {"count": True}), ("Touched", {"count": "3"}),
                       ("Touched", {"count": 1.0}), ("Touched", [1])]:
        with pytest.raises(KvnodeError) as e:
            touched_count(name, body)
        assert e.value.code == "Malformed"
