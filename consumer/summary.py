"""What a consumer's run did: counts of messages, outcomes and rejection reasons, kept as
its batches commit (and logged: each rejection at debug, each reason once a batch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvledger.consumer.core.model import Plan

# The consumer service's logger: these lines were always its own (operators filter on it).
logger = logging.getLogger("kvledger.consumer.service")


@dataclass
class RunSummary:
    batches: int = 0
    messages: int = 0
    applied: int = 0
    rejected: int = 0
    duplicates: int = 0
    block_events: int = 0
    fenced: int = 0
    retries: int = 0
    restarts: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, plan: Plan) -> None:
        """Count a committed batch's plan."""
        self.batches += 1
        self.messages += plan.messages
        self.applied += plan.applied
        self.duplicates += plan.duplicates
        self.block_events += plan.block_events
        self.rejected += len(plan.rejected)
        by_reason: dict[str, int] = {}
        for r in plan.rejected:
            by_reason[r.reason] = by_reason.get(r.reason, 0) + 1
            logger.debug(
                "rejected %s[%d]@%d: %s (%s)",
                r.message.topic,
                r.message.partition,
                r.message.offset,
                r.reason,
                r.detail,
            )
        for reason, count in by_reason.items():
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + count
            example = next(r for r in plan.rejected if r.reason == reason)
            logger.info(
                "rejected %d message(s) as %s, e.g. %s[%d]@%d: %s",
                count,
                reason,
                example.message.topic,
                example.message.partition,
                example.message.offset,
                example.detail,
            )
