"""What the scheduler side tells the worker side each step (plain, picklable; no vllm import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class BlockMove:
    """Blocks of one request to move: digest i <-> GPU block id i."""

    req_id: str
    digests: List[bytes]
    block_ids: List[int]

    def __post_init__(self) -> None:
        if len(self.digests) != len(self.block_ids):
            raise ValueError(f"request {self.req_id}: {len(self.digests)} digests but "
                             f"{len(self.block_ids)} block ids")


@dataclass
class StepPlan:
    """One scheduler step: onloads to finish before the forward, offloads after it, and the
    requests preempted this step (their pending offloads must end before blocks are reused)."""

    loads: List[BlockMove] = field(default_factory=list)
    saves: List[BlockMove] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted)
