"""Non-blocking lookups for the kvnode tier: vLLM's own AsyncLookupManager answering from the daemon.

vLLM's scheduler calls `lookup` per chunk on its own thread; vLLM's `AsyncLookupManager` returns
None ("retry next step") for a key it has not seen, batches every key of the step and hands the
batch to one background thread at `on_schedule_end`. Here that thread answers a request's keys
with one `Exists` per KV cache group (the count of leading keys present); for a group with a
sliding window, whose lookups are suffix lookups, the keys after the first gap are asked one by
one. A daemon that is down or answers with an error makes the whole batch a miss (vLLM logs it).

Router hints: a request whose `ReqContext.kv_hints` (or `kv_transfer_params`) carries a Dynamo
`kv.fetch` goes to a second manager, so that its wait never holds plain lookups back: its first
batch sends the hint with `Exists` (the daemon starts pulling the named peer's blocks into its
own tier), waits on the pull (bounded by the daemon's declared timeout and `hint_wait_s`), then
answers like a plain lookup. Pulled blocks are then ordinary local hits and load like any other.

Fetch plans (a `recompute_tokens_per_s` in the tier's config, kvnode.plan): every `Exists` of a
group without a sliding window carries the engine's recompute cost (chunks of the group's tokens;
`start_tokens` from the request's recorded position of the batch's first key when vLLM has one,
else 0), and only the chunks before the plan's cut answer True: the rest miss and vLLM computes
them. The hinted `Exists` carries it too, so the daemon pulls from the peer only if the plan
takes it. Each plan's reason is logged at debug; `plan_cut_keys` counts the chunks it left out.

Router actions other than kv.fetch (`Actions`, kept in ReqContext): after a request's batch is
answered (and its hint's pull waited for), the same thread sends them in one `Act` on that
batch's keys, each key once per envelope; a failed `Act` is logged and counted, never a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvnode.actions import NOW, ActionLog
from kvnode.common import hint_field, hinted_exists, pull_budget_ms
from kvnode.hints import RequestActions
from kvnode.plan import Plan, RecomputeCost, usable_keys
from kvnode.vllm_tier.namespace import split_key, wire_key
from kvnode.wire import Connection, KvnodeError, exists, open_namespace

logger = logging.getLogger("kvnode.vllm_tier")


class Hint:
    """A request's normalized router hint (`kvnode.hints.extract_router_hint`), kept in ReqContext."""

    def __init__(self, hint: dict):
        self.hint = hint

    def field(self) -> Dict[str, Any]:
        return hint_field(self.hint)


class Actions:
    """A request's router actions other than kv.fetch (`kvnode.hints.split_envelope`), kept in
    ReqContext, and the keys the request named to the tier (its lookups and stores), on which
    its request_completion actions run when it ends."""

    #: ActionLog scope: the tier's one namespace.
    SCOPE = 0

    def __init__(self, acts: RequestActions):
        self.acts = acts
        self._lock = threading.Lock()
        self._keys: Dict[bytes, None] = {}  # OffloadKeys in first-seen order
        self.sent_now = False  # the immediate actions reached the daemon once

    def saw(self, keys: Iterable[OffloadKey]) -> None:
        with self._lock:
            for k in keys:
                self._keys.setdefault(bytes(k), None)

    def keys(self) -> List[bytes]:
        with self._lock:
            return list(self._keys)


