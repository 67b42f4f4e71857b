"""SamKV's ingest-time artifacts of one chunk, and the analysis pass that builds them.

What is kept (per chunk, all query-independent, computed from the chunk alone):
- `block_keys` [L, Hkv, B, D] fp32: the mean key of each 64-token block, taken BEFORE RoPE. Decision
  (the paper does not say): selection compares content, and a mean of keys rotated to 64 different
  positions blurs it; pre-RoPE means also stay valid wherever the block lands in the sparse cache.
- `local_q` [L, H, D] fp32: the mean pre-RoPE query of the local blocks' tokens (Eq. 1's Q_doc-j_loc).
  Decision: mean-pooled, as the paper pools the user query; keeping every local query (128 x H x D per
  layer) would cost about as much as the local blocks' KV.
- `max_block`, `min_block` [L] int64: per layer, the middle block of highest importance (smallest
  power-law exponent alpha of the attention its representative token receives) and of highest
  unimportance (lowest mean attention received), Appendix A.1; -1 when the chunk has no middle.
- `candidates` [m] int64: middle tokens whose alpha is a PauTa (3-sigma) outlier on the low side, i.e.
  that keep receiving attention, in any stable layer: recompute candidates (Sec. 3.3).
- `config` [4] int64: block tokens, initial blocks, local blocks, first stable layer: artifacts built
  with other settings are rebuilt, not misread.

Decisions on Appendix A.1, which gives the idea but not the procedure: attention is averaged over heads;
a block's representative token is the one with the highest mean attention received from the tokens after
it; alpha is the least-squares slope of log(attention) against log(distance) over every later token.

The analysis pass runs the chunk through the model layer by layer (the engine's own layer pieces) with
explicit attention probabilities, so it costs about one more prefill of the chunk at ingest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfuse.fusion.methods.sparse.blocks import Segments, stable_layers
from kvfuse.fusion.model.rope import apply_rope
from kvfuse.fusion.model.transformer import Transformer

PREFIX = "samkv."
_NAMES = ("block_keys", "local_q", "max_block", "min_block", "candidates", "config")
PAUTA_SIGMAS = 3.0


@dataclass
class Artifacts:
    block_keys: torch.Tensor
    local_q: torch.Tensor
    max_block: torch.Tensor
    min_block: torch.Tensor
    candidates: torch.Tensor
    config: torch.Tensor

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Blob artifacts (kvfuse.kvblob), named `samkv.*`."""
        return {PREFIX + n: getattr(self, n).contiguous() for n in _NAMES}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor] | None, expected_config: torch.Tensor) -> Artifacts | None:
        """The artifacts in a blob's tensors, or None when absent or built with other settings."""
        if not tensors or any(PREFIX + n not in tensors for n in _NAMES):
            return None
        arts = cls(**{n: tensors[PREFIX + n] for n in _NAMES})
        return arts if torch.equal(arts.config, expected_config) else None

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in _NAMES)


def config_tensor(seg_like: Segments, num_layers: int) -> torch.Tensor:
    return torch.tensor([seg_like.block_tokens, seg_like.initial_blocks, seg_like.local_blocks,
                         stable_layers(num_layers).start], dtype=torch.long)


