"""The multi-document layout of the fidelity benchmark: short documents, one chunk each, in retrieval order.

Why it exists: the usual RAG prompt is the chunks of many short documents in the retriever's order, not
consecutive chunks of one long text. There each chunk is cached alone (a one-chunk document has nothing
before it, so `store.precompute_context: document` gives it nothing) and no chunk's neighbour in the
prompt is its neighbour in the text. The single-haystack layout (kvfuse.bench.tasks) fuses one text's
consecutive chunks in their order and hides that case. Results: docs/results/fidelity-multidoc/.

- **Corpus**: every essay cut into consecutive passages of at most `doc_tokens` tokens on sentence
  boundaries: what an index over the essays would hold.
- **Example**: `docs` passages of distinct essays (each at least MIN_FILL of `doc_tokens`), each its own
  document and its own chunk; the task's facts (kvfuse.bench.tasks templates) go in at random sentence
  boundaries, each fact in a different document (the asked fact in one, distractors in others), the
  document's last sentences dropped to make room. The draw does not depend on the order, so the two
  orders of one seed hold the same documents.
- **Order**: `retrieval` fuses the documents by the embedder's cosine with the question, highest first,
  as the service fuses its vector-search hits; `best-last` the same ranking reversed, the best document
  next to the question (LangChain's LongContextReorder puts the best at both ends; this is its end half);
  `shuffled` keeps the seeded draw (no relation to the question).
- **Names**: each document is named by its essay (the labelled prompt's title, kvfuse/fusion/prompt.py).
- **Neighbours** (`store.precompute_context: neighbours`): each document's context is its nearest chunks
  among the corpus (the example's passages replaced by its documents), chosen by the function the service
  uses at ingestion (`fusion.chunk_context.nearest_context`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvfuse.bench import tasks
from kvfuse.bench.data import load_essays

LAYOUTS = ("haystack", "multidoc")
ORDERS = ("retrieval", "best-last", "shuffled")
TASKS = ("needle", "multikey", "multivalue")  # facts independent of reading order
MIN_FILL = 0.75  # a passage drawn as a document fills at least this share of doc_tokens (no essay tails)

Embed = Callable[[list[str]], Any]  # texts -> unit-norm vectors [len, d] (retriever.Embedder.embed)
Tokenize = Callable[[str], list[int]]


def label(task: str, order: str) -> str:
    """The task name rows carry: `needle-docs` (retrieval order), `needle-docs-shuffled`; sorted, each sits
    beside the single-haystack `needle`."""
    return f"{task}-docs" if order == "retrieval" else f"{task}-docs-{order}"


class Corpus:
    """The essays as passages: what an example's documents are drawn from and where their neighbours are.

    Embeddings and token ids of the passages are computed once, when first asked for."""

    def __init__(self, tokenizer: tasks.Tokenizer, data_dir: Path, doc_tokens: int):
        self.tokenizer, self.doc_tokens = tokenizer, doc_tokens
        self.sentences: list[list[str]] = []
        self.counts: list[list[int]] = []
        self.essays: list[str] = []
        for name, body in load_essays(Path(data_dir)):
            sents: list[str] = []
            counts: list[int] = []
            for s in tasks.split_sentences(body):
                c = self.count(s)
                if c > doc_tokens:  # longer than a passage: left out
                    continue
                if sents and sum(counts) + c > doc_tokens:
                    self._add(name, sents, counts)
                    sents, counts = [], []
                sents.append(s)
                counts.append(c)
            if sents:
                self._add(name, sents, counts)
        self.texts = [" ".join(s) for s in self.sentences]
        self.drawable: dict[str, list[int]] = {}
        for p, essay in enumerate(self.essays):
            if sum(self.counts[p]) >= MIN_FILL * doc_tokens:
                self.drawable.setdefault(essay, []).append(p)
        self._vectors: Any = None
        self._ids: dict[int, list[int]] = {}

    def _add(self, essay: str, sents: list[str], counts: list[int]) -> None:
        self.essays.append(essay)
        self.sentences.append(sents)
        self.counts.append(counts)

    def __len__(self) -> int:
        return len(self.texts)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(" " + text, add_special_tokens=False))

    def document(self, p: int, facts: Sequence[str], rng: random.Random) -> str:
        """Passage p with `facts` at random sentence boundaries (in their order), its last sentences
        dropped so that the whole stays within doc_tokens."""
        sents, counts = list(self.sentences[p]), list(self.counts[p])
        room = self.doc_tokens - sum(self.count(f) for f in facts)
        while sents and sum(counts) > room:
            sents.pop()
            counts.pop()
        slots = sorted(rng.randint(0, len(sents)) for _ in facts)
        for slot, fact in reversed(list(zip(slots, facts, strict=True))):
            sents.insert(slot, fact)
        return " ".join(sents)

    def vectors(self, embed: Embed) -> Any:
        if self._vectors is None:
            self._vectors = embed(self.texts)
        return self._vectors

    def token_ids(self, p: int, tokenize: Tokenize) -> list[int]:
        if p not in self._ids:
            self._ids[p] = tokenize(self.texts[p])
        return self._ids[p]

    def neighbour_contexts(self, sources: Sequence[int], chunk_ids: Sequence[Sequence[int]], vectors: Any,
                           embed: Embed, tokenize: Tokenize, n: int, budget: int) -> list[list[int]]:
        """Each of an example's documents' `neighbours` context: its n most similar chunks among the
        example's other documents and every corpus passage but the example's own (`sources`, which its
        documents replace), least similar first, cut to `budget` tokens; `vectors` are the documents'."""
        import numpy as np

        from kvfuse.fusion import chunk_context

        docs = np.asarray(vectors, dtype=np.float32)
        own, cross = docs @ docs.T, docs @ np.asarray(self.vectors(embed), dtype=np.float32).T
        cross[:, list(sources)] = -np.inf
        out = []
        for i in range(len(chunk_ids)):
            scored = [(float(own[i, j]), chunk_ids[j]) for j in range(len(chunk_ids)) if j != i]
            # only the corpus' n best can be among the n best of the union: tokenize just those
            best = np.argsort(-cross[i], kind="stable")[:n]
            scored += [(float(cross[i, p]), self.token_ids(int(p), tokenize)) for p in best]
            out.append(chunk_context.nearest_context(scored, n, budget))
        return out