class LookupCounters:
    """Counters of one lookup thread (read and reset by the tier's get_stats)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.v: Dict[str, float] = {}
        self.rtts: List[float] = []

    def add(self, name: str, n: float = 1) -> None:
        with self.lock:
            self.v[name] = self.v.get(name, 0) + n

    def rtt(self, s: float) -> None:
        with self.lock:
            self.rtts.append(s)

    def take(self):
        with self.lock:
            v, r = self.v, self.rtts
            self.v, self.rtts = {}, []
        return v, r


class DaemonLookup(AsyncLookupManager):
    """batch_lookup by `Exists` on this thread's own daemon connection."""

    def __init__(self, tier_type: str, connect: Callable[[], Connection],
                 register: Callable[[Connection], int], windowed: Set[int], hinted: bool,
                 hint_wait_s: float, counters: LookupCounters, actions: Optional[ActionLog] = None,
                 recompute: Optional[RecomputeCost] = None, chunk_tokens: Optional[Dict[int, int]] = None,
                 via: str = "copy"):
        self._connect, self._register = connect, register
        self._recompute, self._chunk_tokens, self._via = recompute, dict(chunk_tokens or {}), via
        self._actions = actions
        self._windowed, self._hinted, self._hint_wait_s = windowed, hinted, hint_wait_s
        self._counters = counters
        self._conn: Optional[Connection] = None
        self._ns = 0
        self._timeouts: Optional[dict] = None
        self._pulled: Set[str] = set()
        super().__init__(tier_type=f"{tier_type}{'-hinted' if hinted else ''}")

    # -- lookup thread ---------------------------------------------------------------------
    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn, self._ns, self._timeouts = open_namespace(self._connect, self._register)
        return self._conn

    def _exists(self, keys: List[list], extra: Optional[dict] = None) -> Dict[str, Any]:
        t0 = time.perf_counter()
        body = exists(self._connection(), self._ns, keys, extra)
        self._counters.rtt(time.perf_counter() - t0)
        self._counters.add("lookup_calls")
        return body

    def batch_lookup(self, keys: List[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        try:
            return self._lookup(keys, req_context)
        except (KvnodeError, OSError) as e:
            self._counters.add("lookup_errors")
            if self._conn is not None:
                try:
                    self._conn.close()
                except OSError:
                    pass
                self._conn = None
            raise RuntimeError(f"kvnode daemon: {e}") from e

    def _lookup(self, keys: List[OffloadKey], req_context: ReqContext) -> List[bool]:
        self._connection()
        by_group: Dict[int, List[int]] = {}
        for i, k in enumerate(keys):
            by_group.setdefault(split_key(k)[1], []).append(i)
        hint = req_context.get_state(Hint) if self._hinted else None
        if hint is not None and self._timeouts is not None and req_context.req_id not in self._pulled:
            self._pulled.add(req_context.req_id)
            g0 = min(by_group)
            first = by_group[g0]
            self._pull([wire_key(keys[i]) for i in first], hint,
                       self._recompute_field(g0, keys[first[0]], req_context))
        out = [False] * len(keys)
        for g, idxs in by_group.items():
            wk = [wire_key(keys[i]) for i in idxs]
            rc = self._recompute_field(g, keys[idxs[0]], req_context)
            body = self._exists(wk, rc or None)
            plan = Plan.of(body)
            count = usable_keys(int(body["count"]), plan)
            if plan is not None:
                self._counters.add("plan_cut_keys", int(body["count"]) - count)
                logger.debug("kvnode tier lookup of %d chunks (group %d) for %s: %s", len(wk), g,
                             req_context.req_id, plan.log_line())
            for i in idxs[:count]:
                out[i] = True
            if g in self._windowed:  # suffix lookups: a gap does not end the answer
                for i, w in zip(idxs[count + 1:], wk[count + 1:]):
                    out[i] = self._exists([w])["count"] == 1
        self._counters.add("lookup_keys", len(keys))
        self._counters.add("lookup_hits", sum(out))
        self._act(keys, req_context)
        return out

    def _act(self, keys: List[OffloadKey], req_context: ReqContext) -> None:
        """The request's immediate actions on this batch's keys not yet sent (after the
        lookup: a kv.retain covers blocks the hint pulled). Never fails the lookup."""
        state = req_context.get_state(Actions)
        if state is None or self._actions is None:
            return
        state.saw(keys)
        text = state.acts.now_text()
        if text is None:
            return
        new = self._actions.claim(state.acts, NOW, Actions.SCOPE, [wire_key(k) for k in keys])
        if new is None:
            return
        state.sent_now = True
        try:
            self._actions.send(self._connection(), self._ns, new, state.acts, NOW, text, Actions.SCOPE)
        except (KvnodeError, OSError):
            pass  # logged and counted by ActionLog.send

    def _recompute_field(self, group: int, first: OffloadKey, req_context: ReqContext) -> dict:
        """The `recompute` field of a lookup of `group`'s chunks starting at `first` (nothing
        without a cost, or for a sliding-window group, whose lookups are not prefix lookups)."""
        if self._recompute is None or group in self._windowed:
            return {}
        chunk = int(self._chunk_tokens.get(group, 0) or 0)
        if chunk <= 0:
            return {}
        pos = req_context.get_offload_key_position(first)
        start = max(0, int(pos) - chunk) if pos is not None else 0
        return self._recompute.wire(chunk, 1, start_tokens=start, via=self._via)

    def _pull(self, wk: List[list], hint: Hint, rc: Optional[dict] = None) -> None:
        """The hint's pull, waited for; the plain lookup that follows counts what it brought.
        With a recompute field `rc` the daemon pulls only if its plan takes the peer."""
        budget = pull_budget_ms(self._timeouts, len(wk), cap_s=self._hint_wait_s)
        found = hinted_exists(self._connection(), self._ns, wk, {**hint.field(), **(rc or {})}, budget,
                              recount=False, ask=self._exists)
        if found.plan is not None:
            logger.debug("kvnode tier hinted lookup of %d chunks: %s", len(wk), found.plan.log_line())
        started = found.started or {}
        if not started or (started.get("state") == "Failed" and started.get("reason")):
            return  # refused at once (not authorized, malformed, not covered): local only
        self._counters.add("hinted_pulls")
        self._counters.add("hinted_pulled_blocks", sum(1 for o in found.outcomes if o == "Pulled"))

    def cleanup(self, req_id: str) -> None:
        super().cleanup(req_id)
        self._pulled.discard(req_id)  # set ops are atomic under the GIL

    def shutdown(self) -> None:
        super().shutdown()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
