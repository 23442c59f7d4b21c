"""One request's load on the consumer side, as the pull's parts see it."""

from __future__ import annotations

from dataclasses import dataclass

from kvconnectors.tiered.metadata import RecvSpec
from kvconnectors.tiered.params import TransferParams


@dataclass(frozen=True)
class Load:
    spec: RecvSpec        # what the scheduler asked for (request, blocks, retries)
    p: TransferParams     # the producer's ticket, validated
    targets: list[int]    # the local blocks the transfer's blocks go to, in order
    fault: str | None     # test hooks: the corruption asked for this transfer (tamper.kind_of)

    @property
    def n(self) -> int:
        return len(self.targets)
