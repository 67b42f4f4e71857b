"""Training examples for the KVLink link tokens, built from essay passages with templates of their own.

Each example is a few essay passages (the documents, cached separately at query time) with facts
hidden in them, a question and its short answer. Two kinds, as the paper's data recipe asks for
("tasks requiring cross-chunk reasoning are essential", §3.6 of docs/methods/kvlink.md):
- copy: one document states a fact about a key, the others state the same kind of fact about other
  keys (distractors); the question asks for one key's value;
- combine: a bridge fact in one document and its completion in another (A works at office X; office X
  is in city Y), in either order; the question needs both.

The documents are shuffled (the paper's App. A.5: unshuffled data teaches the model to read only the
first documents). None of this is the fidelity benchmark's data: no template, key or value format of
`kvfuse.bench.tasks` is used, and examples are seeded from their own namespace ("kvlink-train/…").
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

NAMES = ("Ada Boris Clara Dmitri Elena Felix Greta Hugo Ines Jonas Kiri Leon Mira Nadia Oskar Priya "
         "Quinn Rosa Stefan Tara Umar Vera Wendell Xenia Yusuf Zora").split()
PLACES = ("Lisbon Oslo Kyoto Quito Dakar Perth Tallinn Bergen Cusco Hanoi Tunis Lyon Porto Malmo Riga "
          "Accra Tromso Split Graz Cork").split()
COLORS = "red blue green yellow purple orange black white grey brown pink teal".split()
PETS = "Biscuit Pepper Mango Ziggy Noodle Pixel Waffle Juniper Comet Olive Tofu Maple".split()
UNITS = ("Alpha Beta Gamma Delta Sigma Omega Kappa Theta Lambda Zeta").split()

# copy templates: (fact, question, answer) with {key} and {value}
COPY = (
    ("{key}'s locker code is {value}.", "What is {key}'s locker code?", "digits"),
    ("The ferry to {key} leaves from pier {value}.", "From which pier does the ferry to {key} leave?", "digits"),
    ("{key} keeps a {value} umbrella by the door.", "What color is the umbrella {key} keeps by the door?", "color"),
    ("The {key} team meets in room {value}.", "In which room does the {key} team meet?", "digits"),
)
# combine templates: (bridge fact, completion fact, question); {key} -> {mid} -> {value}
COMBINE = (
    ("{key} works at the {mid} office.", "The {mid} office is in {value}.", "In which city does {key} work?",
     "place"),
    ("{key} owns a dog called {mid}.", "{mid} the dog weighs {value} kilograms.",
     "How many kilograms does {key}'s dog weigh?", "digits"),
    ("{key} belongs to unit {mid}.", "Unit {mid} wears {value} jackets.",
     "What color are the jackets of {key}'s unit?", "color"),
)


@dataclass
class LinkExample:
    docs: list[str]
    question: str
    answer: str
    kind: str  # "copy" | "combine"


class Passages:
    """The essays as sentences with token counts (tokenized once)."""

    def __init__(self, tokenizer, data_dir: Path) -> None:
        from kvfuse.bench.data import load_essays

        text = " ".join(body for _, body in load_essays(Path(data_dir)))
        self.sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]
        self.tokens = [len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in self.sentences]

    def passage(self, rng: random.Random, budget: int) -> list[str]:
        """Consecutive sentences from a random start, up to `budget` tokens (at least one sentence)."""
        pos = rng.randrange(len(self.sentences))
        out, used = [], 0
        while len(out) < len(self.sentences):
            n = self.tokens[pos]
            if out and used + n > budget:
                break
            if n <= budget:
                out.append(self.sentences[pos])
                used += n
            pos = (pos + 1) % len(self.sentences)
        return out


def _value(rng: random.Random, kind: str) -> str:
    if kind == "digits":
        return str(rng.randint(100, 99999))
    if kind == "color":
        return rng.choice(COLORS)
    return rng.choice(PLACES)


def _insert(rng: random.Random, sentences: list[str], fact: str) -> None:
    sentences.insert(rng.randint(0, len(sentences)), fact)


def make_example(passages: Passages, seed: int, index: int, docs: tuple[int, int],
                 doc_tokens: tuple[int, int]) -> LinkExample:
    """The `index`-th example of the stream `seed`: deterministic, so a resumed run sees the same data."""
    rng = random.Random(f"kvlink-train/{seed}/{index}")
    n = rng.randint(*docs)
    bodies = [passages.passage(rng, rng.randint(*doc_tokens)) for _ in range(n)]
    if rng.random() < 0.5:
        fact, question, kind = rng.choice(COPY)
        keys = rng.sample(PLACES if "ferry" in fact else NAMES if "{key}'s" in fact or "{key} keeps" in fact
                          else UNITS, min(n, 4))
        values = [_value(rng, kind) for _ in keys]
        where = rng.sample(range(n), len(keys))
        for key, value, d in zip(keys, values, where, strict=True):
            _insert(rng, bodies[d], fact.format(key=key, value=value))
        ex = LinkExample([" ".join(b) for b in bodies], question.format(key=keys[0]), values[0], "copy")
    else:
        bridge, completion, question, kind = rng.choice(COMBINE)
        key = rng.choice(NAMES)
        mid = rng.choice(PETS if "dog" in bridge else UNITS if "unit" in bridge else NAMES[::-1][:10])
        value = _value(rng, kind)
        a, b = rng.sample(range(n), 2)
        _insert(rng, bodies[a], bridge.format(key=key, mid=mid))
        _insert(rng, bodies[b], completion.format(mid=mid, value=value))
        ex = LinkExample([" ".join(b) for b in bodies], question.format(key=key), value, "combine")
    return ex
