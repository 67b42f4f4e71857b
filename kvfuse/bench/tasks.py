"""Benchmark examples: RULER-style synthetic tasks over essay chunks, and MuSiQue multi-hop QA.

Every example is a list of chunk texts (each becomes one cached chunk), a question and its reference
answers. The synthetic tasks follow RULER (Hsieh et al., 2024): "needle" is its single NIAH, "multikey"
its multi-key NIAH (distractor needles with other keys), "multivalue" its multi-value NIAH and
"vartrack" its variable tracking. They differ from RULER in one way: the haystack is cut into `docs`
chunks of about `doc_tokens` tokens each, because fusion works on separately cached chunks, and the
facts are spread over those chunks.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvfuse.bench.data import load_essays, load_musique

TASKS = ("needle", "multikey", "multivalue", "vartrack", "musique")

# Task shapes (RULER defaults where RULER has one).
MULTIKEY_NEEDLES = 4  # facts per multikey example: one asked, the rest distractors with other keys
MULTIVALUE_VALUES = 4  # values of the one key in a multivalue example, all asked
VARTRACK_HOPS = 4  # "VAR B = VAR A" links after the first assignment: hops + 1 variables answer
VALUE_DIGITS = 7  # magic numbers are 7-digit integers (RULER)
VARTRACK_DIGITS = 5  # variable-tracking values are 5-digit integers (RULER)
# Greedy answer budget per task, after the answer prefix (digits are one token each for this tokenizer:
# a 7-digit value and its period take 8).
ANSWER_TOKENS = {"needle": 12, "multikey": 12, "multivalue": 48, "vartrack": 40, "musique": 24}

# Keys are adjective-noun pairs, like RULER's word keys; short lists keep them one or two tokens each.
_ADJECTIVES = (
    "amber quiet brave silver hollow gentle rapid frozen golden humble crimson lucky distant polite "
    "bitter wooden velvet sudden narrow ancient"
).split()
_NOUNS = (
    "lantern meadow harbor violin falcon pebble glacier orchard compass thistle beacon canyon ribbon "
    "walrus kettle saddle marble willow garnet tunnel"
).split()

NEEDLE = "The special magic number for {key} is: {value}."
NEEDLE_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
MULTIVALUE_NEEDLE = "One of the special magic numbers for {key} is: {value}."
MULTIVALUE_QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
VAR_FIRST = "VAR {name} = {value}."
VAR_LINK = "VAR {name} = VAR {prev}."
VARTRACK_QUESTION = "Find all variables that are assigned the value {value} in the text above."
# RULER's answer prefixes: placed after the assistant header (the start of the model's answer), so the
# model answers with the values rather than spending its answer budget restating the question first.
NEEDLE_PREFIX = "The special magic number for {key} mentioned in the provided text is"
MULTIVALUE_PREFIX = "The special magic numbers for {key} mentioned in the provided text are"
VARTRACK_PREFIX = ("According to the chain(s) of variable assignment in the text above, {k} variables are "
                   "assigned the value {value}, they are:")
# LongBench's MuSiQue instruction, placed after the passages as the question text.
MUSIQUE_QUESTION = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {question}\nAnswer:"
)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass
class Example:
    task: str
    id: str
    chunks: list[str]
    question: str
    answers: list[str]
    metric: str  # "match": share of `answers` found in the prediction; "f1": best token F1 (MuSiQue)
    max_tokens: int  # greedy answer budget (ANSWER_TOKENS of the task unless overridden)
    answer_prefix: str = ""  # start of the answer, given to the model after the assistant header
    # chunk index of each inserted fact, in insertion order (synthetic tasks; empty for MuSiQue)
    fact_chunks: list[int] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    # multi-document layout (kvfuse.bench.multidoc): the corpus passage each chunk was made from, and that
    # corpus (where `neighbours` contexts are found); empty / None for the single haystack and MuSiQue
    sources: list[int] = field(default_factory=list)
    corpus: Any = field(default=None, repr=False, compare=False)
    # each chunk's document name in the labelled prompt (kvfuse/fusion/prompt.py); empty: "part k"
    titles: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return list(self.titles) if self.titles else [f"part {k}" for k in range(1, len(self.chunks) + 1)]


@dataclass(frozen=True)
class TaskConfig:
    n: int = 20
    docs: int = 8
    doc_tokens: int = 512
    seed: int = 0


def split_sentences(text: str) -> list[str]:
    """The text's sentences (whitespace collapsed), cut after . ! or ?."""
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


class Haystack:
    """The essays as sentences with token counts, tokenized once and shared by every generator."""

    def __init__(self, tokenizer: Tokenizer, data_dir: Path):
        self.tokenizer = tokenizer
        self.sentences = split_sentences(" ".join(body for _, body in load_essays(Path(data_dir))))
        self.counts = [self.count(s) for s in self.sentences]

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(" " + text, add_special_tokens=False))

    def fill(self, rng: random.Random, budgets: Sequence[int]) -> list[list[str]]:
        """Consecutive essay sentences from a random start, cut into chunks of at most `budgets[i]`
        tokens (a sentence longer than the budget is skipped)."""
        pos = rng.randrange(len(self.sentences))
        chunks = []
        for budget in budgets:
            sents: list[str] = []
            used = 0
            skipped = 0
            while skipped < len(self.sentences):
                c = self.counts[pos]
                if used + c > budget:
                    if c > budget // 2:  # too long to ever fit well: skip it rather than end early
                        pos = (pos + 1) % len(self.sentences)
                        skipped += 1
                        continue
                    break
                sents.append(self.sentences[pos])
                used += c
                pos = (pos + 1) % len(self.sentences)
            chunks.append(sents)
        return chunks


