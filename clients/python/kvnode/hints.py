"""Router hints from SGLang's extra_info (a request's `kv_hints` envelope), normalized.

SGLang 0.5.23 types a request's hints as `KvHintsEnvelope` (`GenerateReqInput.kv_hints`);
kvnode's seam (`python -m kvnode.sglang patch --apply`) hands it to storage backends as
`HiCacheStorageExtraInfo.extra_info["kv_hints"]`. kvnode implements the Dynamo action
`kv.fetch` version 1.0 and ignores every other action.
"""

from __future__ import annotations

from typing import Any, Optional

#: Key under which SGLang's controller stashes the request's hints in `extra_info`
#: (SGLang's `KV_HINTS_EXTRA_INFO_KEY` once the seam is applied; a test pins the two).
HINT_KEY = "kv_hints"
FETCH_ACTION = "kv.fetch"
_U64 = 1 << 64


def _extra_dict(extra_info: Any) -> Optional[dict]:
    # SGLang passes HiCacheStorageExtraInfo (with .extra_info) or, in some paths, a dict.
    if extra_info is None:
        return None
    if isinstance(extra_info, dict):
        return extra_info
    inner = getattr(extra_info, "extra_info", None)
    return inner if isinstance(inner, dict) else None


def _as_dict(envelope: Any) -> Optional[dict]:
    """A plain dict of the envelope: as given, or from SGLang's typed KvHintsEnvelope."""
    if isinstance(envelope, dict):
        return envelope
    actions = getattr(envelope, "actions", None)
    if not isinstance(actions, (list, tuple)):
        return None
    return {
        "protocol_version": getattr(envelope, "protocol_version", None),
        "message_id": getattr(envelope, "message_id", None),
        "actions": [
            {"action_id": getattr(a, "action_id", None),
             "action_type": getattr(a, "action_type", None),
             "action_version": getattr(a, "action_version", None),
             "payload": getattr(a, "payload", None)}
            for a in actions
        ],
    }


def _hashes(raw: Any) -> Optional[list]:
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for h in raw:
        if isinstance(h, bool) or not isinstance(h, int):
            return None
        if -(1 << 63) <= h < 0:
            h += _U64  # SGLang publishes the router hash as a signed i64.
        if not 0 <= h < _U64:
            return None
        out.append(h)
    return out


def extract_router_hint(extra_info: Any) -> Optional[dict]:
    """Returns `{"source": "tcp://host:port", "block_hashes": [u64, ...]}` or None.

    Looks under `extra_info["kv_hints"]` (or at `extra_info` itself) for the Dynamo envelope
    `{"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch", ...}]}` (a dict or
    SGLang's typed `KvHintsEnvelope`) or the compact `{"source_control_endpoint",
    "block_hashes"}`. Anything malformed is None and the request runs as a local lookup
    (fail closed); the daemon validates and authorizes the endpoint again.
    """
    d = _extra_dict(extra_info)
    if not d:
        return None
    raw = _as_dict(d.get(HINT_KEY, d))
    if not raw:
        return None
    payload = raw
    if "actions" in raw:
        if raw.get("protocol_version") != "0.1":
            return None
        fetch = [a for a in raw.get("actions") or []
                 if isinstance(a, dict) and a.get("action_type") == FETCH_ACTION
                 and (a.get("action_version") or "1.0") == "1.0"]
        if not fetch or not isinstance(fetch[0].get("payload"), dict):
            return None
        payload = fetch[0]["payload"]
    source = payload.get("source_control_endpoint")
    hashes = _hashes(payload.get("block_hashes"))
    if not isinstance(source, str) or not source.startswith("tcp://") or hashes is None:
        return None
    return {"source": source, "block_hashes": hashes}
