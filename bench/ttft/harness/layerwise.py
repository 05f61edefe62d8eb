"""Layer-wise onload from the daemon's DRAM tier, overlapped with the prefill.

`start(tier, digests, alloc)`: Exists for the leading run, pool pages for it, and ONE
`OnloadAsync` with `layers` = the model's layers: the daemon copies layer 0 of every page,
then layer 1, ... The prefill calls `wait(l)` before layer l reads the cached prefix
(`OnloadLayerWait`: returns once layer l landed), so layer 0 computes while later layers are
still on the way. `finish()` (after the prefill) collects the per-page statuses: pages not
`Loaded` (evicted between Exists and the onload) hold no valid KV and the caller recomputes
from the first of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Sequence

from kvnode.gpu import leading


@dataclass
class LayeredLoad:
    tier: object
    ticket: int = 0
    pages: List[int] = field(default_factory=list)
    lookup_s: float = 0.0
    start_s: float = 0.0          # Exists + OnloadAsync (before the prefill starts)
    wait_s: float = 0.0           # time the prefill was held in layer waits
    onload_s: float = 0.0         # OnloadAsync sent -> OnloadWait answered
    landed_s: float = 0.0         # OnloadAsync sent -> the last layer's wait answered (the copies)
    incomplete_layers: int = 0
    _t0: float = 0.0
    _done: bool = False

    def wait(self, layer: int) -> None:
        t = time.perf_counter()
        ok = self.tier._call(self.tier.mover.onload_layer_wait, self.ticket, layer)
        now = time.perf_counter()
        self.wait_s += now - t
        self.landed_s = now - self._t0  # the prefill waits for the layers in order: the last wins
        if not ok:
            self.incomplete_layers += 1

    def finish(self) -> int:
        """Waits for the onload; returns how many leading pages are whole."""
        if self._done or not self.pages:
            return len(self.pages)
        res = self.tier._call(self.tier.mover.onload_wait, self.ticket)
        self.onload_s = time.perf_counter() - self._t0
        self._done = True
        return leading(res)


def start(tier, digests: Sequence[bytes], alloc: Callable[[int], List[int]]) -> LayeredLoad:
    """Starts the layer-wise onload of the leading run of `digests` the daemon holds."""
    ld = LayeredLoad(tier)
    keys = tier.keys(digests)
    t = time.perf_counter()
    n = tier._call(tier.conn.exists, tier.ns, keys)
    ld.lookup_s = time.perf_counter() - t
    if n == 0:
        ld.start_s = ld.lookup_s
        return ld
    ld.pages = alloc(n)
    ld._t0 = time.perf_counter()
    ld.ticket = tier._call(tier.mover.onload_async, tier.ns, keys[:n], ld.pages, tier.spec.layers)
    ld.start_s = time.perf_counter() - t
    return ld
