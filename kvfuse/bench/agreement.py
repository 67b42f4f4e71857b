"""How close a fused answer is to vanilla's: answer KL (teacher-forced) and bootstrap intervals.

Answer KL: the mean over vanilla's whole greedy answer of KL(P_vanilla ‖ P_method) per token, the method's
distributions taken on its own fused cache with vanilla's answer fed in (teacher forcing, one forward
over the answer tokens). The first-token KL alone misses a wrong digit in the middle of a copied number;
this measure sees it at the step where the digit is decided (computed in kvfuse/fusion/teacher_forcing.py,
shared with the service's shadow checks). See docs/DESIGN.md, "Fidelity measures".

Intervals: percentile bootstrap over examples, seeded, so a report re-rendered from the same JSON shows
the same interval. Every quantity here is per example and already paired with vanilla (agreement is
"same answer as vanilla on this example", KL is against vanilla on this example).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvfuse.fusion.teacher_forcing import (  # noqa: F401 - the benchmarks' names for them
    answer_kl,
    prompt_cache_positions,
    teacher_forced_logits,
    token_kls,
)

CI_LEVEL = 0.95
CI_RESAMPLES = 2000
CI_SEED = 0


def bootstrap_ci(values: Sequence[float], *, level: float = CI_LEVEL, resamples: int = CI_RESAMPLES,
                 seed: int = CI_SEED) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of the mean of per-example values; None below two examples."""
    n = len(values)
    if n < 2:
        return None
    rng = random.Random(seed)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return means[int(tail * (resamples - 1))], means[int(round((1.0 - tail) * (resamples - 1)))]


def paired_ratio_ci(scores: Sequence[float], refs: Sequence[float], *, level: float = CI_LEVEL,
                    resamples: int = CI_RESAMPLES, seed: int = CI_SEED) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of mean(scores) / mean(refs) over paired examples (a resample draws
    examples, each with its method and vanilla score). None when there
    are fewer than two pairs or vanilla scores 0 in too many resamples to leave an interval."""
    n = len(scores)
    if n < 2 or n != len(refs):
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ref = sum(refs[i] for i in idx)
        if ref > 0:
            ratios.append(sum(scores[i] for i in idx) / ref)
    if len(ratios) < resamples * level:  # vanilla's score is mostly 0: no meaningful interval
        return None
    ratios.sort()
    tail = (1.0 - level) / 2
    lo = ratios[int(tail * (len(ratios) - 1))]
    hi = ratios[int(round((1.0 - tail) * (len(ratios) - 1)))]
    return lo, hi


def examples_for_width(n: int, interval: Sequence[float] | None, half_width: float) -> int | None:
    """Examples an interval of the same spread would need to reach ±half_width (width ∝ 1/√n)."""
    if not interval or n < 2:
        return None
    now = (interval[1] - interval[0]) / 2
    if now <= 0:
        return n
    return max(n, int(n * (now / half_width) ** 2 + 0.999))
