"""Non-blocking prefix lookups for the scheduler: batched `Exists` on a background thread.

vLLM's scheduler asks `get_num_new_matched_tokens` from its one thread, every step, for every
waiting request; it must never wait on a socket there. `LookupService.submit` queues a lookup
(the request's leading block digests, and its router hint if any); one thread with its own
daemon connection answers it with one `Exists` (count of leading keys present). A request with
a hint gets a hinted `Exists`, which starts the daemon's pull from the named peer; the thread
then `Wait`s on that pull (bounded by the daemon's declared timeout and `hint_wait_s`) and asks
again, so the request is scheduled only once the pulled blocks are local (docs/peer-protocol.md).
Until the answer is there, `result` returns None: vLLM then skips the request this step.

The request's other router actions (`submit_act`) go through the same queue and connection, so
the `Act` of a request's immediate actions runs after its lookup (and a hinted pull: a
`kv.retain` then covers the pulled blocks); kvnode.actions logs and counts the answers.

A daemon that is down or refuses answers "0 blocks" (the request is computed, never blocked).

Touches (`submit_touch`, kvnode.touch): the blocks vLLM's own prefix cache already holds go to
the daemon in one `Touch` on the same thread and connection, after the request's lookup, so the
daemon's DRAM policy keeps the prefixes vLLM never fetches. A failed touch is logged at debug and
counted (`touches`), never a miss or a stall.

With a recompute cost (`recompute_tokens_per_s`, kvnode.plan) every `Exists` carries it and the
answer is the daemon's fetch plan: the leading blocks worth loading, cut where recomputing the rest
is faster (a hint's pull then starts only if the plan takes the peer). Its reason is logged at debug.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from kvnode.actions import ActionLog
from kvnode.common import hint_field, hinted_exists, pull_budget_ms
from kvnode.hints import RequestActions
from kvnode.plan import Plan, RecomputeCost, usable_keys
from kvnode.touch import TouchLog, leading_keys
from kvnode.wire import Connection, KvnodeError, exists, open_namespace

logger = logging.getLogger("kvnode.vllm")


@dataclass
class Lookup:
    """One submitted lookup. `blocks` is set (whole blocks present, leading) when `done` is."""

    digests: List[bytes]
    hint: Optional[dict]
    done: threading.Event = field(default_factory=threading.Event)
    blocks: int = 0
    pulled: bool = False
    reason: Optional[str] = None
    plan: Optional[Plan] = None


@dataclass
class _Act:
    """One queued `Act`: the claimed keys and the envelope text of one phase."""

    keys: List[list]
    acts: RequestActions
    phase: str
    text: str


@dataclass
class _Touch:
    """One queued `Touch`: the keys of blocks vLLM's prefix cache holds, leading first."""

    keys: List[list]


#: ActionLog scope of this service's one namespace.
_SCOPE = 0


