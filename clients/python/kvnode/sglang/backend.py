"""SGLang HiCache L3 storage backend on the node's kvnode daemon, zero-copy into shm host pages.

Both of SGLang 0.5.23's page interfaces: v1 (`batch_get_v1` / `batch_set_v1` on the KV
anchor pool) and v2 (`register_mem_host_pool_v2`, `batch_exists_v2` / `batch_get_v2` /
`batch_set_v2` with `PoolTransfer`s: KV, Mamba state, SWA, DSA indexer, draft pools), each
pool in its own kvnode namespace. The pages SGLang already holds on device and host (a lookup's
`extra_info.prefix_keys`, with SGLang's `hicache_storage_pass_prefix_keys`) are touched in the
daemon (kvnode.touch) before the lookup. SGLang loads it by `module_path` `kvnode.sglang.backend`
(`kvnode.sglang_backend` re-exports it), `class_name` `KvnodeStorage`. See docs/sglang.md.
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvnode import hitpolicy, transfer
from kvnode.actions import UNPLACED, ActionLog
from kvnode.common import HintedExists, default_socket, hint_field, hinted_exists, pull_budget_ms
from kvnode.hints import extract_router_hint, split_envelope
from kvnode.metrics import Metrics
from kvnode.namespace import digest_of, namespace_spec
from kvnode.outcomes import stored, usable
from kvnode.plan import Plan, cut_flags, recompute_cost, usable_keys
from kvnode.pool import RANK_SHARDED_POOLS, Extent, PoolBinding, UnsupportedPool, probe_layout, shm_extents
from kvnode.touch import MAX_TOUCH_KEYS, TouchLog, leading_keys
from kvnode.wire import Connection, KvnodeError, Region, exists
from kvnode.wire import key as wire_key

try:  # The real base class whenever SGLang is installed; the library imports without it.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
    HAVE_SGLANG = True
except ImportError:  # pragma: no cover - exercised only where sglang is absent
    class _Base:  # type: ignore[no-redef]
        """Stand-in so `import kvnode.sglang.backend` works without SGLang."""

    HAVE_SGLANG = False

# Named by the path deployments configure (kvnode.sglang_backend), which their log configs use.
logger = logging.getLogger("kvnode.sglang_backend")
#: The daemon maps at most this many regions per connection.
MAX_REGIONS = 16
KV = "kv"


def router_hint_fields(hint: Optional[dict], daemon_supports_hints: bool) -> dict:
    """THE single place where a router hint joins a request (Exists, GetToRegion, Get).

    Returns the extra header fields merged into those ops. Until the daemon answers the
    `Timeouts` probe (peer pulls), nothing is attached and requests stay local.
    """
    return hint_field(hint) if daemon_supports_hints else {}


def _pool_key(name: Any) -> str:
    """SGLang's PoolName (a str enum) or a plain string, as the plain value."""
    return str(getattr(name, "value", name))


class _PerThread(threading.local):
    conn: Optional[Connection] = None
    regions: Optional[Dict[int, Region]] = None
    # (prefix length, last key) the next batch of the same lookup carries (`_touch_prefix`).
    next_batch: Optional[Tuple[int, str]] = None


def _flag(extra: dict, name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"kvnode: extra-config {name} must be true or false, got {value!r}")
    return value


