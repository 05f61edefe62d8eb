"""The kvnode client protocol over a Unix socket: frames, the handshake, ops (docs/client-protocol.md)."""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import msgpack

PROTOCOL_VERSION = 1
_PREFIX = struct.Struct("<II")  # header_len, payload_len
#: The daemon's limit on a request header (kvnode_proto::frame::MAX_HEADER); it drops a
#: connection that announces a longer one, so the client refuses to send it.
MAX_HEADER = 16 << 20


class KvnodeError(RuntimeError):
    """The daemon refused a request (`code` is its ErrorCode name) or the protocol broke.

    Codes of the client itself: "Handshake", "Io", "Malformed" (a reply it cannot read) and
    "FrameTooLarge" (a request header over MAX_HEADER, not sent: split the request)."""

    def __init__(self, code: str, message: str, leasable: Optional[int] = None):
        super().__init__(f"kvnode refused the request ({code}): {message}")
        self.code = code
        self.message = message
        # With code "TooLarge": leading keys one request can lease now (split on it).
        self.leasable = leasable


def key(digest: bytes, segment: int = 0) -> list:
    """A protocol key: 32-byte page digest and segment number."""
    if len(digest) != 32:
        raise ValueError(f"page digest must be 32 bytes, got {len(digest)}")
    return [digest, segment]


def _split_reply(reply: Any) -> Tuple[str, Any]:
    # Externally tagged enum: a bare string for unit variants, else a one-entry map.
    if isinstance(reply, str):
        return reply, None
    if isinstance(reply, dict) and len(reply) == 1:
        return next(iter(reply.items()))
    raise KvnodeError("Malformed", f"unexpected reply shape {reply!r}")


#: The largest count a `Touched` reply carries (a u32 on the wire).
_U32_MAX = (1 << 32) - 1


def touched_count(name: str, body: Any) -> int:
    """The count of a `Touched { count }` reply; KvnodeError("Malformed") for any other reply
    or a count that is not a u32 (the Rust `Reply::Touched`, engine/proto/src/client.rs)."""
    count = body.get("count") if name == "Touched" and isinstance(body, dict) else None
    if type(count) is not int or not 0 <= count <= _U32_MAX:
        raise KvnodeError("Malformed", f"Touch answered {name} {body!r}, not Touched {{count: u32}}")
    return count


class Region:
    """A memfd the daemon has mapped; offsets in requests are relative to its start."""

    def __init__(self, region_id: int, length: int):
        self.id = region_id
        self.length = length