def draw(task: str, corpus: Corpus, cfg: tasks.TaskConfig, i: int, order: str) -> tasks.Example:
    """Example i of `task` with its documents in the seeded draw's order (the same draw for every order)."""
    if task not in TASKS:
        raise ValueError(f"the multi-document layout has the tasks {', '.join(TASKS)}, not {task!r}")
    rng = random.Random(f"multidoc/{task}/{cfg.seed}/{i}")
    f = tasks.FACTS[task](rng)
    essays = sorted(corpus.drawable)
    if cfg.docs > len(essays) or len(f.facts) > cfg.docs:
        raise ValueError(f"{task} needs {len(f.facts)} to {len(essays)} documents of {cfg.doc_tokens} "
                         f"tokens (distinct essays); asked for {cfg.docs}")
    sources = [rng.choice(corpus.drawable[e]) for e in rng.sample(essays, cfg.docs)]
    where = rng.sample(range(cfg.docs), len(f.facts))  # each fact in its own document
    chunks = [corpus.document(p, [fact for fact, w in zip(f.facts, where, strict=True) if w == d], rng)
              for d, p in enumerate(sources)]
    name = label(task, order)
    return tasks.Example(name, f"{name}-{cfg.seed}-{i}", chunks, f.question, f.answers, "match",
                         tasks.ANSWER_TOKENS[task], f.answer_prefix, where, f.facts, sources, corpus,
                         [corpus.essays[p] for p in sources])


def retrieval_order(question: Any, documents: Any) -> list[int]:
    """Document indices by cosine with the question (unit-norm vectors), highest first; ties by index."""
    import numpy as np

    sims = np.asarray(documents, dtype=np.float32) @ np.asarray(question, dtype=np.float32)
    return [int(j) for j in np.argsort(-sims, kind="stable")]


def reordered(ex: tasks.Example, order: Sequence[int]) -> tasks.Example:
    """The example with its documents in `order` (order[k]: the document placed k-th)."""
    slot = {d: k for k, d in enumerate(order)}
    return dataclasses.replace(ex, chunks=[ex.chunks[d] for d in order], sources=[ex.sources[d] for d in order],
                               fact_chunks=[slot[w] for w in ex.fact_chunks],
                               titles=[ex.titles[d] for d in order] if ex.titles else [])


def build_examples(task: str, corpus: Corpus, cfg: tasks.TaskConfig, order: str,
                   embed: Embed | None = None) -> list[tasks.Example]:
    """cfg.n examples of `task` in `order`; `retrieval` and `best-last` need `embed`, the embedder the
    service retrieves with."""
    if order not in ORDERS:
        raise ValueError(f"unknown document order {order!r}; choose from {', '.join(ORDERS)}")
    examples = [draw(task, corpus, cfg, i, order) for i in range(cfg.n)]
    if order == "shuffled":
        return examples
    if embed is None:
        raise ValueError("retrieval order needs the embedder")
    out = []
    for ex in examples:
        vecs = embed([ex.question, *ex.chunks])
        ranked = retrieval_order(vecs[0], vecs[1:])
        out.append(reordered(ex, ranked if order == "retrieval" else ranked[::-1]))
    return out
