"""Per-call storage metrics, handed to SGLang as its own StorageMetrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List


@dataclass
class Metrics:
    """The four series SGLang's metrics collector reads (StorageMetrics' fields).

    Bandwidths are GiB/s of hit pages per call, measured around the call.
    """

    prefetch_pgs: List[int] = field(default_factory=list)
    backup_pgs: List[int] = field(default_factory=list)
    prefetch_bandwidth: List[float] = field(default_factory=list)
    backup_bandwidth: List[float] = field(default_factory=list)

    def record(self, prefetch: bool, hits: int, page_bytes: int, seconds: float) -> None:
        pgs, bw = ((self.prefetch_pgs, self.prefetch_bandwidth) if prefetch
                   else (self.backup_pgs, self.backup_bandwidth))
        pgs.append(hits)
        bw.append(hits * page_bytes / max(seconds, 1e-9) / (1 << 30))

    def to_sglang(self) -> Any:
        """SGLang's StorageMetrics with these series (this object where SGLang is absent)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return self
        m = StorageMetrics()
        for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
            setattr(m, name, list(getattr(self, name)))
        return m
