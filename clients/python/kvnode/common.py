"""What the three engine integrations share, written once: the daemon's socket, the namespace
spec they register, a router hint on a request, and the hinted lookup.

SGLang's backend (`kvnode.sglang.backend`), the vLLM connector (`kvnode.vllm`) and the vLLM tier
(`kvnode.vllm_tier`) build on these. The per-key outcome sets (put, commit, pull) live beside the
failure codes in `kvnode.outcomes`.

The hinted lookup (docs/peer-protocol.md, "hints"; with a recompute cost, kvnode.plan):

    Exists(keys, hint)  --pull "Pulling"-->  Wait(op, budget)  -->  Exists(keys)  (the recount)
          |                                    budget = base_s + per_page_s * pages (the
          +--no pull / refused / ended-->      daemon's `Timeouts`), capped by the engine's
             the first answer stands           own limit, at least 1 ms

With a `recompute` field among the hint fields (`kvnode.plan.RecomputeCost.wire`) the first
answer carries a fetch plan; the daemon starts the pull only when the plan takes the peer, and
the count is cut at the plan (`min(count or recount, plan.keys)`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from kvnode.plan import Plan
from kvnode.wire import Connection, exists

#: The daemon's limit on segments per namespace (kvnode_proto::namespace::MAX_SEGMENTS).
MAX_SEGMENTS = 1024


def default_socket() -> str:
    """The daemon's socket when the engine's config names none: $KVNODE_SOCKET, else
    $XDG_RUNTIME_DIR/kvnode/kvnode.sock, else /run/kvnode/kvnode.sock (`kvnode serve`'s own
    default, engine/daemon/src/cli.rs)."""
    env = os.environ.get("KVNODE_SOCKET")
    if env:
        return env
    run = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(run, "kvnode", "kvnode.sock") if run else "/run/kvnode/kvnode.sock"


@dataclass(frozen=True)
class NamespaceSpec:
    """kvnode_proto::namespace::NamespaceSpec (engine/proto/src/namespace.rs), field for field.

    Every field takes part in the namespace id the daemon derives, except that `mla = True`
    drops the TP coordinates. Defaults are the Rust `Default` (a size of 0 reads as 1 there).
    The daemon ignores a map key it does not know, so a spec goes out only through `to_wire`,
    whose keys are these fields (tests/test_namespace_spec.py pins them to the Rust struct).
    """

    model: str = ""
    dtype: str = ""
    page_size: int = 0
    layout: str = ""
    kv_shape: Tuple[int, ...] = ()
    tp_rank: int = 0
    tp_size: int = 0
    pp_rank: int = 0
    pp_size: int = 0
    cp_rank: int = 0
    cp_size: int = 0
    head_range: Optional[Tuple[int, int]] = None
    layer_range: Optional[Tuple[int, int]] = None
    mla: bool = False
    tenant_salt: str = ""
    segments: Tuple[int, ...] = ()

    def to_wire(self) -> Dict[str, Any]:
        """The msgpack-ready map `Register` takes: plain ints, strings, lists and None."""

        def span(r: Optional[Tuple[int, int]]) -> Optional[List[int]]:
            return None if r is None else [int(r[0]), int(r[1])]

        return {
            "model": str(self.model),
            "dtype": str(self.dtype),
            "page_size": int(self.page_size),
            "layout": str(self.layout),
            "kv_shape": [int(v) for v in self.kv_shape],
            "tp_rank": int(self.tp_rank),
            "tp_size": int(self.tp_size),
            "pp_rank": int(self.pp_rank),
            "pp_size": int(self.pp_size),
            "cp_rank": int(self.cp_rank),
            "cp_size": int(self.cp_size),
            "head_range": span(self.head_range),
            "layer_range": span(self.layer_range),
            "mla": bool(self.mla),
            "tenant_salt": str(self.tenant_salt),
            "segments": [int(s) for s in self.segments],
        }


def hint_field(hint: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The `hint` field a router hint adds to Exists / Get / GetToRegion: a normalized hint
    (`kvnode.hints.extract_router_hint`) in the compact form, as JSON text (the daemon takes it
    as untrusted text and validates it again). No hint: no field."""
    if not hint:
        return {}
    compact = {"source_control_endpoint": hint["source"], "block_hashes": list(hint["block_hashes"])}
    return {"hint": json.dumps(compact)}


def pull_budget_ms(timeouts: Optional[Mapping[str, Any]], pages: int,
                   cap_s: Optional[float] = None) -> int:
    """How long to `Wait` for a hinted pull of `pages` pages: the daemon's declared model
    (its `Timeouts` answer, `base_s + per_page_s * pages`; 1 s when it declared none), at most
    `cap_s`, at least 1 ms."""
    t = timeouts or {}
    seconds = float(t.get("base_s", 1.0)) + float(t.get("per_page_s", 0.0)) * pages
    if cap_s is not None:
        seconds = min(seconds, cap_s)
    return max(1, int(1000 * seconds))


@dataclass(frozen=True)
class HintedExists:
    """The answer of a hinted lookup.

    count    leading keys present: after the wait when the pull was running and a recount was
             asked, else as the hinted `Exists` answered
    started  the pull's OpReport as the hinted `Exists` returned it; None when the hint started
             no pull (a daemon without the peer path)
    report   the OpReport after the `Wait` when the pull was running, else `started`
    waited   whether the pull was running, so the lookup waited for it
    plan     the fetch plan of the first answer (a `recompute` field was sent), else None;
             `count` is then already cut at `plan.keys`
    """

    count: int
    started: Optional[Dict[str, Any]]
    report: Optional[Dict[str, Any]]
    waited: bool = False
    plan: Optional[Plan] = None

    @property
    def reason(self) -> Any:
        """The op's failure (a `{"code", "message"}` map, `kvnode.outcomes.failure_of`) or None."""
        return (self.report or {}).get("reason") or (self.started or {}).get("reason")

    @property
    def outcomes(self) -> List[Any]:
        """One KeyOutcome per key of the hint's pull (empty without a report)."""
        return list((self.report or {}).get("results") or [])


#: An `Exists` call: (keys, extra request fields) -> the reply body (`count`, `pull`).
Ask = Callable[[List[list], Optional[dict]], Dict[str, Any]]


def hinted_exists(conn: Connection, ns: int, keys: Sequence[list], fields: Mapping[str, Any],
                  budget_ms: int, recount: bool = True, ask: Optional[Ask] = None) -> HintedExists:
    """Exists with the hint `fields` (`hint_field`), then, while its pull runs, Wait up to
    `budget_ms` (`pull_budget_ms`), then (with `recount`) Exists again without the hint.

    `ask`, when given, makes both `Exists` calls (a caller that times them); `Wait` goes to `conn`.
    """
    keys = list(keys)

    def ask_daemon(extra: Optional[dict]) -> Dict[str, Any]:
        return ask(keys, extra) if ask is not None else exists(conn, ns, keys, extra)

    body = ask_daemon(dict(fields))
    plan = Plan.of(body)

    def cut(n: int) -> int:
        return n if plan is None else min(n, plan.keys)

    started = body.get("pull")
    if not started or started.get("state") != "Pulling":
        return HintedExists(cut(int(body["count"])), started, started, plan=plan)
    report = conn.wait(started["op"], budget_ms)
    count = int(ask_daemon(None)["count"]) if recount else int(body["count"])
    return HintedExists(cut(count), started, report, waited=True, plan=plan)