class KvnodeStorage(_Base):
    """`--hicache-storage-backend dynamic` backend; see docs/sglang.md for the launch flags."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None):
        self.config = storage_config
        extra = getattr(storage_config, "extra_config", None) or {}
        self.socket_path = str(extra.get("socket") or default_socket())
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = bool(writer) if writer is not None else (not self.is_mla or getattr(storage_config, "tp_rank", 0) == 0)
        self.metrics_on = bool(getattr(storage_config, "enable_storage_metrics", True))
        self.mem_pool_host = None
        self.registered_pools: Dict[Any, Any] = {}
        self._pools: Dict[str, PoolBinding] = {}
        self.flat_ns: Optional[int] = None
        self._tls = _PerThread()
        self._all: List[Connection] = []
        self._lock = threading.Lock()
        self._metrics = Metrics()
        # The router's non-fetch actions (docs/sglang.md "Router actions"); `actions.take()`.
        self.actions = ActionLog(logger)
        self.daemon_timeouts: Optional[dict] = None
        # Fetch or recompute (kvnode.plan): with a cost, lookups send it and take the plan.
        self.recompute = recompute_cost(extra)
        self.last_plan: Optional[Plan] = None
        # Touch of the pages SGLang holds (docs/sglang.md "Touch"); `touches.totals()`.
        self.touch_local_hits = _flag(extra, "touch_local_hits", True)
        self.touches = TouchLog(logger)
        if self.recompute is not None:
            logger.info("kvnode: fetch plans on: recompute %.0f tokens/s + %.3g s/token^2",
                        self.recompute.tokens_per_s, self.recompute.quad_s)
        self._conn()  # fail fast when the daemon is not there
        self.supports_hints = self._probe_timeouts(extra)
        self._warn_if_no_seam()

    # -- connections -----------------------------------------------------------------------
    def _conn(self) -> Connection:
        c = self._tls.conn
        if c is None:
            c = Connection(self.socket_path, client=f"sglang-tp{getattr(self.config, 'tp_rank', 0)}")
            self._tls.conn, self._tls.regions = c, {}
            with self._lock:
                self._all.append(c)
        return c

    def _region(self, c: Connection, e: Extent) -> Region:
        """This thread's attachment of one memfd (attached on first use)."""
        regions = self._tls.regions
        r = regions.get(e.fd)
        if r is None:
            r = regions[e.fd] = c.attach_region(e.fd, e.length)
        return r

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

    def _warn_if_no_seam(self) -> None:
        if not self.supports_hints or not HAVE_SGLANG:
            return
        from kvnode.sglang.seam import seam_installed
        if not seam_installed():
            logger.warning("kvnode: this SGLang does not pass request kv_hints to storage "
                           "backends, so router hints never arrive (peer pulls stay off). Apply "
                           "kvnode's seam: python -m kvnode.sglang patch --apply")

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

    # -- pool registration -----------------------------------------------------------------
    def _bind(self, name: str, host_pool: Any) -> PoolBinding:
        sizes = probe_layout(name, host_pool)
        replicated = self.is_mla and name not in RANK_SHARDED_POOLS
        spec = namespace_spec(self.config, host_pool, sizes, pool="" if name == KV else name,
                              replicated=replicated)
        ns = self._conn().register(spec)["ns"]
        extents = shm_extents(host_pool)
        used = sum(len(b.extents) for b in self._pools.values() if b.host_pool is not host_pool)
        if extents and used + len(extents) > MAX_REGIONS:
            logger.warning("kvnode: pool %s would need region %d of at most %d per connection; "
                           "its pages are copied through the daemon's arena", name,
                           used + len(extents), MAX_REGIONS)
            extents = []
        b = PoolBinding(name, host_pool, ns, sizes, extents, replicated)
        c = self._conn()
        for e in extents:  # attach now on this thread (fail fast); other threads attach on first use
            self._region(c, e)
        if extents:
            logger.info("kvnode: pool %s: zero copy into %d shm extent(s), %d objects per page",
                        name, len(extents), b.seg_n)
        else:
            logger.warning(
                "kvnode: pool %s is not shared memory, pages are copied through the daemon's "
                "arena. Enable zero copy with \"allocator\": \"shm\" in "
                "--hicache-storage-backend-extra-config (inline JSON).", name)
        return b

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV anchor pool (v1 interface, and the v2 pool named "kv")."""
        self.mem_pool_host = mem_pool_host
        self._check_timeouts(int(mem_pool_host.page_size))
        self._pools[KV] = self._bind(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """One v2 pool (PoolName.KV, MAMBA, SWA, INDEXER, DRAFT, ...): its own namespace.

        Raises UnsupportedPool (a ValueError) with SGLang's reason for a pool whose pages
        have no zero-copy layout, so SGLang fails the attach instead of storing wrong KV.
        """
        name = _pool_key(host_pool_name)
        self.registered_pools[host_pool_name] = host_pool
        kv = self._pools.get(KV)
        if name == KV and kv is not None and kv.host_pool is host_pool:
            return  # the anchor registered through v1 already
        self._pools[name] = self._bind(name, host_pool)
        if name == KV and self.mem_pool_host is None:
            self.mem_pool_host = host_pool

    def _binding(self, name: Any) -> PoolBinding:
        b = self._pools.get(_pool_key(name))
        if b is None:
            raise ValueError(f"kvnode: pool {_pool_key(name)!r} was never registered "
                             f"(registered: {sorted(self._pools)})")
        return b

    # Kept for callers of the old single-pool attributes.
    @property
    def ns(self) -> Optional[int]:
        kv = self._pools.get(KV)
        return kv.ns if kv else None

    @property
    def seg_n(self) -> int:
        kv = self._pools.get(KV)
        return kv.seg_n if kv else 1

    @property
    def page_bytes(self) -> int:
        kv = self._pools.get(KV)
        return kv.page_bytes if kv else 0

    @property
    def zero_copy(self) -> bool:
        kv = self._pools.get(KV)
        return bool(kv and kv.zero_copy)

    def _touch_prefix(self, b: PoolBinding, keys: Sequence[str], extra_info: Any) -> None:
        """Touches the pages of `extra_info.prefix_keys`: the request's pages from the sequence
        start that SGLang's radix tree matched on device and host, which it never fetches from
        kvnode. SGLang asks one lookup in batches, each later batch's prefix_keys extended by
        the batch before: only a lookup's first batch names the local hits, so a batch that
        continues this thread's previous one touches nothing (so does a new lookup whose held
        prefix ends exactly where this thread's previous call ended: rare, and those pages were
        just asked for). Never fails the lookup."""
        prefix = getattr(extra_info, "prefix_keys", None) or []
        tls = self._tls
        continues = bool(prefix) and tls.next_batch == (len(prefix), prefix[-1])
        tls.next_batch = (len(prefix) + len(keys), keys[-1]) if keys else None
        if not self.touch_local_hits or not prefix or continues:
            return
        pages = -(-MAX_TOUCH_KEYS // max(1, b.seg_n))
        try:
            conn = self._conn()
        except (KvnodeError, OSError) as e:
            self.touches.failed(e)
            return
        try:
            self.touches.send(conn, b.ns, leading_keys([digest_of(k) for k in prefix[:pages]], b.seg_n))
        except OSError:
            pass  # counted and logged at debug by TouchLog; the lookup reports the connection

    # -- page transfers (one pool) ---------------------------------------------------------
    def _hint(self, extra_info: Any) -> dict:
        return router_hint_fields(extract_router_hint(extra_info), self.supports_hints)

    def _act(self, extra_info: Any, pools: Sequence[tuple]) -> None:
        """Sends the envelope's actions other than kv.fetch for the request's keys, once per
        envelope and key (SGLang asks in batches: each batch's new keys), in each pool's
        namespace: `pools` is (PoolBinding, page keys) pairs. SGLang 0.5.23 gives storage
        backends no request-completion call, so request_completion actions go with the others
        as written and the daemon refuses them by name (logged and counted, never silent).
        A failed `Act` never fails the storage call."""
        acts = split_envelope(extra_info)
        if acts is None:
            return
        for b, keys in pools:
            new = self.actions.claim(acts, UNPLACED, b.ns, b.keys(keys))
            if new is None:
                continue
            try:
                self.actions.send(self._conn(), b.ns, new, acts, UNPLACED, acts.unplaced_text())
            except (KvnodeError, OSError):
                pass  # logged and counted by ActionLog.send

    def _get_pages(self, b: PoolBinding, keys: Sequence[str], host_indices: Any, hint: dict) -> List[bool]:
        c = self._conn()
        return transfer.get_pages(c, lambda e: self._region(c, e), b, keys, host_indices, hint)

    def _put_pages(self, b: PoolBinding, keys: Sequence[str], host_indices: Any) -> List[bool]:
        c = self._conn()
        return transfer.put_pages(c, lambda e: self._region(c, e), b, keys, host_indices)

    # -- presence --------------------------------------------------------------------------
    def _recompute_field(self, b: PoolBinding, extra_info: Any) -> dict:
        """The `recompute` field of a lookup in `b` (nothing without a configured cost): pages
        of `b.page_size` tokens, `b.seg_n` keys each, after the `prefix_keys` SGLang holds."""
        if self.recompute is None:
            return {}
        prefix = getattr(extra_info, "prefix_keys", None) or []
        return self.recompute.wire(b.page_size, b.seg_n, start_tokens=len(prefix) * b.page_size,
                                   via="region" if b.zero_copy else "copy")

    def _took(self, plan: Optional[Plan]) -> None:
        self.last_plan = plan
        if plan is not None:
            logger.debug("kvnode: %s", plan.log_line())

    def _hinted(self, b: PoolBinding, keys: Sequence[str], hint: dict, rc: Optional[dict] = None
                ) -> Tuple[Optional[List[bool]], Optional[HintedExists]]:
        """(per page: present locally or pulled by the hint, the hinted lookup); the flags are
        None without a hint's report, the lookup None without a hint.

        The hint's pull is awaited (up to the daemon's declared timeout) so the answer is exact:
        a page the source turns out not to hold, or that does not arrive in time, is absent,
        and SGLang never reserves host memory for it. With a recompute field `rc` pages past
        the plan's cut are absent too.
        """
        if not hint:
            return None, None
        budget = pull_budget_ms(self.daemon_timeouts, len(keys))
        found = hinted_exists(self._conn(), b.ns, b.keys(keys), {**hint, **(rc or {})}, budget,
                              recount=False)
        if not found.report:
            return None, found
        flags = b.pages([usable(o) for o in found.outcomes], len(keys))
        return cut_flags(flags, found.plan, b.seg_n), found

    def _available(self, b: PoolBinding, keys: Sequence[str], hint: dict) -> Optional[List[bool]]:
        """Per page: present locally or pulled by the hint (None without a hint's report)."""
        return self._hinted(b, keys, hint)[0]

    def _leading(self, b: PoolBinding, keys: Sequence[str], hint: dict, rc: Optional[dict] = None) -> int:
        """Leading pages present, counting those the hint's pull brought in; with a recompute
        field `rc`, cut where the daemon's plan says recomputing the rest is faster."""
        avail, found = self._hinted(b, keys, hint, rc)
        if avail is None:
            if not rc:
                return self._conn().exists(b.ns, b.keys(keys)) // b.seg_n
            if found is None:
                body = exists(self._conn(), b.ns, b.keys(keys), rc)
                plan = Plan.of(body)
                n = usable_keys(int(body["count"]), plan, b.seg_n)
            else:  # hinted, no pull running (the plan left the peer out): the answer stands
                plan, n = found.plan, usable_keys(found.count, found.plan, b.seg_n)
            self._took(plan)
            return n // b.seg_n
        if rc:
            self._took(found.plan if found else None)
        n = 0
        while n < len(avail) and avail[n]:
            n += 1
        return n

    def _each(self, b: PoolBinding, keys: Sequence[str], hint: dict) -> List[bool]:
        """Per page presence (a lease taken and released at once: no bytes move)."""
        avail = self._available(b, keys, hint)
        if avail is not None:
            return avail
        found: List[bool] = []
        self._conn().get_lease_each(b.ns, b.keys(keys),
                                    lambda _at, extents: found.extend(e is not None for e in extents))
        return b.pages(found, len(keys))

    # -- v1 zero-copy interface ------------------------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        t0 = time.perf_counter()
        b = self._binding(KV)
        res = self._get_pages(b, keys, host_indices, self._hint(extra_info))
        self._record(True, res, b.page_bytes, t0)
        self._act(extra_info, [(b, keys)])
        return res

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        if not self.is_writer:  # MLA: one writer per page; every rank reads
            return [True] * len(keys)
        t0 = time.perf_counter()
        b = self._binding(KV)
        res = self._put_pages(b, keys, host_indices)
        self._record(False, res, b.page_bytes, t0)
        return res

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        b = self._binding(KV)
        self._touch_prefix(b, keys, extra_info)
        n = self._leading(b, keys, self._hint(extra_info), self._recompute_field(b, extra_info))
        self._act(extra_info, [(b, keys)])  # after the hint's pull: retains cover pulled pages
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v2 interface ----------------------------------------------------------------------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[list] = None,
                        extra_info: Any = None) -> Any:
        """The usable KV prefix, shrunk so every extra pool can restore it (its hit policy)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

        hint = self._hint(extra_info)
        kv = self._binding(KV)
        self._touch_prefix(kv, keys, extra_info)
        kv_pages = self._leading(kv, keys, hint, self._recompute_field(kv, extra_info)) if keys else 0
        per_pool = []
        for t in pool_transfers or []:
            present = self._each(self._binding(t.name), keys[:kv_pages], hint) if kv_pages else []
            per_pool.append((t.name, t.hit_policy, len(t.keys or []), present))
        final, hits, restorable = hitpolicy.combine(kv_pages, per_pool, kv_name=PoolName.KV)
        if keys:
            extra = [(self._binding(t.name), keys) for t in pool_transfers or []
                     if _pool_key(t.name) != KV]
            self._act(extra_info, [(self._binding(KV), keys), *extra])
        return PoolTransferResult(final, hits, restorable)

    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[Any, List[bool]]:
        hint = self._hint(extra_info)
        out = {}
        for t in transfers:
            keys = list(t.keys or [])
            t0 = time.perf_counter()
            b = self._binding(t.name)
            out[t.name] = self._get_pages(b, keys, t.host_indices, hint) if keys else []
            self._record(True, out[t.name], b.page_bytes, t0)
            if keys:
                self._act(extra_info, [(b, keys)])
        return out

    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[Any, List[bool]]:
        out = {}
        for t in transfers:
            keys = list(t.keys or [])
            b = self._binding(t.name)
            if b.replicated and not self.is_writer:
                out[t.name] = [True] * len(keys)  # replicated bytes: the writer stores them
                continue
            t0 = time.perf_counter()
            out[t.name] = self._put_pages(b, keys, t.host_indices) if keys else []
            self._record(False, out[t.name], b.page_bytes, t0)
        return out

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
        return all(stored(s) for s in st)

    # -- lifecycle -------------------------------------------------------------------------
    def _record(self, prefetch: bool, res: List[bool], page_bytes: int, t0: float) -> None:
        if self.metrics_on:
            with self._lock:
                self._metrics.record(prefetch, sum(res), page_bytes, time.perf_counter() - t0)

    def clear(self) -> bool:
        """Removes every page of this rank's namespaces; raises KvnodeError if refused."""
        c = self._conn()
        spaces = {b.ns for b in self._pools.values()} | ({self.flat_ns} if self.flat_ns is not None else set())
        n = sum(c.clear(ns) for ns in sorted(spaces))
        logger.info("kvnode: cleared %d blocks", n)
        return True

    def get_stats(self) -> Any:
        with self._lock:
            m, self._metrics = self._metrics, Metrics()
        return m.to_sglang()

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
        self._tls = _PerThread()


__all__ = ["KvnodeStorage", "UnsupportedPool", "router_hint_fields", "default_socket", "HAVE_SGLANG"]
