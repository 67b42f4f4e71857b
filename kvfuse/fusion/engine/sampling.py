"""Token choice for a whole batch on the device: greedy and seeded nucleus sampling, row by row alike.

Each request keeps its own `RowSampling` (temperature, top_p, its own generator); `choose` takes one
logits row per request and returns the chosen ids as a device tensor, so a decode step needs one host
synchronisation for the whole batch (the caller copies the ids to the host once).

A row's choice depends on its own logits and its own generator only, never on the other rows, so a
request samples the same tokens alone (`Generation.accept`, a batch of one) and in any batch: every
operation is row-wise (softmax, sort, cumulative sum), and the random draw is vLLM v1's exponential
race -- `argmax(p / q)` with `q ~ Exp(1)` drawn from the row's generator, which picks index i with
probability p_i -- so each row consumes exactly `vocab` draws of its own generator per token whatever
the batch.

OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty` adjust a row's logits before the choice,
greedy or sampled: `logit + bias[j] - frequency_penalty * c[j] - presence_penalty * (c[j] > 0)`, with c[j]
the times token j was chosen for this row so far (its output only, as vLLM counts; OpenAI's reference
formula). The counts are kept on the row and updated by `choose` itself, so the decode loop needs no part
in it and a row's adjustment is still its own alone. A bias of -100 bans a token in practice; here it is
also excluded outright (logit -inf), so a banned token never appears. A row under a grammar
(`response_format`, grammar.py) has every token its grammar does not allow next excluded the same way,
after its bias and penalties; the grammar's matcher is the row's own and is advanced by its Generation,
which knows the chosen token on the host. docs/DESIGN.md, "Decoding".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvfuse.fusion.engine.grammar import RowGrammar

BAN_BIAS = -100.0  # OpenAI's floor: "should ban the token"


@dataclass
class RowSampling:
    """One request's sampling knobs. temperature <= 0: greedy (no generator). `logit_bias`: token id ->
    bias in [-100, 100]; `counts`: [vocab] times each token was chosen, kept only when a penalty is set;
    `grammar`: the row's matcher when its answer must follow one (grammar.py)."""

    temperature: float
    top_p: float
    generator: torch.Generator | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    counts: torch.Tensor | None = None
    grammar: RowGrammar | None = None
    _bias: torch.Tensor | None = None  # logit_bias as a [vocab] row, built on the first choice

    @classmethod
    def create(cls, temperature: float, top_p: float, seed: int | None, device: torch.device,
               logit_bias: Mapping[int | str, float] | None = None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0) -> RowSampling:
        """A sampling row with its generator on `device`, seeded (or from OS entropy when seed is None).
        `logit_bias` keys may be strings (as JSON carries them)."""
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        bias = {int(k): float(v) for k, v in (logit_bias or {}).items() if v}
        return cls(temperature, top_p, generator, bias, presence_penalty, frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def adjusts(self) -> bool:
        return bool(self.logit_bias) or self.penalized or self.grammar is not None

    def adjust(self, row: torch.Tensor) -> torch.Tensor:
        """This row's logits [vocab] with its bias and penalties applied (a new float32 tensor)."""
        vocab = row.shape[0]
        out = row.float()
        if self.logit_bias:
            if self._bias is None:
                bad = [t for t in self.logit_bias if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"logit_bias names token ids outside the vocabulary (0..{vocab - 1}): {bad}")
                ids = torch.tensor(list(self.logit_bias), device=row.device)
                values = torch.tensor(list(self.logit_bias.values()), device=row.device)
                values = torch.where(values <= BAN_BIAS, torch.full_like(values, float("-inf")), values)
                self._bias = torch.zeros(vocab, device=row.device).index_copy(0, ids, values)
            out = out + self._bias
        if self.penalized and self.counts is not None:
            out = out - self.frequency_penalty * self.counts - self.presence_penalty * (self.counts > 0).float()
        if self.grammar is not None:
            out = out.masked_fill(~self.grammar.mask(vocab, row.device), float("-inf"))
        return out

    def record(self, token: torch.Tensor, vocab: int) -> None:
        """Count the token chosen for this row (a 1-element device tensor: no host synchronisation)."""
        if self.penalized:
            if self.counts is None:
                self.counts = torch.zeros(vocab, device=token.device)
            self.counts.index_add_(0, token, torch.ones(1, device=token.device))


def choose(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """logits [B, vocab] (one row per entry of `rows`) -> chosen token ids [B] (int64, on logits' device)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} sampling rows")
    adjusted = [i for i, r in enumerate(rows) if r.adjusts]
    if adjusted:
        logits = logits.float().clone()
        for i in adjusted:
            logits[i] = rows[i].adjust(logits[i])
    chosen = _choose(logits, rows)
    for i in adjusted:
        rows[i].record(chosen[i : i + 1], logits.shape[1])
    return chosen


def _choose(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
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
