"""SGLang 0.5.23's request and prefetch path, driven in-process on CPU for the end-to-end tests.

Every step runs SGLang's own code:
  HTTP body -> GenerateReqInput -> http_server.serve_generate_request (the seam's router-token
     gate of /generate runs inside it)
  -> TokenizerManager._create_tokenized_object -> TokenizedGenerateReqInput
  -> Req (built with the arguments Scheduler.handle_generate_request passes)
  -> Scheduler._prefetch_kvcache -> UnifiedRadixCache.prefetch_from_storage
  -> HybridCacheController.submit_prefetch, its prefetch thread (_storage_hit_query: batch_exists /
     batch_exists_v2) and IO thread (_page_transfer: batch_get_v1, sidecars batch_get_v2)
  -> KvnodeStorage -> the kvnode daemon -> SGLang's host pool.
What is NOT SGLang's: the objects those methods are called on are built here without their
constructors (no GPU, no model, no process groups): the tokenizer manager, the scheduler, the
radix tree (which matches nothing: every token is a storage candidate) and the controller's
device side. Their attributes are the ones those methods read; this module names each.

One step between SGLang's threads is done here rather than by SGLang: taking a storage hit off
`prefetch_hit_queue`, allocating host pages for it and handing it to the IO thread
(`Worker.prefetch`; in SGLang, `UnifiedRadixCache.check_hicache_events` ->
`_drain_and_alloc_storage_hit`, which needs the whole radix tree, its retry and staging state
and the scheduler's policy thresholds). That step is not part of the KV-hint seam (the patch
does not touch unified_radix_cache.py) and reads nothing kvnode returns beyond
`storage_hit_count`; SGLang's own controller tests stand in for it the same way
(`op.host_indices = pool.alloc(op.storage_hit_count)`). What it decides (a hit below the
prefetch threshold is dropped, a full host pool defers it) is therefore not covered here.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from queue import Empty, Queue
from types import SimpleNamespace
from typing import Optional

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams

VOCAB = 1 << 20
_published = None


def publish_defaults() -> None:
    """SGLang's own test hook: publish a default ServerArgs (runtime config bags) once."""
    global _published
    if _published is None:
        _published = get_context().override_server_args()
        _published.install()


