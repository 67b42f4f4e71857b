"""How close a fused answer is to vanilla's: answer KL (teacher-forced) and bootstrap intervals.

Answer KL: the mean over vanilla's whole greedy answer of KL(P_vanilla ‖ P_method) per token, the method's
distributions taken on its own fused cache with vanilla's answer fed in (teacher forcing, one forward
over the answer tokens). The first-token KL alone misses a wrong digit in the middle of a copied number;
this measure sees it at the step where the digit is decided. See docs/DESIGN.md, "Fidelity measures".

Intervals: percentile bootstrap over examples, seeded, so a report re-rendered from the same JSON shows
the same interval. Every quantity here is per example and already paired with vanilla (agreement is
"same answer as vanilla on this example", KL is against vanilla on this example).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

CI_LEVEL = 0.95
CI_RESAMPLES = 2000
CI_SEED = 0


def token_kls(ref_logprobs: Any, logits: Any) -> list[float]:
    """KL(P_ref ‖ P) per answer position, in nats. ref_logprobs, logits: [m, vocab] (any float dtype; the
    reference is renormalised, so a rounded copy on disk still is a distribution)."""
    import torch

    p_log = torch.log_softmax(ref_logprobs.double(), dim=-1)
    q_log = torch.log_softmax(logits.double(), dim=-1)
    if p_log.shape != q_log.shape:
        raise ValueError(f"reference {tuple(p_log.shape)} and method {tuple(q_log.shape)} distributions differ")
    kl = (p_log.exp() * (p_log - q_log)).sum(dim=-1).clamp_min(0.0)
    return [float(x) for x in kl]


def answer_kl(ref_logprobs: Any, logits: Any) -> float:
    """Mean per-token KL(P_ref ‖ P) over the answer (0 for an empty answer)."""
    kls = token_kls(ref_logprobs, logits)
    return sum(kls) / len(kls) if kls else 0.0


def prompt_cache_positions(stats: dict) -> int:
    """The prompt's positions in a prefill's fused cache, from its stats: the whole prompt, or fewer where
    the method compacts it and says so (samkv's sparse cache, `fused_cache_tokens`)."""
    return int(stats.get("fused_cache_tokens",
                         stats["prefix_tokens"] + stats["context_tokens"] + stats["question_tokens"]))


def teacher_forced_logits(engine: Any, fused: Any, answer_tokens: Sequence[int]) -> Any:
    """The method's next-token logits at every position of `answer_tokens` ([m, vocab], fp32): the first
    row is the fused prefill's own, the rest from one forward of answer_tokens[:-1] appended after the
    prompt in `fused.cache` (rows written past the prompt; whatever a decode left there is overwritten,
    and nothing past a row's own position is read)."""
    import torch

    first = fused.logits.detach().float().reshape(1, -1)
    feed = list(answer_tokens[:-1])
    if not feed:
        return first[: len(answer_tokens)]
    tf, cache = engine.tf, fused.cache
    start = prompt_cache_positions(fused.stats)
    if cache.position_offset:
        # A cache whose slots are not positions (samkv's sparse cache, eviction): the answer goes in by
        # decode steps from the end of the prompt's slots, each at its true position.
        cache.length = start - cache.position_offset
        if cache.length + len(feed) > cache.capacity:
            raise ValueError(f"the fused cache holds {cache.capacity} rows; the answer needs {cache.length + len(feed)}")
        rest = torch.stack([engine.decode_step(cache, t).float() for t in feed])
        return torch.cat([first, rest])
    if start + len(feed) > cache.capacity:
        raise ValueError(f"the fused cache holds {cache.capacity} rows; the answer needs {start + len(feed)}")
    with torch.inference_mode():
        rows = engine.rows(torch.arange(start, start + len(feed), device=engine.device))
        h = tf.embed(torch.tensor(feed, dtype=torch.long, device=engine.device))
        for layer in range(tf.num_layers):
            h = tf.layer(cache, layer, h, rows)
        rest = tf.logits(h[0]).float()
    return torch.cat([first, rest])


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
