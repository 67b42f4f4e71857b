"""Log-probabilities of the chosen token and of the most likely ones, from one row of next-token logits:
what OpenAI's `logprobs` / `top_logprobs` return.

They are the model's own distribution (log-softmax of the raw logits in float32), before temperature and
top-p shape the sampling, as vLLM reports them by default; so they do not depend on the sampling knobs.
One function, apart from the decoding loop, so any decode step that has a logits row can call it.
"""

from __future__ import annotations

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit

# (token id, its log-probability, [(token id, log-probability)] of the `top` most likely, best first)
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of `token` under `logits` [vocab], and the `top` most likely tokens' (0: none)."""
    logp = torch.log_softmax(logits.detach().float().reshape(-1), dim=-1)
    best: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        best = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
    return int(token), float(logp[token]), best
