"""Fusion methods with chunk caches computed alone and after a context, on the same examples, in one run.

    python studies/context_modes.py MODE SEED N OUT_PREFIX [TASKS] [METHODS]

For every example (task by task in turn, so every task has examples whenever the run is stopped) the
chunks are precomputed twice, alone (`none`) and after MODE (`store.precompute_context`), and every method
runs on both at r = 0.15, plus `anchor-noanchors`: `anchor` with its forced chunk-start tokens off
(`anchor_tokens` = 0), to see whether they are still needed once the chunks carry a context. Vanilla runs
once per example (read back from `bench.reference_dir` when there). This is `kvfuse bench fidelity`'s
in-process backend (`kvfuse.bench.engine_backend.EngineBackend`), scoring and measures; it only shares the
vanilla run and the example between the two modes, which the CLI does in two runs.

STUDY_SHARD=I/K runs only the examples whose index is I modulo K, so K processes can share one
accelerator (studies/gpu/decision.sh); studies/context_merge.py joins their outputs.

STUDY_SHUFFLE=1 fuses each example's chunks in a shuffled order (seeded by SEED and the example), as a
retrieval that ranks chunks by score would, while `document` contexts still follow the chunks' order in
their document: a chunk's context is then no longer the text before it in the prompt.

Writes OUT_PREFIX-none.json and OUT_PREFIX-MODE.json, each a fidelity result (rows, outcomes, ingest
throughput), checkpointed after every example; `studies/fidelity_context.py` tables them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

from kvfuse.bench import report, tasks
from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import aggregate, outcome_dicts
from kvfuse.config import get_settings

RATIO = 0.15
NO_ANCHORS = "anchor-noanchors"


def main(argv: list[str]) -> int:
    mode, seed, n, prefix = argv[0], int(argv[1]), int(argv[2]), argv[3]
    task_names = (argv[4] if len(argv) > 4 else "needle,multikey,multivalue").split(",")
    methods = (argv[5] if len(argv) > 5 else "anchor,cacheblend,prophetkv").split(",")
    settings = get_settings()
    backend = EngineBackend(settings, max_tokens=None, reference_dir=settings.bench.reference_dir)
    base_options = backend.options

    def options(method: str, ratio: float | None):
        if method == NO_ANCHORS:
            return dataclasses.replace(base_options("anchor", ratio), anchor_tokens=0)
        return base_options(method, ratio)

    backend.options = options
    data_dir = resolve_data_dir(None)
    docs, doc_tokens = (int(x) for x in os.environ.get("STUDY_SHAPE", "8x512").split("x"))  # ~4k by default
    cfg = tasks.TaskConfig(n=n, docs=docs, doc_tokens=doc_tokens, seed=seed)
    hay = tasks.Haystack(backend.tokenizer, data_dir)
    examples = {t: tasks.build_examples(t, backend.tokenizer, data_dir, cfg, hay) for t in task_names}
    shuffle = os.environ.get("STUDY_SHUFFLE", "0") == "1"
    if shuffle:
        examples = {t: [_shuffled(ex, seed, backend) for ex in exs] for t, exs in examples.items()}
    shard, shards = (int(x) for x in os.environ.get("STUDY_SHARD", "0/1").split("/"))
    command = (f"STUDY_SHAPE={docs}x{doc_tokens} STUDY_SHUFFLE={int(shuffle)} "
               + (f"STUDY_SHARD={shard}/{shards} " if shards > 1 else "")
               + "python studies/context_modes.py " + " ".join(shlex.quote(a) for a in argv))
    outs: dict[str, list] = {"none": [], mode: []}
    ingest = {m: {"mode": m, "chunk_tokens": 0, "context_tokens": 0, "precompute_s": 0.0, "embed_s": 0.0}
              for m in outs}
    plans = {"none": methods, mode: methods + ([NO_ANCHORS] if "anchor" in methods else [])}

    def save() -> None:
        for m, done in outs.items():
            ing = dict(ingest[m])
            secs = ing["precompute_s"] + ing["embed_s"]
            ing["chunk_tokens_per_s"] = ing["chunk_tokens"] / secs if secs else None
            payload = {"kind": "fidelity", "command": command, "params": {
                "tasks": task_names, "n": n, "seed": seed, "ratio": RATIO, "methods": plans[m],
                "precompute_context": {**{k: v for k, v in settings.store.model_dump().items()
                                          if k.startswith("precompute_")}, "precompute_context": m},
                "system_prompt": settings.model.system_prompt, "fusion": settings.fusion.model_dump()},
                "rows": report.sort_fidelity(aggregate(done)), "outcomes": outcome_dicts(done), "ingest": ing}
            Path(f"{prefix}-{m}.json").write_text(json.dumps(payload, indent=1))

    for i in range(shard, n, shards):
        for task in task_names:
            ex = examples[task][i]
            t0 = time.perf_counter()
            ref = None
            for m in outs:
                backend.context_mode = m
                before = dict(backend.ingest)
                prepared = backend.prepare(ex)
                for k in ("chunk_tokens", "context_tokens", "precompute_s", "embed_s"):
                    ingest[m][k] += backend.ingest[k] - before[k]
                if ref is None:
                    van = backend.run(ex, prepared, "vanilla", 1.0)
                    ref, van.reference = van.reference, None
                    van_out = van
                outs[m].append(dataclasses.replace(van_out))
                for method in plans[m]:
                    out = backend.run(ex, prepared, method, RATIO, reference=ref)
                    outs[m].append(out)
                    print(f"{ex.id} {m} {method}: score {out.score:.2f} same {out.prediction == ref.prediction} "
                          f"answer KL {out.answer_kl_vs_vanilla:.4f} ({out.prediction[:40]!r})", flush=True)
            save()
            print(f"{ex.id} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def _shuffled(ex: tasks.Example, seed: int, backend: EngineBackend) -> tasks.Example:
    """The example with its chunks in a shuffled prompt order; `document` contexts keep the document's
    order (the backend's `contexts` is wrapped once to map them)."""
    n = len(ex.chunks)
    perm = list(range(n))
    rng = random.Random(f"{seed}/{ex.id}")
    while n > 1 and perm == sorted(perm):
        rng.shuffle(perm)
    out = dataclasses.replace(ex, id=ex.id + "-shuffled", chunks=[ex.chunks[p] for p in perm],
                              fact_chunks=[perm.index(f) for f in ex.fact_chunks])
    perms = backend.__dict__.setdefault("_study_perms", {})
    perms[out.id] = perm
    if "_study_contexts" not in backend.__dict__:
        plain = backend.contexts

        def contexts(example, prefix_ids, chunk_ids):
            p = perms.get(example.id)
            if p is None:
                return plain(example, prefix_ids, chunk_ids)
            order = sorted(range(len(p)), key=lambda j: p[j])  # prompt slot of each document position
            ctx = plain(dataclasses.replace(example, chunks=[example.chunks[j] for j in order]), prefix_ids,
                        [chunk_ids[j] for j in order])
            return [ctx[p[j]] for j in range(len(p))]

        backend.contexts = contexts
        backend.__dict__["_study_contexts"] = True
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
