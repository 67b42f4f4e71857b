"""Teacher forcing: a cache's next-token distributions along a given answer, and the KL between two
such distributions. One home for the answer KL that `kvfuse bench fidelity` reports
(kvfuse/bench/agreement.py) and that the service's shadow checks measure live
(kvfuse/service/worker/shadow.py, which forces the answer on the engine core instead: the same
distributions, from decode steps). See docs/DESIGN.md, "Fidelity measures".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
    """The cache's next-token logits at every position of `answer_tokens` ([m, vocab], fp32): the first
    row is the prefill's own, the rest from one forward of answer_tokens[:-1] appended after the prompt
    in `fused.cache` (rows written past the prompt; whatever a decode left there is overwritten, and
    nothing past a row's own position is read)."""
    import torch

    first = fused.logits.detach().float().reshape(1, -1)
    feed = list(answer_tokens[:-1])
    if not feed:
        return first[: len(answer_tokens)]
    tf, cache = engine.tf, fused.cache
    start = prompt_cache_positions(fused.stats)
    if cache.position_offset:
        # A cache whose slots are not positions (samkv's sparse cache, eviction): the answer goes in by
        # decode steps from the end of the prompt's slots, each at its true position, forced on an
        # engine core of its own (engine/solo.py), the decode every request runs.
        from kvfuse.fusion.engine import solo

        cache.length = start - cache.position_offset
        if cache.length + len(feed) > cache.capacity:
            raise ValueError(f"the fused cache holds {cache.capacity} rows; the answer needs {cache.length + len(feed)}")
        return solo.forced_logits(engine, fused, feed)
    if start + len(feed) > cache.capacity:
        raise ValueError(f"the fused cache holds {cache.capacity} rows; the answer needs {start + len(feed)}")
    with torch.inference_mode():
        rows = engine.rows(torch.arange(start, start + len(feed), device=engine.device))
        h = tf.embed(torch.tensor(feed, dtype=torch.long, device=engine.device))
        for layer in range(tf.num_layers):
            h = tf.layer(cache, layer, h, rows)
        rest = tf.logits(h[0]).float()
    return torch.cat([first, rest])
