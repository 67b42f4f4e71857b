"""Decoding helpers: token choice (greedy / seeded nucleus sampling), incremental detokenization that
never splits a UTF-8 character, and stop strings that are never partially emitted."""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: int | None, device: torch.device) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.generator: torch.Generator | None = None
        if temperature > 0:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.top_p
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids.

    Decodes a short window of recent ids (prefix/read offsets) and holds back text that ends in an
    incomplete character (U+FFFD) until the rest of its bytes arrive.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""


class StopMatcher:
    """Releases text only once it cannot be the start of a stop string; finds the earliest stop."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit now, stopped)."""
        search_from = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return self._release(len(self.text)), True
        hold = 0
        for s in self.stops:  # longest tail of the text that begins some stop string
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self._release(len(self.text) - hold), False

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out