def _keys(rng: random.Random, k: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], k)
    return [f"{a}-{b}" for a, b in pairs]


def _values(rng: random.Random, k: int, digits: int) -> list[str]:
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    out: set[str] = set()
    while len(out) < k:
        out.add(str(rng.randint(lo, hi)))
    return rng.sample(sorted(out), k)


def _var_names(rng: random.Random, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in out:
            out.append(name)
    return out


def _hide(
    hay: Haystack, rng: random.Random, cfg: TaskConfig, facts: list[str], *, ordered: bool = False
) -> tuple[list[str], list[int]]:
    """Spread `facts` over `cfg.docs` haystack chunks at random sentence boundaries; with `ordered`,
    facts keep their order through the chunks (a variable is assigned before it is read)."""
    where = [rng.randrange(cfg.docs) for _ in facts]
    if ordered:
        where.sort()
    fact_tokens = [0] * cfg.docs
    for f, c in zip(facts, where, strict=True):
        fact_tokens[c] += hay.count(f)
    chunks = hay.fill(rng, [max(1, cfg.doc_tokens - t) for t in fact_tokens])
    for c in range(cfg.docs):
        mine = [f for f, w in zip(facts, where, strict=True) if w == c]
        slots = sorted(rng.randint(0, len(chunks[c])) for _ in mine)
        # insert from the back so earlier slots stay valid; equal slots keep the facts' order
        for slot, fact in reversed(list(zip(slots, mine, strict=True))):
            chunks[c].insert(slot, fact)
    return [" ".join(s) for s in chunks], where


@dataclass(frozen=True)
class Facts:
    """What a synthetic task hides and asks, before it is placed in any text (shared by the single-haystack
    layout here and the multi-document one, kvfuse.bench.multidoc)."""

    facts: list[str]
    question: str
    answers: list[str]
    answer_prefix: str
    ordered: bool = False  # facts keep their order through the chunks (a variable is assigned before it is read)


def needle_facts(rng: random.Random) -> Facts:
    key, value = _keys(rng, 1)[0], _values(rng, 1, VALUE_DIGITS)[0]
    return Facts([NEEDLE.format(key=key, value=value)], NEEDLE_QUESTION.format(key=key), [value],
                 NEEDLE_PREFIX.format(key=key))


def multikey_facts(rng: random.Random) -> Facts:
    keys, values = _keys(rng, MULTIKEY_NEEDLES), _values(rng, MULTIKEY_NEEDLES, VALUE_DIGITS)
    facts = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    return Facts(facts, NEEDLE_QUESTION.format(key=keys[0]), [values[0]], NEEDLE_PREFIX.format(key=keys[0]))


def multivalue_facts(rng: random.Random) -> Facts:
    key, values = _keys(rng, 1)[0], _values(rng, MULTIVALUE_VALUES, VALUE_DIGITS)
    return Facts([MULTIVALUE_NEEDLE.format(key=key, value=v) for v in values],
                 MULTIVALUE_QUESTION.format(key=key), values, MULTIVALUE_PREFIX.format(key=key))


def vartrack_facts(rng: random.Random) -> Facts:
    names, value = _var_names(rng, VARTRACK_HOPS + 1), _values(rng, 1, VARTRACK_DIGITS)[0]
    facts = [VAR_FIRST.format(name=names[0], value=value)]
    facts += [VAR_LINK.format(name=b, prev=a) for a, b in zip(names, names[1:], strict=False)]
    return Facts(facts, VARTRACK_QUESTION.format(value=value), names,
                 VARTRACK_PREFIX.format(k=len(names), value=value), ordered=True)


FACTS = {"needle": needle_facts, "multikey": multikey_facts, "multivalue": multivalue_facts,
         "vartrack": vartrack_facts}


def synthetic(task: str, hay: Haystack, cfg: TaskConfig, i: int) -> Example:
    """Example i of a synthetic task: its facts spread over `cfg.docs` consecutive haystack chunks."""
    rng = random.Random(f"{task}/{cfg.seed}/{i}")
    f = FACTS[task](rng)
    chunks, where = _hide(hay, rng, cfg, f.facts, ordered=f.ordered)
    return Example(task, f"{task}-{cfg.seed}-{i}", chunks, f.question, f.answers, "match", ANSWER_TOKENS[task],
                   f.answer_prefix, where, f.facts)


def musique(tokenizer: Tokenizer, data_dir: Path, cfg: TaskConfig, i: int) -> Example:
    """The i-th MuSiQue item of a seeded shuffle; all its passages, each cut to `doc_tokens` tokens
    (passages in this sample run 530-680 tokens: `--doc-tokens 1024` keeps them whole)."""
    items = load_musique(Path(data_dir))
    order = list(range(len(items)))
    random.Random(f"musique/{cfg.seed}").shuffle(order)
    item = items[order[i % len(items)]]
    chunks = []
    for p in item.passages:
        ids = tokenizer.encode(p, add_special_tokens=False)
        chunks.append(p if len(ids) <= cfg.doc_tokens else tokenizer.decode(ids[: cfg.doc_tokens]))
    return Example("musique", f"musique-{cfg.seed}-{order[i % len(items)]}", chunks,
                   MUSIQUE_QUESTION.format(question=item.question), list(item.answers), "f1",
                   ANSWER_TOKENS["musique"])


def build_examples(task: str, tokenizer: Tokenizer, data_dir: Path, cfg: TaskConfig,
                   haystack: Haystack | None = None) -> list[Example]:
    if task == "musique":
        return [musique(tokenizer, data_dir, cfg, i) for i in range(cfg.n)]
    if task not in FACTS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    hay = haystack or Haystack(tokenizer, data_dir)
    return [synthetic(task, hay, cfg, i) for i in range(cfg.n)]
