"""batch_exists_v2's verdict from per-page presence, by SGLang 0.5.23's per-pool hit policies."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"


def policy_name(policy) -> str:
    """SGLang's PoolHitPolicy (a str enum) or its value, as the plain value."""
    return str(getattr(policy, "value", policy))


def restorable_prefixes(present: Sequence[bool], kv_pages: int, policy, window: int) -> List[int]:
    """Prefix lengths (in pages, 1..kv_pages) at which a pool can be restored.

    ALL_PAGES: every page of the prefix must be present (DSA indexer, draft KV).
    TRAILING_PAGES: only the `window` pages ending at the prefix must be (Mamba, SWA), so the
    result may have holes; the caller intersects these sets across pools and ranks.
    """
    name = policy_name(policy)
    if name == ALL_PAGES:
        n = 0
        while n < kv_pages and present[n]:
            n += 1
        return list(range(1, n + 1))
    if name == TRAILING_PAGES:
        w = max(1, window)
        return [p for p in range(1, kv_pages + 1) if all(present[max(0, p - w):p])]
    raise ValueError(f"kvnode does not implement the HiCache hit policy {name!r} "
                     f"(supported: {ALL_PAGES}, {TRAILING_PAGES})")


def combine(kv_pages: int, pools: Sequence[Tuple[object, object, int, Sequence[bool]]],
            kv_name: object = "kv") -> Tuple[int, Dict[object, int], List[int]]:
    """(usable pages, per-pool boundary, restorable prefix lengths).

    `pools` holds (name, policy, window, presence of the first kv_pages pages) per extra pool.
    A pool's boundary is its longest restorable prefix; the usable length is the longest
    prefix every pool can restore. Names are used as given (SGLang's PoolName members hash
    by member name, so they must not be swapped for their string values).
    """
    hits: Dict[object, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for name, policy, window, present in pools:
        if not restorable:
            break
        ok = restorable_prefixes(present, kv_pages, policy, window)
        if ok:
            hits[name] = ok[-1]
        keep = set(ok)
        restorable = [p for p in restorable if p in keep]
    return (restorable[-1] if restorable else 0), hits, restorable
