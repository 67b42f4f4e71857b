"""Structured answers (kvfuse/fusion/engine/grammar.py): a row under a JSON schema's grammar only ever takes
tokens its grammar allows, so every answer that ends parses and validates against its schema, whatever the
model; each row's mask is its own, so a batch of constrained and free rows chooses each row's solo
tokens; a schema that cannot be compiled is refused naming the problem.

A tiny random-weight Llama over the real tokenizer is the hardest case for the grammar (its logits favour
nothing JSON-like), and fast; the slow test asks the real model."""

from __future__ import annotations

import json

import pytest
import torch
from fusion_helpers import tiny_llama_engine

from kvfuse.fusion import FusionEngine, FusionOptions, GenerationOptions
from kvfuse.fusion.engine import outputs as E
from kvfuse.fusion.engine import solo
from kvfuse.fusion.engine.core import EngineCore
from kvfuse.fusion.engine.grammar import GrammarError, json_grammar
from kvfuse.fusion.engine.requests import SchedulerLimits
from kvfuse.fusion.engine.sequence import Sequence

MAX_TOKENS = 96
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}
VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no", "unsure"]},
                                            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9},
                                                       "minItems": 1, "maxItems": 3}},
           "required": ["verdict", "scores"], "additionalProperties": False}


def valid_person(v) -> bool:
    """PERSON validated by hand (no schema validator is installed)."""
    return (isinstance(v, dict) and set(v) == {"name", "age", "member"} and isinstance(v["name"], str)
            and len(v["name"]) <= 12 and type(v["age"]) is int and 0 <= v["age"] <= 150
            and isinstance(v["member"], bool))


def valid_verdict(v) -> bool:
    return (isinstance(v, dict) and set(v) == {"verdict", "scores"} and v["verdict"] in ("yes", "no", "unsure")
            and isinstance(v["scores"], list) and 1 <= len(v["scores"]) <= 3
            and all(type(s) is int and 0 <= s <= 9 for s in v["scores"]))


@pytest.fixture(scope="module")
def tiny(tokenizer) -> FusionEngine:
    return tiny_llama_engine(tokenizer)


def _rows() -> list[tuple[dict | None, float, int | None]]:
    """(schema, temperature, seed) per request: greedy and sampled under each schema, and one free row."""
    return [(PERSON, 0.0, None), (VERDICT, 0.0, None), (PERSON, 1.0, 5), (VERDICT, 0.8, 6), (None, 0.0, None)]


def _options(schema, temperature, seed) -> GenerationOptions:
    return GenerationOptions(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                             grammar=json_grammar(schema) if schema is not None else None)


def _request(engine, i: int, question: str):
    chunk = engine.tokenizer.encode("Ada Lovelace, 36, was a member of the society.", add_special_tokens=False)
    prefix_ids, question_ids = engine.prompt_parts(question, "Answer in JSON.")
    prefix, kv = engine.precompute([prefix_ids, chunk])
    return prefix, [kv], question_ids, FusionOptions(method="pie", recompute_ratio=0.2)


def _batch_and_solo(engine, questions: list[str], rows) -> tuple[list, list]:
    reqs = [_request(engine, i, q) for i, q in enumerate(questions)]
    alone = []
    for (prefix, chunks, q, fusion), row in zip(reqs, rows, strict=True):
        *_, result = solo.generate(engine, prefix, chunks, q, fusion, _options(*row))
        alone.append(result)
    core = EngineCore(engine, SchedulerLimits(max_running=8, kv_budget_tokens=4096, prefill_tokens_per_step=512,
                                              ingest_share=0.25))
    for i, ((prefix, chunks, q, fusion), row) in enumerate(zip(reqs, rows, strict=True)):
        kv_tokens = len(prefix) + sum(len(c) for c in chunks) + len(q) + MAX_TOKENS
        core.add(Sequence(i, prefix.token_ids, q, fusion, _options(*row), kv_tokens=kv_tokens,
                          prefill_tokens=len(q), prefix=prefix, chunks=chunks))
    out: list = []
    while core.has_work:
        out.extend(core.step())
    assert max(o.batch for o in out if isinstance(o, E.Stepped)) == len(rows)  # they decoded together
    done = {o.job_id: o.seq.gen for o in out if isinstance(o, E.Finished)}
    return [done[i] for i in range(len(rows))], alone


