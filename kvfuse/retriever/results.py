"""What every retrieval index answers: chunk hits, and how it differs from the store (drift)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hit:
    document_id: str
    chunk_index: int
    score: float


@dataclass
class DriftReport:
    """Index vs. store: what a startup check found."""

    missing: list[str] = field(default_factory=list)  # in the store, not in the index
    extra: list[str] = field(default_factory=list)  # in the index, not in the store
    mismatched: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (store chunks, indexed)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.mismatched)

    def summary(self) -> str:
        if self.ok:
            return "index matches the store"
        return (
            f"index drift: {len(self.missing)} documents missing, {len(self.extra)} extra, "
            f"{len(self.mismatched)} with another chunk count"
        )


def drift(kind: str, have: dict[str, int], expected: dict[str, int]) -> DriftReport:
    """Compare an index's {document_id: chunks} with the store's; logged when they differ."""
    report = DriftReport(
        missing=sorted(set(expected) - set(have)),
        extra=sorted(set(have) - set(expected)),
        mismatched={d: (n, have[d]) for d, n in sorted(expected.items()) if d in have and have[d] != n},
    )
    if not report.ok:
        log.warning("%s %s", kind, report.summary())
    return report
