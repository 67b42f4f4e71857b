"""Holding a target agreement: the recompute ratio per method and prompt-size bucket, moved by the shadow
checks' verdicts. Pure policy (no I/O, no clock), so its rules are unit-tested; the ledger
(rag/fidelity.py) feeds it and keeps its state on disk; `kvfuse calibrate` writes the same state.

The rules (docs/DESIGN.md, "The quality contract"), with T = `fidelity.target_agreement` and the 95 %
Wilson interval [lo, hi] of the agreements seen at the ratio in use:

- the ratio rises one step when the interval lies wholly below T (hi < T: the ratio fails, with 95 %
  confidence), or when `judge_checks` checks have been seen and lo < T (it could not show it meets T);
- it falls one step only after `fall_checks` checks at it with lo >= T (it clears T with room to
  try less); the counts restart at every move, so a ratio that fails sends it back up and the next try
  lower waits another `fall_checks` checks (hysteresis);
- ratios live on a ladder min_ratio, min_ratio + step, ..., max_ratio; a check made at another ratio
  (a request that named its own) is not counted toward the hold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95 % interval


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of k successes in n trials (None for n = 0). It stays inside [0, 1] and
    is honest at 0 or n successes, where the normal approximation collapses to a point."""
    if n <= 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact at the edges, where rounding leaves 1 - 1e-16
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def size_bucket(context_tokens: int, edges: list[int]) -> str:
    """The prompt-size bucket of a prompt with `context_tokens` document tokens: "0-1024", "1024-4096",
    "4096+" for edges [1024, 4096]."""
    lo = 0
    for edge in edges:
        if context_tokens < edge:
            return f"{lo}-{edge}"
        lo = edge
    return f"{lo}+"


def ladder(min_ratio: float, max_ratio: float, step: float) -> list[float]:
    """The ratios the controller uses, ascending: min_ratio + k x step below max_ratio, then max_ratio."""
    out, k = [], 0
    while min_ratio + k * step < max_ratio - 1e-9:
        out.append(round(min_ratio + k * step, 6))
        k += 1
    out.append(round(max_ratio, 6))
    return out


@dataclass
class Hold:
    """One method and bucket: the ratio in use and the checks counted at it since it was taken."""

    ratio: float
    checks: int = 0
    agreements: int = 0


@dataclass(frozen=True)
class Policy:
    target: float  # 0 = off
    min_ratio: float
    max_ratio: float
    step: float
    judge_checks: int
    fall_checks: int

    @classmethod
    def from_settings(cls, fidelity: Any) -> Policy:
        """From config.FidelitySettings."""
        return cls(fidelity.target_agreement, fidelity.min_ratio, fidelity.max_ratio, fidelity.ratio_step,
                   fidelity.judge_checks, fidelity.fall_checks)


class RatioController:
    def __init__(self, policy: Policy, start_ratio: float) -> None:
        self.policy = policy
        self.levels = ladder(policy.min_ratio, policy.max_ratio, policy.step)
        self.start = self.snap(start_ratio)
        self.holds: dict[tuple[str, str], Hold] = {}

    def snap(self, ratio: float) -> float:
        """The lowest ladder ratio at or above `ratio` (the top one above them all)."""
        return next((r for r in self.levels if r >= ratio - 1e-9), self.levels[-1])

    def ratio(self, method: str, bucket: str) -> float:
        hold = self.holds.get((method, bucket))
        return hold.ratio if hold is not None else self.start

    def hold(self, method: str, bucket: str) -> Hold:
        return self.holds.setdefault((method, bucket), Hold(self.start))

    def observe(self, method: str, bucket: str, ratio: float, agreed: bool | None) -> str | None:
        """Count one check's verdict; "raise" or "fall" when the ratio moved, else None."""
        pol = self.policy
        if pol.target <= 0 or agreed is None:
            return None
        hold = self.hold(method, bucket)
        if abs(ratio - hold.ratio) > 1e-6:
            return None  # made at another ratio (a request's own): says nothing of the one held
        hold.checks += 1
        hold.agreements += bool(agreed)
        lo, hi = wilson(hold.agreements, hold.checks)
        i = self.levels.index(self.snap(hold.ratio))
        if (hi < pol.target or (hold.checks >= pol.judge_checks and lo < pol.target)) and i + 1 < len(self.levels):
            self.holds[(method, bucket)] = Hold(self.levels[i + 1])
            return "raise"
        if lo >= pol.target and hold.checks >= pol.fall_checks and i > 0:
            self.holds[(method, bucket)] = Hold(self.levels[i - 1])
            return "fall"
        return None

    # -- state ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"holds": [{"method": m, "bucket": b, **asdict(h)} for (m, b), h in sorted(self.holds.items())]}

    def load(self, state: dict[str, Any]) -> None:
        """Take the holds of a saved state (ratios snapped to this ladder)."""
        for h in state.get("holds", []):
            ratio = self.snap(float(h["ratio"]))
            same = abs(ratio - float(h["ratio"])) <= 1e-6
            self.holds[(h["method"], h["bucket"])] = Hold(ratio, int(h["checks"]) if same else 0,
                                                          int(h["agreements"]) if same else 0)
