"""SGLang HiCache L3 storage backend on the node's kvnode daemon, zero-copy into shm host pages."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from kvnode.hints import extract_router_hint
from kvnode.namespace import digest_of, namespace_spec
from kvnode.wire import Connection, KvnodeError
from kvnode.wire import key as wire_key

try:  # The real base class whenever SGLang is installed; the library imports without it.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
    HAVE_SGLANG = True
except ImportError:  # pragma: no cover - exercised only where sglang is absent
    class _Base:  # type: ignore[no-redef]
        """Stand-in so `import kvnode.sglang_backend` works without SGLang."""

    HAVE_SGLANG = False

logger = logging.getLogger(__name__)
_OK_PUT = ("Stored", "Exists")


@dataclass
class _Metrics:
    """Same fields as SGLang's StorageMetrics, used only when SGLang is absent."""

    prefetch_pgs: List[int] = field(default_factory=list)
    backup_pgs: List[int] = field(default_factory=list)
    prefetch_bandwidth: List[float] = field(default_factory=list)
    backup_bandwidth: List[float] = field(default_factory=list)


def _new_metrics() -> Any:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
        return StorageMetrics()
    except ImportError:
        return _Metrics()


def default_socket() -> str:
    """The daemon's default socket (same rule as `kvnode serve`)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(run, "kvnode", "kvnode.sock") if run else "/run/kvnode/kvnode.sock"


def router_hint_fields(hint: Optional[dict], daemon_supports_hints: bool) -> dict:
    """THE single place where a router hint joins a request (Exists and GetToRegion/Get).

    Returns the extra header fields merged into those ops. Until the daemon answers the
    `Timeouts` probe (the peer-pull work), nothing is attached and requests stay local.
    """
    if not hint or not daemon_supports_hints:
        return {}
    # The daemon takes the hint as untrusted JSON text (compact form) and validates it again.
    compact = {"source_control_endpoint": hint["source"], "block_hashes": hint["block_hashes"]}
    return {"hint": json.dumps(compact)}


class _PerThread(threading.local):
    conn: Optional[Connection] = None
    region: Any = None


class KvnodeStorage(_Base):
    """`--hicache-storage-backend dynamic` backend; see docs/sglang.md for the launch flags."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None):
        self.config = storage_config
        extra = getattr(storage_config, "extra_config", None) or {}
        self.socket_path = str(extra.get("socket") or os.environ.get("KVNODE_SOCKET") or default_socket())
        mla = bool(getattr(storage_config, "is_mla_model", False))
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = bool(writer) if writer is not None else (not mla or getattr(storage_config, "tp_rank", 0) == 0)
        self.metrics_on = bool(getattr(storage_config, "enable_storage_metrics", True))
        self.mem_pool_host = None
        self.ns: Optional[int] = None
        self.flat_ns: Optional[int] = None
        self.seg_n = 1
        self.page_bytes = 0
        self.zero_copy = False
        self._fd: Optional[int] = None
        self._base = 0
        self._length = 0
        self._tls = _PerThread()
        self._all: List[Connection] = []
        self._lock = threading.Lock()
        self._metrics = _new_metrics()
        self.daemon_timeouts: Optional[dict] = None
        self._conn()  # fail fast when the daemon is not there
        self.supports_hints = self._probe_timeouts(extra)

    # -- connections -----------------------------------------------------------------------
    def _conn(self) -> Connection:
        c = self._tls.conn
        if c is None:
            c = Connection(self.socket_path, client=f"sglang-tp{getattr(self.config, 'tp_rank', 0)}")
            if self.zero_copy:
                self._tls.region = c.attach_region(self._fd, self._length)
            self._tls.conn = c
            with self._lock:
                self._all.append(c)
        return c

    def _probe_timeouts(self, extra: dict) -> bool:
        try:
            _, body, _ = self._conn().call("Timeouts")
        except KvnodeError:
            logger.info("kvnode: daemon declares no prefetch timeout model; router hints stay off")
            return False
        self.daemon_timeouts = body
        self._sglang_timeouts = (float(extra.get("prefetch_timeout_base", 1.0)),
                                 float(extra.get("prefetch_timeout_per_ki_token", 0.25)))
        logger.info("kvnode: daemon timeout model %s; SGLang prefetch_timeout_base=%s per_ki_token=%s",
                    body, *self._sglang_timeouts)
        return True

    def recommended_extra_config(self, page_size: int) -> dict:
        """SGLang extra-config timeouts that never abandon a fetch the daemon expects to finish:
        the daemon's declared `base_s`, and its `per_page_s` scaled to 1024 tokens."""
        t = self.daemon_timeouts or {}
        return {"prefetch_timeout_base": float(t.get("base_s", 1.0)),
                "prefetch_timeout_per_ki_token": float(t.get("per_page_s", 0.0)) * 1024 / max(1, page_size)}

    def _check_timeouts(self, page_size: int) -> None:
        # Only a measured model is evidence; before any pull the daemon echoes SGLang's defaults.
        if not self.daemon_timeouts or not self.daemon_timeouts.get("measured"):
            return
        rec = self.recommended_extra_config(page_size)
        base, per_ki = self._sglang_timeouts
        if base < rec["prefetch_timeout_base"] or per_ki < rec["prefetch_timeout_per_ki_token"]:
            logger.warning(
                "kvnode: SGLang's prefetch timeout (base %.3fs + %.4fs per 1024 tokens) is shorter "
                "than the daemon's declared model: fetches that would land may be abandoned. "
                "Set in the extra-config: %s", base, per_ki, json.dumps(rec))

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        import torch  # present whenever SGLang hands us a host pool

        self.mem_pool_host = mem_pool_host
        ps = int(mem_pool_host.page_size)
        self._check_timeouts(ps)
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(ps, dtype=torch.int64))
        self.seg_n = len(sizes)
        self.page_bytes = int(sum(sizes))
        spec = namespace_spec(self.config, mem_pool_host, list(sizes))
        self.ns = self._conn().register(spec)["ns"]
        fd = getattr(mem_pool_host, "fd", None)
        if fd is not None:
            self._fd = fd
            self._length = os.fstat(fd).st_size
            self._base = self._pool_base(mem_pool_host)
            self._tls.region = self._conn().attach_region(fd, self._length)
            self.zero_copy = True
            logger.info("kvnode: zero copy into the shm host pool (%d bytes, %d objects per page)",
                        self._length, self.seg_n)
        else:
            logger.warning(
                "kvnode: host pool is not shared memory, pages are copied through the daemon's "
                "arena. Enable zero copy with \"allocator\": \"shm\" in "
                "--hicache-storage-backend-extra-config (inline JSON).")

    @staticmethod
    def _pool_base(pool: Any) -> int:
        mm = getattr(getattr(pool, "allocator", None), "mm", None)
        if mm is not None:
            anchor = ctypes.c_char.from_buffer(mm)
            addr = ctypes.addressof(anchor)
            del anchor
            return addr
        return int(pool.kv_buffer.data_ptr())

    # -- v1 zero-copy interface ------------------------------------------------------------
    def _layout(self, keys: List[str], host_indices: Any):
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self.seg_n:
            raise ValueError(f"{len(keys)} keys but {len(ptrs)} page objects (expected {self.seg_n} per page)")
        pk = [wire_key(digest_of(k), s) for k in keys for s in range(self.seg_n)]
        return pk, [int(p) for p in ptrs], [int(s) for s in sizes]

    def _in_region(self, ptrs: List[int], sizes: List[int]) -> bool:
        lo, hi = self._base, self._base + self._length
        return self.zero_copy and all(lo <= p and p + s <= hi for p, s in zip(ptrs, sizes))

    def _pages(self, flags: List[bool], n: int) -> List[bool]:
        s = self.seg_n
        return [all(flags[i * s:(i + 1) * s]) for i in range(n)]

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        t0 = time.perf_counter()
        pk, ptrs, sizes = self._layout(keys, host_indices)
        hint = router_hint_fields(extract_router_hint(extra_info), self.supports_hints)
        c = self._conn()
        if self._in_region(ptrs, sizes):
            offs = [p - self._base for p in ptrs]
            got = c.get_to_region(self.ns, pk, self._tls.region, offs, sizes, extra=hint)
            flags = [g == s for g, s in zip(got, sizes)]
        else:
            flags = self._copy_in(c, pk, ptrs, sizes, hint)
        res = self._pages(flags, len(keys))
        self._record(self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth, res, t0)
        return res

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        if not self.is_writer:  # MLA: one writer per page; every rank reads
            return [True] * len(keys)
        t0 = time.perf_counter()
        pk, ptrs, sizes = self._layout(keys, host_indices)
        c = self._conn()
        if self._in_region(ptrs, sizes):
            offs = [p - self._base for p in ptrs]
            flags = [r in _OK_PUT for r in c.put_from_region(self.ns, pk, self._tls.region, offs, sizes)]
        else:
            flags = self._copy_out(c, pk, ptrs, sizes)
        res = self._pages(flags, len(keys))
        self._record(self._metrics.backup_pgs, self._metrics.backup_bandwidth, res, t0)
        return res

    def _copy_in(self, c: Connection, pk: list, ptrs: List[int], sizes: List[int],
                 hint: Optional[dict] = None) -> List[bool]:
        lease, extents = c.get_lease(self.ns, pk, extra=hint)
        try:
            flags = []
            for e, p, s in zip(extents, ptrs, sizes):
                ok = e is not None and e["len"] == s
                if ok:
                    ctypes.memmove(p, c.arena_base + e["offset"], s)
                flags.append(ok)
            return flags
        finally:
            if lease:
                c.release(lease)

    def _copy_out(self, c: Connection, pk: list, ptrs: List[int], sizes: List[int]) -> List[bool]:
        slots = c.alloc(self.ns, pk, sizes)
        flags, handles = [], []
        for slot, p, s in zip(slots, ptrs, sizes):
            if "Granted" in slot:
                g = slot["Granted"]
                ctypes.memmove(c.arena_base + g["offset"], p, s)
                handles.append(g["handle"])
                flags.append(None)
            else:
                flags.append(slot["Refused"]["status"] == "Exists")
        done = iter(c.commit(handles))
        return [next(done) in ("Committed", "Duplicate") if f is None else f for f in flags]

    def _record(self, pgs: list, bw: list, res: List[bool], t0: float) -> None:
        if not self.metrics_on:
            return
        hits = sum(res)
        dt = max(time.perf_counter() - t0, 1e-9)
        with self._lock:
            pgs.append(hits)
            bw.append(hits * self.page_bytes / dt / (1 << 30))

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        pk = [wire_key(digest_of(k), s) for k in keys for s in range(self.seg_n)]
        hint = router_hint_fields(extract_router_hint(extra_info), self.supports_hints)
        return self._conn().exists(self.ns, pk, extra=hint) // self.seg_n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- legacy whole-page interface (flat pages: their own namespace) ---------------------
    def _flat(self) -> int:
        if self.flat_ns is None:
            spec = namespace_spec(self.config, self.mem_pool_host, [self.page_bytes], flavor="flat")
            self.flat_ns = self._conn().register(spec)["ns"]
        return self.flat_ns

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
        blocks = self._conn().get(self._flat(), [wire_key(digest_of(k)) for k in keys])
        out = []
        for b, t in zip(blocks, target_locations or [None] * len(keys)):
            if b is None or t is None or len(b) != t.numel() * t.element_size():
                out.append(None)
                continue
            ctypes.memmove(t.data_ptr(), b, len(b))
            out.append(t)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not self.is_writer:
            return True
        blobs = []
        for v in values:
            v = v.contiguous()
            blobs.append(ctypes.string_at(v.data_ptr(), v.numel() * v.element_size()))
        st = self._conn().put(self._flat(), [wire_key(digest_of(k)) for k in keys], blobs)
        return all(s in _OK_PUT for s in st)

    # -- lifecycle -------------------------------------------------------------------------
    def clear(self) -> bool:
        """Removes every page of this rank's namespaces; raises KvnodeError if refused."""
        c = self._conn()
        n = sum(c.clear(ns) for ns in (self.ns, self.flat_ns) if ns is not None)
        logger.info("kvnode: cleared %d blocks", n)
        return True

    def get_stats(self) -> Any:
        with self._lock:
            m, self._metrics = self._metrics, _new_metrics()
        return m

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
        self._tls = _PerThread()
