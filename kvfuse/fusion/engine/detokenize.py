"""Decoding helpers: incremental detokenization that never splits a UTF-8 character, and stop strings
that are never partially emitted. Token choice is `sampling.py`'s, batched on the device."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    """What decoding needs of a tokenizer (a transformers one has it): its text, and its vocabulary's size
    (a grammar's view of it, engine/grammar.py)."""

    def __len__(self) -> int: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str: ...


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids.

    Decodes a short window of recent ids (prefix/read offsets) and holds back text that ends in an
    incomplete character (U+FFFD) until the rest of its bytes arrive.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

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
