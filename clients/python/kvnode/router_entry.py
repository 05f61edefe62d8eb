"""A router's client for kvnode's router entry (docs/router-entry.md): sign a hints envelope
and POST it to a node's daemon at placement time, before any engine sees the request.

Standard library only (hmac, hashlib, urllib), so a router can vendor it as it is. The signing
rule is the daemon's (`kvnode_proto::router`):

    router key = HMAC-SHA256(cluster key line, "kvnode router entry key v1")
    key id     = HMAC-SHA256(router key, "kvnode router key id v1")[:8], hex
    signature  = HMAC-SHA256(router key, "kvnode-router-v1\\n" + key id + "\\n" + timestamp
                 + "\\n" + "POST /v1/act\\n" + body), hex
"""

import hashlib
import hmac
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Optional

ACT_PATH = "/v1/act"
_ROUTER_KEY_LABEL = b"kvnode router entry key v1"
_KEY_ID_LABEL = b"kvnode router key id v1"
_PREFIX = b"kvnode-router-v1\n"


class RouterEntryError(RuntimeError):
    """The daemon refused the request: `status` (401, 400, 404, 413, 503) and its reason."""

    def __init__(self, status: int, error: str):
        super().__init__(f"router entry refused the request ({status}): {error}")
        self.status = status
        self.error = error


def router_key(cluster_key_line: bytes) -> bytes:
    """The router key derived from one line of the daemon's --cluster-key file."""
    return hmac.new(cluster_key_line.strip(), _ROUTER_KEY_LABEL, hashlib.sha256).digest()


def key_id(rk: bytes) -> str:
    return hmac.new(rk, _KEY_ID_LABEL, hashlib.sha256).digest()[:8].hex()


def sign(rk: bytes, timestamp_ms: int, body: bytes, method: str = "POST", path: str = ACT_PATH) -> str:
    msg = _PREFIX + f"{key_id(rk)}\n{timestamp_ms}\n{method} {path}\n".encode() + body
    return hmac.new(rk, msg, hashlib.sha256).hexdigest()


def signed_headers(rk: bytes, body: bytes, timestamp_ms: Optional[int] = None) -> Dict[str, str]:
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    return {"content-type": "application/json", "x-kvnode-key-id": key_id(rk),
            "x-kvnode-timestamp": str(ts), "x-kvnode-signature": sign(rk, ts, body)}


class RouterEntry:
    """One node's router entry, e.g. `RouterEntry("http://10.0.0.7:7710", rk)`."""

    def __init__(self, url: str, rk: bytes, timeout: float = 5.0):
        self.url = url.rstrip("/") + ACT_PATH
        self.rk = rk
        self.timeout = timeout

    @classmethod
    def from_cluster_key_file(cls, url: str, path: str, timeout: float = 5.0) -> "RouterEntry":
        """Signs with the file's first key (the daemon accepts either key of a rotation)."""
        first = next(l for l in Path(path).read_bytes().splitlines() if l.strip())
        return cls(url, router_key(first), timeout)

    def act(self, model: str, hints: Any, namespace: Optional[str] = None) -> Dict[str, Any]:
        """Runs the envelope `hints` (dict or JSON text) on every namespace of `model` on the
        node; returns the reply `{"message_id", "namespaces": [{"namespace", "tp_rank",
        "results"}]}`. Raises RouterEntryError when the daemon refuses."""
        req: Dict[str, Any] = {"model": model, "hints": hints}
        if namespace is not None:
            req["namespace"] = namespace
        body = json.dumps(req).encode()
        r = urllib.request.Request(self.url, data=body, method="POST",
                                   headers=signed_headers(self.rk, body))
        try:
            with urllib.request.urlopen(r, timeout=self.timeout) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                why = json.loads(raw).get("error", "")
            except ValueError:
                why = raw.decode(errors="replace")
            raise RouterEntryError(e.code, why) from None