class Connection:
    """One blocking connection (not thread-safe: use one per thread)."""

    def __init__(self, path: str, client: str = "kvnode-python", timeout: Optional[float] = None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._next_id = 1
        hello = {"id": 0, "op": {"Hello": {"version": PROTOCOL_VERSION, "client": client}}}
        self.sock.sendall(self._frame(hello, 0))
        # The reply's first bytes carry the arena memfd.
        msg, fds, _flags, _addr = socket.recv_fds(self.sock, _PREFIX.size, 4)
        buf = bytearray(msg)
        if not buf:
            raise KvnodeError("Handshake", "daemon closed the connection during the handshake")
        buf += self._recv_exact(_PREFIX.size - len(buf))
        name, body, _ = self._read_rest(bytes(buf))
        if name != "HelloOk":
            for fd in fds:
                os.close(fd)
            raise KvnodeError(body.get("code", "Handshake"), body.get("message", str(body)))
        self.hello = body
        if not fds and body["arena_bytes"] == 0:
            # The daemon withholds the arena from this client's tenant (share_arena = false):
            # inline get/put, regions and GPU ops work; alloc is refused, and a lease get's
            # extents cannot be read.
            self.arena = None
            self._arena_anchor = None
            self.arena_base = 0
            return
        if not fds:
            raise KvnodeError("Handshake", "daemon sent no arena descriptor")
        for extra in fds[1:]:
            os.close(extra)
        self.arena = mmap.mmap(fds[0], body["arena_bytes"], mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fds[0])
        self._arena_anchor = ctypes.c_char.from_buffer(self.arena)
        self.arena_base = ctypes.addressof(self._arena_anchor)

    # -- framing ---------------------------------------------------------------------------
    @staticmethod
    def _frame(msg: dict, payload_len: int) -> bytes:
        header = msgpack.packb(msg, use_bin_type=True)
        if len(header) > MAX_HEADER:
            raise KvnodeError("FrameTooLarge", f"request header of {len(header)} bytes is over the "
                              f"daemon's {MAX_HEADER}-byte limit (it would drop the connection): "
                              "send fewer keys per request")
        return _PREFIX.pack(len(header), payload_len) + header

    def _recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise KvnodeError("Io", "daemon closed the connection mid-frame")
            out += chunk
        return bytes(out)

    def _read_rest(self, prefix: bytes) -> Tuple[str, Any, bytes]:
        header_len, payload_len = _PREFIX.unpack(prefix)
        resp = msgpack.unpackb(self._recv_exact(header_len), raw=False)
        payload = self._recv_exact(payload_len) if payload_len else b""
        name, body = _split_reply(resp["reply"])
        return name, body, payload

    def call(self, op: Any, payload: Sequence[bytes] = (), fd: Optional[int] = None
             ) -> Tuple[str, Any, bytes]:
        """Sends one request and returns (reply variant, body, payload); raises on Error."""
        rid = self._next_id
        self._next_id += 1
        total = sum(len(p) for p in payload)
        frame = self._frame({"id": rid, "op": op}, total)
        if fd is None:
            self.sock.sendall(frame)
        else:
            sent = socket.send_fds(self.sock, [frame], [fd])
            self.sock.sendall(frame[sent:])
        for p in payload:
            self.sock.sendall(p)
        name, body, data = self._read_rest(self._recv_exact(_PREFIX.size))
        if name == "Error":
            raise KvnodeError(body["code"], body["message"])
        if name == "TooLarge":
            raise KvnodeError("TooLarge", body["message"], leasable=body["leasable"])
        return name, body, data

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            self._arena_anchor = None
            if self.arena is not None:
                self.arena.close()

    # -- ops -------------------------------------------------------------------------------
    def register(self, spec: Any) -> Dict[str, Any]:
        """Registers a namespace: a `kvnode.common.NamespaceSpec` or its wire map."""
        wire = spec.to_wire() if hasattr(spec, "to_wire") else spec
        return self.call({"Register": {"spec": wire}})[1]

    def exists(self, ns: int, keys: List[list], extra: Optional[dict] = None) -> int:
        return self.exists_report(ns, keys, extra)[0]

    def exists_report(self, ns: int, keys: List[list], extra: Optional[dict] = None
                      ) -> Tuple[int, Optional[Dict[str, Any]]]:
        """(leading keys present now, the OpReport of the background pull a hint started, if any)."""
        body = self.call({"Exists": {"ns": ns, "keys": keys, **(extra or {})}})[1]
        return body["count"], body.get("pull")

    def act(self, ns: int, keys: List[list], hints: str) -> Tuple[str, List["ActionResult"]]:
        """Runs every action of the hints envelope `hints` (JSON text) on the request's `keys`:
        (the envelope's message_id, one ActionResult per action, in order). An envelope-level
        fault (not JSON, an unknown protocol_version, too many actions) raises KvnodeError."""
        return act(self, ns, keys, hints)

    def touch(self, ns: int, keys: List[list]) -> int:
        """Refreshes, in the daemon's DRAM eviction policy, the leading run of `keys` it holds
        in DRAM, as a get of them would, without reading them (`Touch`, docs/client-protocol.md):
        pages the engine served from its own prefix cache, whose hits never reach the daemon.
        Returns the run's length (keys). Raises KvnodeError for a namespace this connection's
        tenant does not own ("UnknownNamespace") or a malformed key list."""
        name, body, _ = self.call({"Touch": {"ns": int(ns), "keys": keys}})
        return touched_count(name, body)

    def wait(self, op: int, timeout_ms: int) -> Dict[str, Any]:
        """Waits up to `timeout_ms` for a pull op to end; returns its OpReport (ended or not)."""
        return self.call({"Wait": {"op": op, "timeout_ms": int(timeout_ms)}})[1]

    def put(self, ns: int, keys: List[list], blocks: Sequence[bytes]) -> List[str]:
        body = {"ns": ns, "keys": keys, "lens": [len(b) for b in blocks]}
        return self.call({"Put": body}, payload=blocks)[1]["results"]

    def get(self, ns: int, keys: List[list], extra: Optional[dict] = None) -> List[Optional[bytes]]:
        _, body, data = self.call({"Get": {"ns": ns, "keys": keys, "mode": "Inline", **(extra or {})}})
        out, off = [], 0
        for n in body["lens"]:
            out.append(None if n is None else data[off:off + n])
            off += n or 0
        return out

    def get_lease(self, ns: int, keys: List[list], extra: Optional[dict] = None
                  ) -> Tuple[int, List[Optional[dict]]]:
        body = self.call({"Get": {"ns": ns, "keys": keys, "mode": "Lease", **(extra or {})}})[1]
        return body["lease"], body["extents"]

    def get_lease_each(self, ns: int, keys: List[list], use: Callable[[int, List[Optional[dict]]], None],
                       extra: Optional[dict] = None) -> None:
        """Lease get of any length, split where the daemon answers TooLarge: `use(first, extents)`
        runs for each leading part while it is leased; it is released before the next part."""
        at = 0
        while at < len(keys):
            want = len(keys) - at
            while True:
                try:
                    lease, extents = self.get_lease(ns, keys[at:at + want], extra=extra)
                    break
                except KvnodeError as e:
                    if e.code != "TooLarge" or not e.leasable or e.leasable >= want:
                        raise
                    want = e.leasable
            try:
                use(at, extents)
            finally:
                if lease:
                    self.release(lease)
            at += want

    def release(self, lease: int) -> None:
        self.call({"Release": {"lease": lease}})

    def alloc(self, ns: int, keys: List[list], lens: List[int]) -> List[dict]:
        return self.call({"Alloc": {"ns": ns, "keys": keys, "lens": lens}})[1]["slots"]

    def commit(self, handles: List[int]) -> List[str]:
        return self.call({"Commit": {"handles": handles}})[1]["results"]

    def clear(self, ns: Optional[int]) -> int:
        return self.call({"Clear": {"ns": ns}})[1]["count"]

    def stats(self) -> Dict[str, Any]:
        return self.call("Stats")[1]

    def attach_region(self, fd: int, length: int) -> Region:
        body = self.call({"AttachRegion": {"len": length}}, fd=fd)[1]
        return Region(body["region"], body["len"])

    def detach_region(self, region: Region) -> None:
        self.call({"DetachRegion": {"region": region.id}})

    def get_to_region(self, ns: int, keys: List[list], region: Region, offsets: List[int],
                      lens: List[int], extra: Optional[dict] = None) -> List[Optional[int]]:
        body = {"ns": ns, "keys": keys, "region": region.id, "offsets": offsets, "lens": lens}
        return self.call({"GetToRegion": {**body, **(extra or {})}})[1]["lens"]

    def put_from_region(self, ns: int, keys: List[list], region: Region, offsets: List[int],
                        lens: List[int]) -> List[str]:
        body = {"ns": ns, "keys": keys, "region": region.id, "offsets": offsets, "lens": lens}
        return self.call({"PutFromRegion": body})[1]["results"]


def open_namespace(connect: Callable[[], "Connection"], register: Callable[["Connection"], int]
                   ) -> Tuple["Connection", int, Optional[dict]]:
    """A new connection, its namespace id (`register` registers the caller's spec) and the
    daemon's declared pull timeouts (`Timeouts`), or None from a daemon without the peer path
    (then router hints are not sent)."""
    conn = connect()
    ns = register(conn)
    try:
        timeouts = conn.call("Timeouts")[1]
    except KvnodeError:
        timeouts = None
    return conn, ns, timeouts


def exists(conn: "Connection", ns: int, keys: List[list], extra: Optional[dict] = None) -> Dict[str, Any]:
    """The daemon's `Exists` answer for `keys` in `ns` (`extra`: e.g. a hint field)."""
    return conn.call({"Exists": {"ns": ns, "keys": keys, **(extra or {})}})[1]


@dataclass(frozen=True)
class ActionResult:
    """What the daemon did with one action of an `Act` (kvnode_proto::actions::ActionResult).

    outcome   "Done" (executed), "Started" (a promotion from NVMe runs in the background),
              "Pulling" (a peer pull started: `report` is its OpReport, follow it with `Wait`)
              or "Refused" (nothing changed: `code` is the ErrorCode name, `message` says why,
              naming the action)
    blocks    keys acted on (Done / Started)
    skipped   keys named but not acted on (Done / Started)
    note      what was skipped and why (Done), else ""
    """

    action_id: str
    action_type: str
    outcome: str
    blocks: int = 0
    skipped: int = 0
    note: str = ""
    code: str = ""
    message: str = ""
    report: Optional[Dict[str, Any]] = None

    @property
    def refused(self) -> bool:
        return self.outcome == "Refused"


def action_result(raw: Dict[str, Any]) -> ActionResult:
    """One wire `ActionResult` map as an ActionResult."""
    outcome, body = _split_reply(raw["outcome"])
    body = body or {}
    ident = {"action_id": str(raw.get("action_id", "")), "action_type": str(raw.get("action_type", ""))}
    if outcome == "Pulling":
        return ActionResult(**ident, outcome=outcome, report=body)
    if outcome == "Refused":
        return ActionResult(**ident, outcome=outcome, code=str(body.get("code", "")),
                            message=str(body.get("message", "")))
    return ActionResult(**ident, outcome=outcome, blocks=int(body.get("blocks", 0)),
                        skipped=int(body.get("skipped", 0)), note=str(body.get("note", "")))


def act(conn: "Connection", ns: int, keys: List[list], hints_text: str) -> Tuple[str, List[ActionResult]]:
    """The daemon's `Act` for the request's `keys` in `ns`: every action of the envelope
    `hints_text` (JSON) applies to the keys whose router hash it names. Returns (message_id,
    one ActionResult per action, in order); raises KvnodeError on an envelope-level fault."""
    body = conn.call({"Act": {"ns": ns, "keys": keys, "hints": hints_text}})[1]
    return str(body.get("message_id", "")), [action_result(r) for r in body.get("results") or []]


def wait_for_daemon(path: str, proc: Any = None, timeout: float = 10.0,
                    log_path: Optional[Any] = None, recovered: bool = True) -> None:
    """Waits until a daemon answers on `path` and, with `recovered`, has rebuilt its spill
    index (a daemon serves from DRAM while it does: `stats()["spill_recovering"]`); raises
    RuntimeError (with its log) if it exits first (`proc`, a Popen) or is not there within
    `timeout` seconds."""
    import time
    deadline = time.time() + timeout
    while True:
        try:
            c = Connection(path)
            try:
                if not recovered or not c.stats().get("spill_recovering", False):
                    return
            except KvnodeError:
                return  # stats refused to this caller: answering is all it can tell
            finally:
                c.close()
        except (OSError, ConnectionError):
            pass
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            log = open(log_path).read() if log_path else ""
            raise RuntimeError(f"daemon did not start: {log}")
        time.sleep(0.02)
