"""The router entry from Python (kvnode.router_entry), against a real daemon: a request signed
by this module is authenticated by the Rust daemon (the cross-language signing contract), runs
an envelope on the model's namespace, and a request signed with another key, or replayed, is
refused. The entry's behaviour itself is tested in tests/tests/router_entry.rs.

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_router_entry.py`.
"""

import json
import os
import urllib.request

import pytest

from conftest import Daemon, free_port
from kvnode.router_entry import ACT_PATH, RouterEntry, RouterEntryError, router_key, signed_headers
from kvnode.wire import Connection

KEY = b"python-router-entry-cluster-key-0123"


@pytest.fixture
def entry(tmp_path):
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(KEY + b"\n")
    os.chmod(key_file, 0o600)
    port = free_port()
    d = Daemon(tmp_path / "d", extra=("--cluster-key", str(key_file), "--peers", "127.0.0.0/8",
                                      "--events", f"ipc://{tmp_path}/ev.sock",
                                      "--router-listen", f"127.0.0.1:{port}"))
    yield d, f"http://127.0.0.1:{port}", key_file
    d.stop()


def envelope(*actions):
    return {"protocol_version": "1.0", "message_id": "py-1", "actions": list(actions)}


def test_a_python_signed_request_runs_and_a_foreign_key_or_a_replay_is_refused(entry):
    d, url, key_file = entry
    c = Connection(d.socket)
    c.register({"model": "py-model", "page_size": 4, "segments": [4096]})
    e = RouterEntry.from_cluster_key_file(url, str(key_file))
    unknown = {"action_id": "u", "action_type": "kv.unheard", "action_version": "1.0", "payload": {}}
    reply = e.act("py-model", envelope(unknown))
    assert reply["message_id"] == "py-1"
    [ns] = reply["namespaces"]
    [r] = ns["results"]
    assert r["action_id"] == "u" and "Refused" in r["outcome"], r
    assert r["outcome"]["Refused"]["code"] == "Unsupported"
    # Authenticated, but no namespace of that model here: 404, not 401.
    with pytest.raises(RouterEntryError) as no_model:
        e.act("other-model", envelope())
    assert no_model.value.status == 404
    # Another cluster's key: 401.
    with pytest.raises(RouterEntryError) as forged:
        RouterEntry(url, router_key(b"another-cluster-key-0123456789")).act("py-model", envelope())
    assert forged.value.status == 401 and "key id" in forged.value.error
    # The same signed bytes twice: the second is a replay.
    body = json.dumps({"model": "py-model", "hints": envelope()}).encode()
    h = signed_headers(router_key(KEY), body)
    post = lambda: urllib.request.urlopen(urllib.request.Request(url + ACT_PATH, data=body, method="POST", headers=h), timeout=5)
    with post() as first:
        assert first.status == 200
    with pytest.raises(urllib.error.HTTPError) as again:
        post()
    assert again.value.code == 401 and "replay" in json.loads(again.value.read())["error"]
    router = c.stats()["router"]
    assert (router["accepted"], router["refused_auth"], router["refused_replay"], router["refused_invalid"]) == (2, 1, 1, 1)
    c.close()
