"""SamKV's block selection (paper Sec. 3.1-3.2), pure tensor code on the stable layers N*.

Inputs per document: its `Segments`, and on the layers of N* its block-mean keys [S, Hkv, B, D], mean
local query [S, H, D] and static max/min blocks [S]; the user query's mean query [S, H, D] from the probe.
Every vector is pre-RoPE (kvfuse.fusion.methods.sparse.artifacts).

Decisions where the paper is silent (docs/methods/samkv.md):
- heads: a query-key score is the inner product of the concatenated heads (query head h reads KV head
  h // group, as attention does); cos in Eq. 1 is over the concatenated heads of a layer.
- s_anc: the mean of the anchor blocks' scores (= the score of their mean key).
- Eq. 2 is applied as written, including P = 0 when s_anc <= s_min.
- Top-P: ceil(P * middle blocks) of the document's middle blocks, by score.
- normalisation across documents: per layer, each document's block scores are min-max scaled over its own
  blocks (its personalised query sets its own scale), then averaged over N*.
- the cross-document cut: "the total block count divided by the number of contexts" is read as the
  middle blocks of all documents / D: at most that many middle blocks survive, the best normalised
  scores first, from the union of the per-document Top-P picks.
- one selection for every layer (the paper selects per layer; see the method's docstring for why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfuse.fusion.methods.sparse.blocks import Segments


@dataclass
class DocInputs:
    seg: Segments
    block_keys: torch.Tensor  # [S, Hkv, B, D]
    local_q: torch.Tensor  # [S, H, D]
    max_block: torch.Tensor  # [S] long, -1: no middle
    min_block: torch.Tensor  # [S] long


@dataclass
class Selection:
    blocks: list[list[int]]  # per document: kept blocks, sorted (anchor + selected middle)
    top_p: list[float]  # per document: P_doc-i after the floor
    picked: list[list[int]]  # per document: middle blocks picked by Top-P, before the cross-document cut


def personalised_queries(q_que: torch.Tensor, local_qs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Eq. 1 per layer: Q^_i = Q_que + 1/(D-1) sum_{j != i} |cos(Q_que, Q_loc_j)| Q_loc_j; D = 1: Q_que."""
    d = len(local_qs)
    if d <= 1:
        return [q_que.clone() for _ in local_qs]
    s = q_que.shape[0]
    flat_q = q_que.reshape(s, -1)
    weighted = []
    for lq in local_qs:
        cos = torch.nn.functional.cosine_similarity(flat_q, lq.reshape(s, -1), dim=-1).abs()  # [S]
        weighted.append(cos.view(s, 1, 1) * lq)
    total = torch.stack(weighted).sum(dim=0)
    return [q_que + (total - w) / (d - 1) for w in weighted]


def block_scores(q_hat: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
    """[S, H, D] x [S, Hkv, B, D] -> [S, B]: the concatenated-heads inner product per layer and block."""
    s, h, d = q_hat.shape
    hkv = block_keys.shape[1]
    q = q_hat.view(s, hkv, h // hkv, d).sum(dim=2)  # the group's queries read the same key
    return torch.einsum("skd,skbd->sb", q.float(), block_keys.float())


def top_p_ratio(scores: torch.Tensor, doc: DocInputs) -> float:
    """Eqs. 2-3: P per stable layer from s_anc, s_max, s_min, averaged over the layers."""
    if not doc.seg.middle:
        return 0.0
    anchor = torch.tensor(doc.seg.anchor, dtype=torch.long)
    ps = []
    for n in range(scores.shape[0]):
        s_anc = float(scores[n, anchor].mean())
        s_max, s_min = float(scores[n, int(doc.max_block[n])]), float(scores[n, int(doc.min_block[n])])
        ps.append((s_max - s_anc) / (s_max - s_min) if s_min < s_anc <= s_max else 0.0)
    return sum(ps) / len(ps)


def normalised(scores: torch.Tensor) -> torch.Tensor:
    """[S, B] -> [B]: per layer min-max over the document's blocks, averaged over the layers."""
    lo, hi = scores.min(dim=1, keepdim=True).values, scores.max(dim=1, keepdim=True).values
    return ((scores - lo) / (hi - lo).clamp_min(1e-12)).mean(dim=0)


def select_blocks(q_que: torch.Tensor, docs: list[DocInputs], *, min_p: float = 0.0,
                  cross_cut: bool = True) -> Selection:
    """The kept blocks of every document (see the module docstring). min_p: a floor on every P_doc-i
    (1.0 keeps every middle block through Top-P); cross_cut: apply the cross-document cut."""
    q_hats = personalised_queries(q_que, [d.local_q for d in docs])
    norms, top_ps, picked = [], [], []
    for doc, q_hat in zip(docs, q_hats, strict=True):
        scores = block_scores(q_hat, doc.block_keys)
        p = max(top_p_ratio(scores, doc), min_p)
        norm = normalised(scores)
        middle = doc.seg.middle
        count = min(len(middle), math.ceil(p * len(middle) - 1e-9))
        order = sorted(middle, key=lambda b: -float(norm[b]))
        norms.append(norm)
        top_ps.append(p)
        picked.append(sorted(order[:count]))
    kept = [list(p) for p in picked]
    if cross_cut and docs:
        cap = math.ceil(sum(len(d.seg.middle) for d in docs) / len(docs))
        pool = sorted(((float(norms[i][b]), i, b) for i, p in enumerate(picked) for b in p), key=lambda x: -x[0])
        kept = [[] for _ in docs]
        for _, i, b in pool[:cap]:
            kept[i].append(b)
    blocks = [sorted(set(d.seg.anchor) | set(k)) for d, k in zip(docs, kept, strict=True)]
    return Selection(blocks, top_ps, picked)
