"""Router hints from SGLang's extra_info (`kv_router_hint` or a Dynamo `kv.fetch` envelope), normalized."""

from __future__ import annotations

from typing import Any, Optional

#: Key under which SGLang's controller stashes the per-request hint in `extra_info`.
HINT_KEY = "kv_router_hint"
_U64 = 1 << 64


def _extra_dict(extra_info: Any) -> Optional[dict]:
    # SGLang passes HiCacheStorageExtraInfo (with .extra_info) or, in some paths, a dict.
    if extra_info is None:
        return None
    if isinstance(extra_info, dict):
        return extra_info
    inner = getattr(extra_info, "extra_info", None)
    return inner if isinstance(inner, dict) else None


def _hashes(raw: Any) -> Optional[list]:
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for h in raw:
        if isinstance(h, bool) or not isinstance(h, int):
            return None
        if -(1 << 63) <= h < 0:
            h += _U64  # SGLang emits the router hash as a signed i64.
        if not 0 <= h < _U64:
            return None
        out.append(h)
    return out


def extract_router_hint(extra_info: Any) -> Optional[dict]:
    """Returns `{"source": "tcp://host:port", "block_hashes": [u64, ...]}` or None.

    Accepts the compact form `{"source_control_endpoint", "block_hashes"}` and the Dynamo
    envelope `{"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch", ...}]}`,
    either directly in `extra_info` or under `kv_router_hint`. Anything malformed is None
    (the request then runs as a local lookup); the daemon validates the endpoint again.
    """
    d = _extra_dict(extra_info)
    if not d:
        return None
    raw = d.get(HINT_KEY, d)
    if not isinstance(raw, dict):
        return None
    payload = raw
    if "actions" in raw:
        if raw.get("protocol_version") != "0.1":
            return None
        fetch = [a for a in raw.get("actions") or []
                 if isinstance(a, dict) and a.get("action_type") == "kv.fetch"
                 and a.get("action_version", "1.0") == "1.0"]
        if not fetch or not isinstance(fetch[0].get("payload"), dict):
            return None
        payload = fetch[0]["payload"]
    source = payload.get("source_control_endpoint")
    hashes = _hashes(payload.get("block_hashes"))
    if not isinstance(source, str) or not source.startswith("tcp://") or hashes is None:
        return None
    return {"source": source, "block_hashes": hashes}
