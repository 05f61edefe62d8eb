"""Router hints from SGLang's extra_info (a request's `kv_hints` envelope), normalized.

SGLang 0.5.23 types a request's hints as `KvHintsEnvelope` (`GenerateReqInput.kv_hints`);
kvnode's seam (`python -m kvnode.sglang patch --apply`) hands it to storage backends as
`HiCacheStorageExtraInfo.extra_info["kv_hints"]`; vLLM carries it as `Request.kv_hints` /
`ReqContext.kv_hints` (or in `kv_transfer_params`).

An envelope splits three ways (`split_envelope`):

    kv.fetch (the first one `extract_router_hint` accepts)  -> the hinted lookup (Exists + Wait)
    every other action, execute_at absent or "now"          -> `Act`, at the earliest engine point
    execute_at == "request_completion"                      -> `Act` when the request ends

Nothing is dropped here: an action the seam cannot place (an unknown type, a kv.fetch the
hinted lookup does not take, a malformed entry) goes to `Act` with the others, and the daemon
answers it by name (kvnode.actions logs and counts refusals).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

#: Key under which SGLang's controller stashes the request's hints in `extra_info`
#: (SGLang's `KV_HINTS_EXTRA_INFO_KEY` once the seam is applied; a test pins the two).
HINT_KEY = "kv_hints"
FETCH_ACTION = "kv.fetch"
#: `execute_at` values: "now" (the default) and the one an engine seam defers.
EXECUTE_AT = "execute_at"
AT_COMPLETION = "request_completion"
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


def request_source(kv_hints: Any, kv_transfer_params: Any) -> Any:
    """What a vLLM request carries its envelope in: `kv_hints` (vLLM's typed KvHintsEnvelope,
    as the in-tree kvcr tier reads it), else `kv_transfer_params` (the envelope itself, or under
    "kv_router_hint"); the argument `extract_router_hint` / `split_envelope` take."""
    if kv_hints is not None:
        return {HINT_KEY: kv_hints}
    if isinstance(kv_transfer_params, dict):
        return kv_transfer_params.get("kv_router_hint", kv_transfer_params)
    return None


def _fetch_index(raw: dict) -> Optional[int]:
    """Index of the kv.fetch action `extract_router_hint` takes (its first kv.fetch, when it
    accepts the envelope), else None."""
    if extract_router_hint(raw) is None:
        return None
    for i, a in enumerate(raw.get("actions") or []):
        if isinstance(a, dict) and a.get("action_type") == FETCH_ACTION:
            return i
    return None


def _execute_at(a: Any) -> Any:
    if not isinstance(a, dict):
        return None
    payload = a.get("payload")
    at = payload.get(EXECUTE_AT) if isinstance(payload, dict) else None
    return at if at is not None else a.get(EXECUTE_AT)


def _wire_action(a: Any, strip_execute_at: bool) -> Any:
    """The action as sent: signed 64-bit router hashes (SGLang publishes i64) as u64, and, for
    a deferred action sent at completion, without `execute_at`."""
    if not isinstance(a, dict):
        return a
    a = copy.deepcopy(a)
    payload = a.get("payload")
    if strip_execute_at:
        a.pop(EXECUTE_AT, None)
        if isinstance(payload, dict):
            payload.pop(EXECUTE_AT, None)
    if isinstance(payload, dict) and isinstance(payload.get("block_hashes"), list):
        payload["block_hashes"] = [h + _U64 if isinstance(h, int) and not isinstance(h, bool)
                                   and -(1 << 63) <= h < 0 else h
                                   for h in payload["block_hashes"]]
    return a


@dataclass(frozen=True)
class RequestActions:
    """A request's envelope, less the kv.fetch the hinted lookup takes, split by when it is sent.

    message_id     the envelope's (may be empty)
    key            what identifies the envelope when deduplicating sends: message_id, else a
                   digest of the envelope's JSON
    now            actions to send at the earliest engine point (as the router wrote them)
    at_completion  actions with execute_at == "request_completion" (as the router wrote them)
    """

    protocol_version: Any
    message_id: str
    key: str
    now: Tuple[Any, ...]
    at_completion: Tuple[Any, ...]

    def _text(self, actions: Any, strip: bool) -> str:
        return json.dumps({"protocol_version": self.protocol_version, "message_id": self.message_id,
                           "actions": [_wire_action(a, strip) for a in actions]})

    def now_text(self) -> Optional[str]:
        """The envelope `Act` takes at the earliest engine point; None when there is nothing."""
        return self._text(self.now, False) if self.now else None

    def completion_text(self) -> Optional[str]:
        """The envelope `Act` takes when the request ends: the deferred actions with
        `execute_at` removed; None when there are none."""
        return self._text(self.at_completion, True) if self.at_completion else None

    def unplaced_text(self) -> Optional[str]:
        """For a seam with no request-completion point: every action at once, the deferred
        ones as written (the daemon refuses those by name, so they are never lost silently)."""
        every = self.now + self.at_completion
        return self._text(every, False) if every else None


def split_envelope(source: Any) -> Optional[RequestActions]:
    """The actions of the request's envelope other than the kv.fetch `extract_router_hint`
    takes (same `source` forms; the compact kv.fetch form has none). None when there is no
    envelope or nothing besides that kv.fetch."""
    d = _extra_dict(source)
    if not d:
        return None
    raw = _as_dict(d.get(HINT_KEY, d))
    if not raw or not isinstance(raw.get("actions"), (list, tuple)):
        return None
    fetch = _fetch_index(raw)
    now: List[Any] = []
    later: List[Any] = []
    for i, a in enumerate(raw["actions"]):
        if i == fetch:
            continue
        (later if _execute_at(a) == AT_COMPLETION else now).append(a)
    if not now and not later:
        return None
    message_id = raw.get("message_id")
    message_id = message_id if isinstance(message_id, str) else ""
    key = message_id or hashlib.sha256(
        json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()
    return RequestActions(raw.get("protocol_version"), message_id, key, tuple(now), tuple(later))
