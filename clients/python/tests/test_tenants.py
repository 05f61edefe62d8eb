"""The Python client against a daemon with a tenant map: a tenant without `share_arena` gets no
arena descriptor (`arena_bytes` 0), inline put/get and regions work, alloc is refused with the
reason and the copy path through the arena says why it cannot run, and the namespace id carries the daemon-derived tenant salt.
Run: `pytest clients/python/tests/test_tenants.py` (needs `cargo build --release -p kvnode`)."""

import mmap
import os

import pytest

from conftest import Daemon
from kvnode.transfer import copy_in
from kvnode.wire import Connection, KvnodeError

SLOT = 64 << 10


@pytest.fixture
def tenant_daemon(tmp_path):
    cfg = tmp_path / "kvnode.toml"
    # Nobody is mapped but an unused uid: this client (root) joins the shared tenant `default`,
    # which has no arena mapping under a map.
    cfg.write_text('[[tenants.tenant]]\nname = "other"\nuids = [64009]\n')
    d = Daemon(tmp_path / "d", extra=("--config", str(cfg)))
    yield d
    d.stop()


def spec(salt: str = "") -> dict:
    return {"model": "py-tenant", "page_size": 4, "segments": [SLOT], "tenant_salt": salt}


def test_a_tenant_without_the_arena_works_inline_and_through_regions(tenant_daemon):
    c = Connection(tenant_daemon.socket)
    try:
        assert c.arena is None and c.hello["arena_bytes"] == 0
        ns = c.register(spec("req"))["ns"]
        keys = [[bytes([i]) * 32, 0] for i in range(3)]
        blocks = [bytes([i + 1]) * SLOT for i in range(3)]
        assert c.put(ns, keys, blocks) == ["Stored"] * 3
        assert c.get(ns, keys) == blocks
        with pytest.raises(KvnodeError) as e:
            c.alloc(ns, keys, [SLOT] * 3)
        assert e.value.code == "Unsupported" and "share_arena = false" in str(e.value)
        # A lease get answers presence (SGLang's per-page check) but there is nothing to read.
        lease, extents = c.get_lease(ns, keys)
        assert all(x is not None for x in extents)
        c.release(lease)
        with pytest.raises(KvnodeError) as e:
            copy_in(c, ns, keys, [0, 0, 0], [SLOT] * 3)
        assert e.value.code == "Unsupported"
        # Regions need no arena mapping: the daemon copies into the client's memfd.
        fd = os.memfd_create("kvnode-test")
        os.ftruncate(fd, 3 * SLOT)
        region = c.attach_region(fd, 3 * SLOT)
        assert c.get_to_region(ns, keys, region, [0, SLOT, 2 * SLOT], [SLOT] * 3) == [SLOT] * 3
        with mmap.mmap(fd, 3 * SLOT) as m:
            assert bytes(m[:]) == b"".join(blocks)
        os.close(fd)
    finally:
        c.close()


def test_the_salt_a_client_names_is_mixed_under_its_tenant(tenant_daemon, daemon):
    mapped = Connection(tenant_daemon.socket)
    plain = Connection(daemon.socket)
    try:
        # Without a map the id is the client's spec; with one, the tenant's salt comes first.
        assert mapped.register(spec("x"))["id"] != plain.register(spec("x"))["id"]
        assert mapped.register(spec("kvnode-tenant:default/x"))["id"] != \
            mapped.register(spec("x"))["id"]
        assert plain.register(spec("kvnode-tenant:default/x"))["id"] == \
            mapped.register(spec("x"))["id"]
    finally:
        mapped.close()
        plain.close()


@pytest.fixture
def sharing_daemon(tmp_path):
    cfg = tmp_path / "kvnode.toml"
    # This client (root) is mapped to a tenant trusted with the arena; another uid is not.
    cfg.write_text('[[tenants.tenant]]\nname = "trusted"\nuids = [0]\nshare_arena = true\n\n'
                   '[[tenants.tenant]]\nname = "other"\nuids = [64009]\n')
    d = Daemon(tmp_path / "d", extra=("--config", str(cfg)))
    yield d
    d.stop()


def test_a_share_arena_tenant_maps_the_arena_and_moves_pages_through_it(sharing_daemon):
    import ctypes

    from kvnode.transfer import copy_out

    c = Connection(sharing_daemon.socket)
    try:
        assert c.arena is not None and c.hello["arena_bytes"] > 0
        ns = c.register(spec("shared"))["ns"]
        keys = [[bytes([0x40 + i]) * 32, 0] for i in range(3)]
        blocks = [bytes([0x80 + i]) * SLOT for i in range(3)]
        srcs = [ctypes.create_string_buffer(b, SLOT) for b in blocks]
        # Zero-copy set: alloc slots in the arena, write them through the mapping, commit.
        assert copy_out(c, ns, keys, [ctypes.addressof(s) for s in srcs], [SLOT] * 3) == [True] * 3
        # Read back both ways: inline, and leased straight out of the mapped arena.
        assert c.get(ns, keys) == blocks
        dsts = [ctypes.create_string_buffer(SLOT) for _ in range(3)]
        assert copy_in(c, ns, keys, [ctypes.addressof(d) for d in dsts], [SLOT] * 3) == [True] * 3
        assert [d.raw for d in dsts] == blocks
        # The daemon puts the tenant's salt first itself: naming it again is another namespace.
        assert c.register(spec("kvnode-tenant:trusted/shared"))["id"] != c.register(spec("shared"))["id"]
    finally:
        c.close()
