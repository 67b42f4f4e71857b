"""anchor: kvfuse's own fusion method (the default). Chunk-start anchors plus deep-layer question attention.

What it selects, within round(r * N) context tokens (anchors count toward the budget):
1. Anchors: the first `anchor_tokens` tokens of every chunk (config `fusion.anchor_tokens`). A chunk
   cached alone computed them as the start of a sequence, so they carry attention-sink states; after
   fusion every chunk contributes such a sink and together they drain attention from the real
   content. Recomputing them at their true positions removes the extra sinks. This is most of what
   separates A³ from CacheBlend and EPIC on the needle task (docs/methods/anchor.md). A chunk cached
   after a context (store.precompute_context) has no such sink, and gets no anchors: its share goes to
   evidence (docs/results/fidelity-context/: with a context, forcing them made answers further from
   vanilla's).
2. Evidence: the rest of the budget goes to the tokens the question reads. The question-only probe
   (`SelectionContext.question_probe`, ProphetKV's stage I) runs through the layers over the
   position-recovered cache, and each context token is scored by the question's attention onto it in
   a window of middle-to-deep layers, where question-to-evidence attention lives (early layers, A³'s
   check layer among them, mostly attend to punctuation and function words). Per layer and head the
   attention is renormalised over the non-anchor context, so every head votes with the same weight
   whatever mass it leaves on the sinks, the prefix or the question; the votes are averaged over
   question rows, heads and window layers. A width-`neighbours` max-pool then spreads each peak to its
   neighbours, so a found fact is recomputed whole (its value digits, not just its key word).
3. Stage II (the engine): the selected tokens plus every question token are recomputed through all
   layers in one pass, attending over the whole fused cache.

Scaling down the question's attention onto the keys left as cached (APE's factor S) was studied and
dropped: it breaks copying from cached text (docs/methods/anchor.md).

Cost: no layer runs in full. The probe is |Q| rows through the first `window_end` layers, attention
over T keys each (|Q| is tens of tokens), against CacheBlend's and A³'s full layer 0 over all N + |Q|
rows. Stage II is the same selective pass every method pays.

Departures from the papers it combines: ProphetKV averages the probe over all layers and heads with no
anchors and no head normalisation; A³ scores at one early layer after a full layer 0; EPIC recomputes
fixed edges only. The probe's question K/V are discarded (the recompute overwrites them), as ProphetKV's.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvfuse.fusion.methods.base import FusionMethod, register
from kvfuse.fusion.methods.selection import SelectionContext


def layer_window(num_layers: int, start_frac: float, end_frac: float) -> range:
    """Layers [floor(start_frac * L), ceil(end_frac * L)) clipped to the model; never empty."""
    lo = min(num_layers - 1, max(0, math.floor(start_frac * num_layers)))
    hi = max(lo + 1, min(num_layers, math.ceil(end_frac * num_layers)))
    return range(lo, hi)


def evidence_scores(head_attn: torch.Tensor, exclude: torch.Tensor) -> torch.Tensor:
    """[Lw, H, N] -> [N]: each (layer, head) renormalised over the context minus `exclude` (bool [N]),
    then averaged. Excluded tokens score 0."""
    keep = (~exclude).to(head_attn.dtype)
    a = head_attn * keep
    a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return a.mean(dim=(0, 1))


def spread(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Width-`width` max-pool (stride 1, same length): a token scores at least as its best neighbour."""
    if width <= 1:
        return scores
    pad = width // 2
    out = F.max_pool1d(scores.view(1, 1, -1), kernel_size=2 * pad + 1, stride=1, padding=pad)
    return out.view(-1)


@register
class Anchor(FusionMethod):
    name = "anchor"
    # Study: docs/methods/anchor.md (chosen on the default model; the window is a share of depth so it
    # scales to other depths, but the right window is a property of the model: measure it per model).
    window: ClassVar[tuple[float, float]] = (0.24, 0.83)  # probe layers as shares of depth
    neighbours: ClassVar[int] = 3  # max-pool width spreading each evidence peak to its neighbours

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        n, budget = ctx.num_context, ctx.budget
        device = ctx.ids.device
        chosen = torch.zeros(n, dtype=torch.bool, device=device)
        anchors = ctx.sink_starts(ctx.options.anchor_tokens)[:budget]
        chosen[anchors] = True
        rest = budget - int(anchors.numel())
        if rest <= 0:
            ctx.signals["evidence_coverage"] = 0.0  # the budget went to anchors: no evidence recomputed
            return anchors
        layers = layer_window(ctx.tf.num_layers, *self.window)
        votes = evidence_scores(ctx.question_probe(layers), chosen)
        scores = spread(votes, self.neighbours).masked_fill(chosen, float("-inf"))
        chosen[torch.topk(scores, rest, sorted=False).indices] = True
        # The votes sum to 1 over the non-anchor context: the share landing on recomputed tokens.
        ctx.signals["evidence_coverage"] = float(votes[chosen].sum())
        return chosen.nonzero().view(-1)