def _alpha_and_mean(attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attn [n, n] (row: query, column: key, causal) -> per key token (alpha, mean attention received
    from the tokens after it). alpha: minus the least-squares slope of log a(x) on log x, x the distance;
    NaN with fewer than two later tokens."""
    n = attn.shape[0]
    zero = torch.zeros((), device=attn.device)
    i = torch.arange(n, dtype=torch.float32, device=attn.device)
    dist = i[:, None] - i[None, :]
    later = dist > 0
    x = torch.where(later, dist.clamp_min(1).log(), zero)
    y = torch.where(later, attn.clamp_min(1e-12).log(), zero)
    m = later.sum(dim=0).float()
    sx, sy = x.sum(dim=0), y.sum(dim=0)
    sxx, sxy = (x * x).sum(dim=0), (x * y).sum(dim=0)
    den = m * sxx - sx * sx
    slope = (m * sxy - sx * sy) / den.where(den > 0, torch.full((), float("nan"), device=attn.device))
    mean = torch.where(later, attn, zero).sum(dim=0) / m.clamp_min(1)
    return -slope, mean


def analyse_layer(attn: torch.Tensor, seg: Segments) -> tuple[int, int, list[int]]:
    """(max block, min block, outlier middle tokens) of one layer's head-averaged attention [n, n]."""
    middle = seg.middle
    if not middle:
        return -1, -1, []
    alpha, mean = _alpha_and_mean(attn)
    reps = [max(seg.tokens(b), key=lambda t: float(mean[t])) for b in middle]
    rep_alpha = torch.stack([alpha[t] for t in reps]).nan_to_num(float("inf"))
    rep_mean = torch.stack([mean[t] for t in reps])
    tokens = seg.token_list(middle)
    a = alpha[tokens]
    ok = ~a.isnan()
    outliers: list[int] = []
    if int(ok.sum()) >= 2:
        mu, sigma = a[ok].mean(), a[ok].std()
        low = ok & (a < mu - PAUTA_SIGMAS * sigma)
        outliers = [tokens[j] for j in low.nonzero().view(-1).tolist()]
    return middle[int(rep_alpha.argmin())], middle[int(rep_mean.argmin())], outliers


@torch.inference_mode()
def build(tf: Transformer, token_ids: list[int], seg: Segments | None = None) -> Artifacts:
    """The analysis pass over one chunk alone at positions 0..n-1 (see the module docstring)."""
    n = len(token_ids)
    seg = seg or Segments(n)
    device = tf.embed_tokens.weight.device
    positions = torch.arange(n, device=device)
    rows = tf.rows(positions)
    h = tf.embed(torch.tensor(token_ids, dtype=torch.long, device=device))
    local_tokens = seg.token_list(seg.local) or list(range(n))
    stable = set(stable_layers(tf.num_layers))
    causal = positions[None, :] > positions[:, None]
    block_keys, local_q, max_b, min_b, cands = [], [], [], [], set()
    group = tf.num_heads // tf.num_kv_heads
    for layer in range(tf.num_layers):
        cos, sin = rows.cos_sin(layer)
        q0, k0, v = tf.project(layer, h, torch.ones_like(cos), torch.zeros_like(sin))  # pre-RoPE q and k
        block_keys.append(torch.stack([k0[0, :, list(seg.tokens(b))].float().mean(dim=1)
                                       for b in range(seg.num_blocks)], dim=1))
        local_q.append(q0[0, :, local_tokens].float().mean(dim=1))
        q, k = apply_rope(q0, cos, sin), apply_rope(k0, cos, sin)
        kk = k[0].float().repeat_interleave(group, dim=0)  # [H, n, D]
        scores = torch.matmul(q[0].float(), kk.transpose(1, 2)).mul_(tf.scale).masked_fill_(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [H, n, n]
        vv = v[0].float().repeat_interleave(group, dim=0)
        out = torch.matmul(probs, vv).unsqueeze(0).to(h.dtype)
        hi, lo, outl = analyse_layer(probs.mean(dim=0), seg)
        max_b.append(hi)
        min_b.append(lo)
        if layer in stable:
            cands.update(outl)
        h = tf.finish(layer, h, out)
    return Artifacts(
        block_keys=torch.stack(block_keys).cpu(), local_q=torch.stack(local_q).cpu(),
        max_block=torch.tensor(max_b, dtype=torch.long), min_block=torch.tensor(min_b, dtype=torch.long),
        candidates=torch.tensor(sorted(cands), dtype=torch.long),
        config=config_tensor(seg, tf.num_layers),
    )