def request_from_http(body: bytes, headers: Optional[dict] = None) -> GenerateReqInput:
    """What /generate does with a body before tokenizing it: FastAPI's dataclass decode, then
    SGLang's own `serve_generate_request` (patched by the seam: it gates kv_hints on the router
    token) with a real starlette Request carrying `headers`, up to the point where it hands the
    request to the tokenizer manager, then normalization, which decodes the envelope. The
    tokenizer manager is the one object stood in for: it records what it was handed."""
    from sglang.srt.entrypoints import http_server
    from starlette.requests import Request

    obj = GenerateReqInput(**json.loads(body))
    scope = {"type": "http", "method": "POST", "path": "/generate", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    handed = []

    class _Manager:
        async def generate_request(self, o, request):
            handed.append(o)
            yield {"text": "", "meta_info": {}}

    saved = http_server._global_state
    http_server._global_state = SimpleNamespace(tokenizer_manager=_Manager())
    try:
        asyncio.run(http_server.serve_generate_request(obj, Request(scope)))
    finally:
        http_server._global_state = saved
    assert handed == [obj], "serve_generate_request did not hand the request on"
    obj.normalize_batch_and_arguments()
    return obj


def tokenize(obj: GenerateReqInput) -> TokenizedGenerateReqInput:
    """TokenizerManager._create_tokenized_object on a request given as token ids."""
    publish_defaults()
    manager = SimpleNamespace(
        preferred_sampling_params=None, sampling_params_class=SamplingParams, tokenizer=None,
        model_config=SimpleNamespace(vocab_size=VOCAB),
        tokenized_generate_req_type=TokenizedGenerateReqInput, fake_bootstrap_room_counter=0,
        rid_to_state=collections.defaultdict(lambda: SimpleNamespace(time_stats=APIServerReqTimeStats())))
    return TokenizerManager._create_tokenized_object(manager, obj, None, list(obj.input_ids))


def to_req(tok: TokenizedGenerateReqInput) -> Req:
    """The Req the scheduler builds (Scheduler.handle_generate_request passes kv_hints through)."""
    return Req(tok.rid, tok.input_text, tok.input_ids, tok.sampling_params, kv_hints=tok.kv_hints,
               vocab_size=VOCAB, extra_key=tok.extra_key, cache_salt=tok.cache_salt)


class _Root:
    """The radix tree's root node."""


class _Lock:
    def to_dec_params(self):
        return None


class TreeCache:
    """A radix tree that holds nothing, with UnifiedRadixCache's own prefetch_from_storage."""

    prefetch_from_storage = UnifiedRadixCache.prefetch_from_storage
    _build_sidecar_transfers = UnifiedRadixCache._build_sidecar_transfers

    def __init__(self, controller: HybridCacheController, page_size: int, sidecar_pool_specs=()):
        self.root = _Root()
        self.cache_controller = controller
        self.page_size = page_size
        self.enable_storage = True
        self.host_memory_mode = "cache"
        self.hicache_storage_pass_prefix_keys = False
        self.prefetch_threshold = page_size
        self.storage_prefetch_retries = SimpleNamespace(cancel=lambda rid: None,
                                                        poll_miss=lambda rid, end: None)
        self._storage_prefetch_wait = {}
        self.ongoing_prefetch = {}
        self.buffer_pipeline = None
        self.tree_core = SimpleNamespace(is_eagle=False, prefetch_anchor_info=lambda node: (None, None))
        self._prefetch_outcome_stats = collections.defaultdict(int)
        self.tree_components = (ComponentType.FULL,)
        self.components = {}
        self.sidecar_pool_specs = tuple(sidecar_pool_specs)  # KV-indexed side pools (DSA indexer)

    # what Scheduler._prefetch_kvcache and Req.init_next_round_input ask of a tree
    def match_prefix(self, params) -> MatchResult:
        return MatchResult(0, self.root, self.root, self.root)

    def swa_reprefill_tail_tokens(self, req) -> int:
        return 0

    def supports_mamba(self) -> bool:
        return False

    def is_root(self, node) -> bool:
        return node is self.root

    def is_backuped(self, node) -> bool:
        return False

    def get_last_hash_value(self, node):
        return None

    def get_prefix_hash_values(self, node):
        return []

    def inc_host_lock_ref(self, node):
        return _Lock()


class Worker:
    """One SGLang worker's L3 path: SGLang's HybridCacheController threads over a real host pool
    (in a real HostPoolGroup) and a KvnodeStorage, with the controller's device half absent."""

    def __init__(self, storage, host_pool, extra_pools: Optional[dict] = None, sidecar_pool_specs=()):
        c = HybridCacheController.__new__(HybridCacheController)
        entries = [PoolEntry(PoolName.KV, host_pool, None, lambda i: i, is_primary_index_anchor=True)]
        entries += [PoolEntry(n, p, None, lambda i: i) for n, p in (extra_pools or {}).items()]
        c.mem_pool_host = HostPoolGroup(entries)
        c.storage_host_pool = host_pool
        c.storage_backend = storage
        c.enable_storage = True
        c.page_size = host_pool.page_size
        c.host_memory_mode = "cache"
        c.pp_prefetch_command_group = None
        c.prefetch_hits_sync_groups = []  # one rank: the MIN all-reduce has no peers
        c.prefetch_tokens_occupied = 0
        c.prefetch_capacity_limit = host_pool.size
        c.storage_stop_event = threading.Event()
        for q in ("prefetch_queue", "prefetch_hit_queue", "prefetch_buffer", "prefetch_sync_queue"):
            setattr(c, q, Queue())
        c.page_get_func = c._page_get_zero_copy
        self.controller = c
        self.host_pool = host_pool
        self.tree = TreeCache(c, host_pool.page_size, sidecar_pool_specs)
        self.scheduler = SimpleNamespace(enable_hicache_storage=True, enable_lmcache=False,
                                         tree_cache=self.tree)
        self._threads = [threading.Thread(target=HiCacheController.prefetch_thread_func, args=(c,), daemon=True),
                         threading.Thread(target=HiCacheController.prefetch_io_aux_func, args=(c,), daemon=True)]
        for t in self._threads:
            t.start()

    def prefetch(self, req: Req, timeout: float = 30.0) -> int:
        """Scheduler._prefetch_kvcache, then what the scheduler thread does with the hit:
        allocate host memory for it and hand it to the IO thread. Returns the tokens loaded."""
        Scheduler._prefetch_kvcache(self.scheduler, req)
        op = self.tree.ongoing_prefetch[req.cache_request_handle].operation
        c = self.controller
        got = c.prefetch_hit_queue.get(timeout=timeout)
        assert got is op
        if op.storage_hit_count == 0:
            return 0
        op.host_indices = self.host_pool.alloc(op.storage_hit_count)
        assert op.host_indices is not None, "host pool full"
        c.prefetch_buffer.put(op)
        done, deadline = 0, time.monotonic() + timeout
        while True:
            try:
                ack = c.prefetch_sync_queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError("the prefetch IO thread did not finish") from None
            if ack.completed_req:
                return done
            if ack.completed_tokens is not None:
                done = ack.completed_tokens

    def close(self) -> None:
        self.controller.storage_stop_event.set()
        for q in (self.controller.prefetch_queue, self.controller.prefetch_buffer):
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)