class LookupService:
    """Answers prefix lookups on one background thread (one daemon connection)."""

    def __init__(self, connect: Callable[[], Connection], register: Callable[[Connection], int],
                 nseg: int, hint_wait_s: float, recompute: Optional[RecomputeCost] = None,
                 block_tokens: int = 1, via: str = "gpu"):
        self._connect = connect
        self._recompute = recompute
        self._block_tokens = block_tokens
        self._via = via
        self._register = register
        self._nseg = nseg
        self._hint_wait_s = hint_wait_s
        self._lock = threading.Lock()
        self._lookups: Dict[str, Lookup] = {}
        self._q: "queue.Queue[Any]" = queue.Queue()  # req_id, an _Act, or None (stop)
        self._conn: Optional[Connection] = None
        self._ns = 0
        self._timeouts: Optional[dict] = None
        self.served = 0
        self.actions = ActionLog(logger)
        self.touches = TouchLog(logger)
        self._thread = threading.Thread(target=self._run, name="kvnode-lookup", daemon=True)
        self._thread.start()

    # -- scheduler thread ------------------------------------------------------------------
    def submit(self, req_id: str, digests: List[bytes], hint: Optional[dict]) -> Lookup:
        lk = Lookup(list(digests), hint)
        with self._lock:
            self._lookups[req_id] = lk
        self._q.put(req_id)
        return lk

    def get(self, req_id: str) -> Optional[Lookup]:
        with self._lock:
            return self._lookups.get(req_id)

    def submit_act(self, digests: List[bytes], acts: RequestActions, phase: str,
                   text: Optional[str]) -> None:
        """Queues the `Act` of one phase of a request's actions (kvnode.actions) on the blocks
        `digests` (every segment), for the keys this envelope was not yet sent with."""
        if text is None:
            return
        keys = self.actions.claim(acts, phase, _SCOPE, [[d, s] for d in digests for s in range(self._nseg)])
        if keys is not None:
            self._q.put(_Act(keys, acts, phase, text))  # type: ignore[arg-type]

    def submit_touch(self, digests: List[bytes]) -> None:
        """Queues a `Touch` of the blocks `digests` (every segment; at most MAX_TOUCH_KEYS keys)."""
        if digests:
            self._q.put(_Touch(leading_keys(digests, self._nseg)))  # type: ignore[arg-type]

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._lookups.pop(req_id, None)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- lookup thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:  # connect ahead of the first request (handshake, Register, Timeouts)
            self._connection()
        except (KvnodeError, OSError) as e:
            logger.warning("kvnode daemon not reachable yet (%s); lookups answer 0 until it is", e)
            self._conn = None
        while True:
            req_id = self._q.get()
            if req_id is None:
                return
            if isinstance(req_id, _Act):
                self._act(req_id)
                continue
            if isinstance(req_id, _Touch):
                self._touch(req_id)
                continue
            lk = self.get(req_id)
            if lk is None or lk.done.is_set():
                continue
            try:
                lk.blocks, lk.pulled = self._answer(lk)
            except (KvnodeError, OSError) as e:
                # Down or refusing daemon: a miss, never a stall. Reconnect on the next lookup.
                lk.blocks, lk.reason = 0, str(e)
                logger.warning("kvnode lookup failed (%s); request %s computes its prefix", e, req_id)
                if self._conn is not None:
                    try:
                        self._conn.close()
                    except OSError:
                        pass
                    self._conn = None
            self.served += 1
            lk.done.set()

    def _act(self, job: _Act) -> None:
        try:
            conn = self._connection()
        except (KvnodeError, OSError) as e:
            self.actions.undelivered(job.acts, job.phase, _SCOPE, e)
            self._conn = None
            return
        try:
            self.actions.send(conn, self._ns, job.keys, job.acts, job.phase, job.text, _SCOPE)
        except (KvnodeError, OSError):
            try:  # logged and counted; reconnect on the next request
                conn.close()
            except OSError:
                pass
            self._conn = None

    def _touch(self, job: _Touch) -> None:
        try:
            conn = self._connection()
        except (KvnodeError, OSError) as e:
            self.touches.failed(e)
            self._conn = None
            return
        try:
            self.touches.send(conn, self._ns, job.keys)
        except OSError:
            try:  # logged and counted; reconnect on the next request
                conn.close()
            except OSError:
                pass
            self._conn = None

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn, self._ns, self._timeouts = open_namespace(self._connect, self._register)
        return self._conn

    def _exists(self, keys: List[list], extra: Optional[dict] = None) -> Dict[str, Any]:
        return exists(self._connection(), self._ns, keys, extra)

    def _answer(self, lk: Lookup):
        if not lk.digests:
            return 0, False
        keys = [[d, s] for d in lk.digests for s in range(self._nseg)]
        conn = self._connection()
        # The digests start at the prompt's first block: nothing before them is held.
        rc = {} if self._recompute is None else self._recompute.wire(self._block_tokens, self._nseg,
                                                                      via=self._via)
        if lk.hint is None or self._timeouts is None:
            body = self._exists(keys, rc or None)
            lk.plan = Plan.of(body)
            self._log_plan(lk)
            return usable_keys(int(body["count"]), lk.plan, self._nseg) // self._nseg, False
        budget = pull_budget_ms(self._timeouts, len(lk.digests), cap_s=self._hint_wait_s)
        found = hinted_exists(conn, self._ns, keys, {**hint_field(lk.hint), **rc}, budget)
        lk.plan = found.plan
        self._log_plan(lk)
        if found.reason:
            lk.reason = found.reason
        pulled = found.waited or bool((found.started or {}).get("peer"))
        return found.count // self._nseg, pulled

    @staticmethod
    def _log_plan(lk: Lookup) -> None:
        if lk.plan is not None:
            logger.debug("kvnode lookup of %d blocks: %s", len(lk.digests), lk.plan.log_line())
