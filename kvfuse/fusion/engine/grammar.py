"""Constrained decoding: a row whose answer must follow a grammar (OpenAI's `response_format`) gets, each
step, only the tokens its grammar may continue with; every other token's logit is -inf before the choice.

The grammar travels as text (llguidance's serialised grammar, which `json_grammar` makes from a JSON
schema without any tokenizer, so the API can check a schema and refuse a bad one); it is compiled into a
matcher here, where the tokenizer lives, one matcher per request. The matcher's state is the row's own:
its mask depends on the tokens this row took, never on another row, so a constrained request chooses
the same tokens alone and in any batch (sampling.py). Once the grammar is complete only a stop token is
allowed, so the answer ends where its JSON does.

Whitespace is not free: the JSON grammars allow none between tokens beyond the fixed separators
(", " and ": "), so a small model cannot loop on blanks. llguidance was chosen by measurement
(docs/results/structured/README.md); docs/DESIGN.md, "Decoding".
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from llguidance._lib import JsonCompileOptions

    from kvfuse.fusion.engine.detokenize import Tokenizer

# no free whitespace; OpenAI's own answers use these separators
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, tuple[list[int], LLTokenizer]] = weakref.WeakKeyDictionary()  # -> (eos ids, its view)


class GrammarError(ValueError):
    """A grammar (or the JSON schema it came from) that cannot be compiled; the message names the problem."""


def json_grammar(schema: dict[str, object] | None) -> str:
    """The serialised grammar of answers that are JSON valid against `schema` (None: any JSON object, as
    `json_object` asks). Raises GrammarError naming what in the schema cannot be compiled."""
    import llguidance

    schema = {"type": "object"} if schema is None else schema
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as err:
        raise GrammarError(str(err)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error)
    return grammar


def ll_tokenizer(tokenizer: Tokenizer, stop_ids: Iterable[int]) -> LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer (it reads the whole vocabulary, which
    takes a moment): the worker builds it at start, so the first structured request does not hold up
    the batch's step while it is made. Stop ids past the tokenizer's vocabulary (a config's eos that
    its tokenizer does not hold) are left out: llguidance refuses them, and the grammar could not allow
    them anyway."""
    import llguidance.hf

    eos = sorted(t for t in stop_ids if t < len(tokenizer))
    cached = _TOKENIZERS.get(tokenizer)
    if cached is None or cached[0] != eos:
        view = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos or None)  # type: ignore[arg-type]  # a HF tokenizer
        cached = _TOKENIZERS[tokenizer] = (eos, view)
    return cached[1]


class RowGrammar:
    """One request's matcher: `mask(vocab)` the allowed ids as a bool row, `advance(token)` after each
    chosen token. The first stop token ends the answer, so only tokens before it are advanced."""

    def __init__(self, grammar: str, tokenizer: Tokenizer, stop_ids: Iterable[int]) -> None:
        import llguidance

        self.stop_ids = sorted(stop_ids)
        self._lltok = ll_tokenizer(tokenizer, self.stop_ids)
        self.matcher = llguidance.LLMatcher(self._lltok, grammar)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self._bits = torch.zeros((self._lltok.vocab_size + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool: the tokens this row may take next (ids past the tokenizer's vocabulary: none). A
        matcher in error (it never is, unless a token outside its mask was forced) allows only the stop
        tokens, so the row ends instead of failing the batch's choice."""
        if self.matcher.is_error():
            out = torch.zeros(vocab, dtype=torch.bool)
            out[[t for t in self.stop_ids if t < vocab]] = True
            return out.to(device)
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        allowed = ((self._bits.unsqueeze(-1) >> self._shifts) & 1).view(-1).bool()
        out = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, allowed.numel())
        out[:n] = allowed[:n]
        return out.to(device)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """Whether the answer so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()