def test_constrained_rows_of_a_batch_validate_and_choose_their_solo_tokens(tiny) -> None:
    rows = _rows()
    batch, solo = _batch_and_solo(tiny, [f"Question {i}?" for i in range(len(rows))], rows)
    assert [g.token_ids for g in batch] == [r.token_ids for r in solo]
    for gen, (schema, _, _) in zip(batch, rows, strict=True):
        if schema is None:
            continue
        assert gen.finished == "stop"  # the grammar completed, then only a stop token was allowed
        value = json.loads(gen.text)
        assert (valid_person if schema is PERSON else valid_verdict)(value), gen.text
    free = batch[-1].text
    with pytest.raises(ValueError):  # a random model's free answer is no JSON: the grammar did the work
        json.loads(free)


def test_answers_have_no_free_whitespace(tiny) -> None:
    """Whitespace is bounded: only the fixed separators, so a model cannot loop on blanks."""
    rows = [(VERDICT, 1.3, s) for s in range(3)]
    batch, _ = _batch_and_solo(tiny, ["Q?", "R?", "S?"], rows)
    for gen in batch:
        value = json.loads(gen.text)
        assert valid_verdict(value)
        assert gen.text == json.dumps(value, separators=(", ", ": ")), gen.text


def test_the_grammar_tokenizer_is_made_once_per_tokenizer(tiny) -> None:
    """The worker makes it at start (worker/core.py); every request's matcher then reuses it."""
    from kvfuse.fusion.engine.grammar import RowGrammar, ll_tokenizer

    made = ll_tokenizer(tiny.tokenizer, tiny.stop_token_ids)
    assert ll_tokenizer(tiny.tokenizer, tiny.stop_token_ids) is made
    assert RowGrammar(json_grammar(PERSON), tiny.tokenizer, tiny.stop_token_ids)._lltok is made
    assert made.vocab_size == len(tiny.tokenizer)


@pytest.mark.parametrize("schema, problem", [
    ({"type": "thing"}, "thing"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "string", "pattern": "(("}, "unclosed group"),
])
def test_a_schema_that_cannot_compile_is_refused_naming_the_problem(schema, problem) -> None:
    with pytest.raises(GrammarError, match=problem):
        json_grammar(schema)


@pytest.mark.slow
def test_the_model_answers_in_valid_json_for_several_rows_at_once(engine) -> None:
    rows = [(PERSON, 0.0, None), (PERSON, 0.7, 1), (VERDICT, 0.0, None), (VERDICT, 0.9, 2)]
    questions = ["Give the person's name, age and membership.", "Who is it, how old, a member?",
                 "Was she a member? Give a verdict and scores.", "Is she a member? A verdict and scores."]
    batch, solo = _batch_and_solo(engine, questions, rows)
    assert [g.token_ids for g in batch] == [r.token_ids for r in solo]
    for gen, (schema, _, _) in zip(batch, rows, strict=True):
        assert gen.finished == "stop"
        assert (valid_person if schema is PERSON else valid_verdict)(json.loads(gen.text)), gen.text


def test_a_stop_id_its_tokenizer_lacks_does_not_stop_the_grammar(tokenizer) -> None:
    """A config's eos past the tokenizer's vocabulary (OLMo 2's default, 50279, beside a 49152 tokenizer)
    is left out of llguidance's view instead of failing the worker's start; the tokenizer's own stops stay."""
    from kvfuse.fusion.engine.grammar import RowGrammar, ll_tokenizer

    eos = tokenizer.eos_token_id
    assert ll_tokenizer(tokenizer, {eos, len(tokenizer) + 1127}) is ll_tokenizer(tokenizer, {eos})
    row = RowGrammar(json_grammar(PERSON), tokenizer, {eos, len(tokenizer) + 1127})
    assert row.mask(len(tokenizer), torch.device("cpu")).any()
