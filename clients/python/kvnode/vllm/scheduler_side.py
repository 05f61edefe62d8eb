"""The scheduler half of the kvnode vLLM connector, on plain values (no vllm import).

Per request it remembers: how many leading blocks the daemon holds (the lookup), which blocks
to onload this step (after vLLM allocated them), how many leading blocks are already in kvnode
or on their way (so each block is offloaded once), and whether any offload was issued (then
vLLM must not free the request's blocks until the workers report the offloads done).

The blocks vLLM's own prefix cache already holds at the lookup ([0, num_computed_tokens)) are
touched in the daemon (kvnode.touch) once per scheduling of the request, so the daemon's DRAM
policy keeps the prefixes vLLM never fetches from it; the touch runs on the lookup thread.

A request's router actions other than kv.fetch (kvnode.hints.split_envelope) go to the daemon
through the lookup thread: the immediate ones when the request arrives, after its lookup; the
request_completion ones when it finishes, or, when it offloaded blocks, once the workers report
those offloads done (so a deferred kv.retain finds the request's blocks in the daemon).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set

from kvnode.actions import COMPLETION, NOW
from kvnode.hints import RequestActions
from kvnode.vllm.keys import block_hashes_per_block, digest_of
from kvnode.vllm.lookup import LookupService
from kvnode.vllm.plan import BlockMove, StepPlan


@dataclass
class _Req:
    hit_blocks: int = 0          # leading blocks the daemon holds (last lookup)
    local_tokens: int = 0        # vLLM-local computed tokens at the lookup
    saved_blocks: int = 0        # leading blocks in kvnode or being offloaded
    offloaded: bool = False      # any offload issued: free only after the workers say so
    load: Optional[BlockMove] = None
    load_first: int = 0          # block index of the first loaded block
    hold_until: int = 0          # no offload before this step (a load's outcome is unknown)
    touched: bool = False        # its local prefix hits were touched since it was last scheduled


class SchedulerSide:
    """Lookup, load planning and save planning for one vLLM scheduler."""

    def __init__(self, lookup: LookupService, block_size: int, hash_block_size: int,
                 lookup_wait_s: float, load: bool, save: bool, steps_in_flight: int = 1,
                 touch: bool = True):
        self.lookup = lookup
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.lookup_wait_s = lookup_wait_s
        self.load_enabled = load
        self.save_enabled = save
        self.touch_enabled = touch
        self._reqs: Dict[str, _Req] = {}
        # Steps scheduled before the previous ones' outputs come back (vLLM's
        # max_concurrent_batches: 1, 2 with async scheduling, PP size with PP).
        self.steps_in_flight = max(1, steps_in_flight)
        self._step = 0
        self._preempted: List[str] = []
        self._awaiting_free: Set[str] = set()
        self._actions: Dict[str, RequestActions] = {}
        # request_completion actions held until the request's offloads are done.
        self._at_free: Dict[str, tuple] = {}
        # Counters for metrics / stats.
        self.lookups = 0
        self.hit_tokens = 0
        self.pending_answers = 0

    def _digests(self, hashes: Sequence[bytes], limit_blocks: int) -> List[bytes]:
        per_block = block_hashes_per_block(hashes, self.block_size, self.hash_block_size)
        return [digest_of(h) for h in per_block[:limit_blocks]]

    def _state(self, req_id: str) -> _Req:
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = _Req()
        return st

    # -- lookups ---------------------------------------------------------------------------
    def submit_lookup(self, req_id: str, hashes: Sequence[bytes], num_tokens: int,
                      hint: Optional[dict]) -> None:
        """Starts the daemon lookup of the request's full prompt blocks (no waiting)."""
        if not self.load_enabled:
            return
        self._state(req_id)
        self.lookups += 1
        self.lookup.submit(req_id, self._digests(hashes, num_tokens // self.block_size), hint)

    def submit_actions(self, req_id: str, acts: Optional[RequestActions], hashes: Sequence[bytes],
                       num_tokens: int) -> None:
        """Sends the request's immediate actions on its full prompt blocks (once per envelope
        and block; no waiting) and keeps its request_completion ones for `request_finished`."""
        if acts is None:
            return
        self._actions[req_id] = acts
        self.lookup.submit_act(self._digests(hashes, num_tokens // self.block_size), acts, NOW,
                               acts.now_text())

    def matched_tokens(self, req_id: str, hashes: Sequence[bytes], num_tokens: int,
                       num_computed_tokens: int, hint: Optional[dict]) -> Optional[int]:
        """Tokens beyond `num_computed_tokens` that kvnode can load, or None while the
        daemon's answer (or a hinted pull) is pending. Waits at most `lookup_wait_s`.
        The blocks vLLM holds already, [0, num_computed_tokens), are touched (queued)."""
        self._touch_local_hits(req_id, hashes, num_computed_tokens)
        if not self.load_enabled:
            return 0
        lk = self.lookup.get(req_id)
        if lk is None:
            self.submit_lookup(req_id, hashes, num_tokens, hint)
            lk = self.lookup.get(req_id)
        assert lk is not None
        if not lk.done.wait(self.lookup_wait_s):
            self.pending_answers += 1
            return None
        st = self._state(req_id)
        st.hit_blocks = lk.blocks
        st.local_tokens = num_computed_tokens
        st.saved_blocks = max(st.saved_blocks, lk.blocks)
        # vLLM must compute at least one token of the prompt itself.
        hit = min(lk.blocks * self.block_size, num_tokens - 1)
        return max(0, hit - num_computed_tokens)

    def _touch_local_hits(self, req_id: str, hashes: Sequence[bytes], num_computed_tokens: int) -> None:
        """Queues the touch of the request's whole blocks in vLLM's prefix cache, once until it
        is scheduled (vLLM asks again each step while the lookup is pending)."""
        blocks = num_computed_tokens // self.block_size
        if not self.touch_enabled or blocks <= 0:
            return
        st = self._state(req_id)
        if st.touched:
            return
        st.touched = True
        self.lookup.submit_touch(self._digests(hashes, blocks))

    def after_alloc(self, req_id: str, hashes: Sequence[bytes], block_ids: Sequence[int],
                    num_external_tokens: int) -> None:
        """Plans the onload of the blocks vLLM allocated for the `num_external_tokens`."""
        st = self._state(req_id)
        # The answer is used up: a preempted request that comes back asks again (and touches
        # the blocks vLLM then holds).
        self.lookup.forget(req_id)
        st.touched = False
        if num_external_tokens <= 0:
            return
        first = st.local_tokens // self.block_size
        end = -(-(st.local_tokens + num_external_tokens) // self.block_size)
        digests = self._digests(hashes, end)[first:end]
        ids = list(block_ids[first:end])
        if len(digests) != end - first or len(ids) != end - first:
            raise RuntimeError(f"kvnode: request {req_id} has {len(digests)} hashes and {len(ids)} "
                               f"blocks for blocks [{first}, {end})")
        st.load = BlockMove(req_id, digests, ids)
        st.load_first = first
        self.hit_tokens += num_external_tokens

    # -- per step --------------------------------------------------------------------------
    def build_plan(self, scheduled: Sequence[tuple], preempted: Sequence[str]) -> StepPlan:
        """`scheduled`: (req_id, hashes, block_ids, tokens_computed_after_this_step) for each
        request scheduled this step. Returns the step's plan and resets the per-step state."""
        self._step += 1
        plan = StepPlan(preempted=list(preempted))
        for st in self._reqs.values():
            if st.load is not None:
                plan.loads.append(st.load)
                st.load = None
                # Blocks computed in this step depend on the loaded ones: offer none of them
                # until this step's outcome (load errors) is known to the scheduler.
                st.hold_until = self._step + self.steps_in_flight
        if self.save_enabled:
            for req_id, hashes, block_ids, tokens_after in scheduled:
                st = self._state(req_id)
                if self._step < st.hold_until:
                    continue
                full = min(tokens_after // self.block_size, len(block_ids),
                           len(hashes) * self.hash_block_size // self.block_size)
                if full <= st.saved_blocks:
                    continue
                digests = self._digests(hashes, full)[st.saved_blocks:full]
                plan.saves.append(BlockMove(req_id, digests, list(block_ids[st.saved_blocks:full])))
                st.saved_blocks = full
                st.offloaded = True
        return plan

    def request_finished(self, req_id: str, hashes: Sequence[bytes] = ()) -> bool:
        """True when vLLM must keep the request's blocks until the workers report its
        offloads done (`finished_sending`). The request's request_completion actions go to
        the daemon now, on its full blocks (`hashes`), or at that report."""
        self.lookup.forget(req_id)
        st = self._reqs.pop(req_id, None)
        acts = self._actions.pop(req_id, None)
        deferred = None
        if acts is not None and acts.at_completion:
            deferred = (acts, self._digests(hashes, len(hashes)))
        if st is not None and st.offloaded:
            self._awaiting_free.add(req_id)
            if deferred is not None:
                self._at_free[req_id] = deferred
            return True
        if deferred is not None:
            self._send_at_completion(*deferred)
        return False

    def _send_at_completion(self, acts: RequestActions, digests: List[bytes]) -> None:
        self.lookup.submit_act(digests, acts, COMPLETION, acts.completion_text())

    def load_failed(self, block_ids_by_req: Dict[str, Sequence[int]], invalid: Set[int]) -> None:
        """Workers reported `invalid` blocks (vLLM recomputes from the first one of each
        request): those blocks are not in kvnode, so offer them again once recomputed."""
        for req_id, ids in block_ids_by_req.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            bad = [i for i, b in enumerate(ids) if b in invalid]
            if bad:
                st.saved_blocks = min(st.saved_blocks, bad[0])
                st.hit_blocks = min(st.hit_blocks, bad[0])

    def finished_sending(self, req_ids) -> None:
        for r in req_ids or ():
            self._awaiting_free.discard(r)
            deferred = self._at_free.pop(r, None)
            if deferred is not None:
                self._send_at_completion(*deferred)

    @property
    def awaiting_free(self) -> Set[str]:
        return set(self._awaiting_free)
