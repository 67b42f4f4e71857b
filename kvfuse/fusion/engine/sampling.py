"""Token choice for a whole batch on the device: greedy and seeded nucleus sampling, row by row alike.

Each request keeps its own `RowSampling` (temperature, top_p, its own generator); `choose` takes one
logits row per request and returns the chosen ids as a device tensor, so a decode step needs one host
synchronisation for the whole batch (the caller copies the ids to the host once).

A row's choice depends on its own logits and its own generator only, never on the other rows, so a
request samples the same tokens alone (`Generation.accept`, a batch of one) and in any batch: every
operation is row-wise (softmax, sort, cumulative sum), and the random draw is vLLM v1's exponential
race -- `argmax(p / q)` with `q ~ Exp(1)` drawn from the row's generator, which picks index i with
probability p_i -- so each row consumes exactly `vocab` draws of its own generator per token whatever
the batch. docs/DESIGN.md, "Decoding".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """One request's sampling knobs. temperature <= 0: greedy (no generator)."""

    temperature: float
    top_p: float
    generator: torch.Generator | None = None

    @classmethod
    def create(cls, temperature: float, top_p: float, seed: int | None, device: torch.device) -> RowSampling:
        """A sampling row with its generator on `device`, seeded (or from OS entropy when seed is None)."""
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        return cls(temperature, top_p, generator)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def choose(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """logits [B, vocab] (one row per entry of `rows`) -> chosen token ids [B] (int64, on logits' device)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} sampling rows")
    chosen = torch.argmax(logits, dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if not sampled:
        return chosen
    device = logits.device
    index = torch.tensor(sampled, device=device)
    temperature = torch.tensor([rows[i].temperature for i in sampled], device=device).unsqueeze(1)
    top_p = torch.tensor([rows[i].top_p for i in sampled], device=device).unsqueeze(1)
    probs = torch.softmax(logits.index_select(0, index).float() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p) | (top_p >= 1.0)
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    race = torch.empty_like(sorted_probs)
    for j, i in enumerate(sampled):
        race[j].exponential_(generator=rows[i].generator)
    pick = torch.argmax(sorted_probs / race, dim=-1, keepdim=True)
    return chosen.index_copy(0, index, order.gather(1, pick).squeeze(1))
