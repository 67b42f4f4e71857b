"""Task generators: the facts really are in the chunks, and the answers can be derived from the text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfuse.bench import tasks
from kvfuse.bench.data import load_musique

CFG = tasks.TaskConfig(n=3, docs=4, doc_tokens=200, seed=7)


@pytest.fixture(scope="module")
def hay(tokenizer, shared_data: Path) -> tasks.Haystack:
    return tasks.Haystack(tokenizer, shared_data)


def _examples(task: str, tokenizer, shared_data: Path, hay, cfg: tasks.TaskConfig = CFG):
    return tasks.build_examples(task, tokenizer, shared_data, cfg, hay)


def _assert_chunk_sizes(ex: tasks.Example, tokenizer, cfg: tasks.TaskConfig) -> None:
    assert len(ex.chunks) == cfg.docs
    for chunk in ex.chunks:
        n = len(tokenizer.encode(chunk, add_special_tokens=False))
        # filled up to the budget on sentence boundaries; re-tokenizing the joined text may shift a few
        assert cfg.doc_tokens * 0.6 <= n <= cfg.doc_tokens + 8, n


def test_needle_fact_is_in_its_chunk_once(tokenizer, shared_data, hay):
    for ex in _examples("needle", tokenizer, shared_data, hay):
        (fact,), (where,) = ex.facts, ex.fact_chunks
        assert fact in ex.chunks[where]
        assert sum(c.count(fact) for c in ex.chunks) == 1
        key = re.search(r"for ([\w-]+) mentioned", ex.question).group(1)
        found = re.findall(rf"magic number for {re.escape(key)} is: (\d+)\.", " ".join(ex.chunks))
        assert found == ex.answers and len(ex.answers[0]) == tasks.VALUE_DIGITS
        assert ex.metric == "match"
        # the answer prefix starts the answer about the asked key and gives nothing away
        assert key in ex.answer_prefix and ex.answers[0] not in ex.answer_prefix
        _assert_chunk_sizes(ex, tokenizer, CFG)


def test_multikey_answer_is_the_asked_keys_value(tokenizer, shared_data, hay):
    for ex in _examples("multikey", tokenizer, shared_data, hay):
        text = " ".join(ex.chunks)
        pairs = dict(re.findall(r"The special magic number for ([\w-]+) is: (\d+)\.", text))
        assert len(pairs) == tasks.MULTIKEY_NEEDLES  # distinct keys, each once
        key = re.search(r"for ([\w-]+) mentioned", ex.question).group(1)
        assert ex.answers == [pairs[key]] and key in ex.answer_prefix
        assert len(set(pairs.values())) == tasks.MULTIKEY_NEEDLES  # distractors never share the value
        for fact, where in zip(ex.facts, ex.fact_chunks, strict=True):
            assert fact in ex.chunks[where]


def test_multivalue_all_values_present(tokenizer, shared_data, hay):
    for ex in _examples("multivalue", tokenizer, shared_data, hay):
        key = re.search(r"numbers for ([\w-]+) mentioned", ex.question).group(1)
        found = re.findall(rf"magic numbers for {re.escape(key)} is: (\d+)\.", " ".join(ex.chunks))
        assert sorted(found) == sorted(ex.answers) and len(ex.answers) == tasks.MULTIVALUE_VALUES


def test_vartrack_answer_follows_the_chain_in_reading_order(tokenizer, shared_data, hay):
    for ex in _examples("vartrack", tokenizer, shared_data, hay):
        value = re.search(r"the value (\d+)", ex.question).group(1)
        env: dict[str, str] = {}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = ((?:VAR [A-Z]{5})|\d+)\.", " ".join(ex.chunks)):
            env[name] = env[rhs[4:]] if rhs.startswith("VAR ") else rhs  # KeyError = read before assigned
        assert sorted(n for n, v in env.items() if v == value) == sorted(ex.answers)
        assert len(ex.answers) == tasks.VARTRACK_HOPS + 1
        assert not any(name in ex.answer_prefix for name in ex.answers)
        assert ex.fact_chunks == sorted(ex.fact_chunks)


def test_musique_uses_all_passages_cut_to_doc_tokens(tokenizer, shared_data):
    cfg = tasks.TaskConfig(n=2, docs=3, doc_tokens=64, seed=1)
    items = load_musique(shared_data)
    for ex in tasks.build_examples("musique", tokenizer, shared_data, cfg):
        idx = int(ex.id.rsplit("-", 1)[1])
        assert ex.answers == list(items[idx].answers) and ex.metric == "f1"
        assert items[idx].question in ex.question
        assert len(ex.chunks) == len(items[idx].passages) == 10
        for chunk, passage in zip(ex.chunks, items[idx].passages, strict=True):
            assert len(tokenizer.encode(chunk, add_special_tokens=False)) <= cfg.doc_tokens + 2
            assert passage.startswith(chunk[:40])


def test_examples_are_seeded(tokenizer, shared_data, hay):
    a = _examples("needle", tokenizer, shared_data, hay)
    b = _examples("needle", tokenizer, shared_data, hay)
    c = _examples("needle", tokenizer, shared_data, hay, tasks.TaskConfig(n=3, docs=4, doc_tokens=200, seed=8))
    assert [e.chunks for e in a] == [e.chunks for e in b]
    assert [e.answers for e in a] != [e.answers for e in c]


def test_unknown_task_is_refused(tokenizer, shared_data, hay):
    with pytest.raises(ValueError, match="unknown task"):
        _examples("summarize", tokenizer, shared_data, hay)
