"""Where each method's recomputed rows sit in the sequence, and what that does to the attention work.

    python studies/selection_positions.py [CONTEXTS] [METHODS]    (defaults: 2048,4096 anchor,cacheblend)

The same needle example as `kvfuse bench speed` (seed 0, 512-token chunks), the chunks prepared in the
configured `store.precompute_context`. For each method at r = 0.15: the recomputed context rows, their mean
position as a share of the context, how many fall in each chunk, and the keys the recompute attends per layer and head: a row at
position p reads p + 1 keys, the question rows included. The selective pass's attention grows with that
sum while its matmuls grow only with the row count, so two methods at the same ratio can differ in TTFT by
where they select. Read beside docs/results/fidelity-context/ttft/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.tasks import Haystack, TaskConfig, synthetic
from kvfuse.config import Settings
from kvfuse.fusion.engine import solo
from kvfuse.fusion.methods import registry


def main() -> None:
    contexts = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "2048,4096").split(",")]
    methods = (sys.argv[2] if len(sys.argv) > 2 else "anchor,cacheblend").split(",")
    settings = Settings()
    backend = EngineBackend(settings, max_tokens=1)
    hay = Haystack(backend.tokenizer, Path(settings.bench.data_dir))
    seen: list = []
    for method in methods:  # record each selection as the engine asks for it
        cls = registry()[method]
        cls.select = recording(cls.select, seen)
    print(f"precompute_context = {settings.store.precompute_context}\n")
    print("| context tokens | method | recomputed context rows | mean position / context "
          "| keys attended per layer and head (M) | rows per chunk (chunks cached alone marked *) |")
    print("|---|---|---|---|---|---|")
    for ctx_tokens in contexts:
        ex = synthetic("needle", hay, TaskConfig(n=1, docs=max(1, round(ctx_tokens / 512)), doc_tokens=512, seed=0), 0)
        prefix, chunks, question = backend.prepare(ex)
        for method in methods:
            seen.clear()
            for _ in solo.generate(backend.engine, prefix, chunks, question, backend.options(method, 0.15), backend.gen):
                break
            layout, chosen, alone = seen[-1]
            chosen = chosen.cpu()
            ends = torch.tensor(layout.chunk_lens).cumsum(0)
            per_chunk = ", ".join(f"{int(((chosen >= e - n) & (chosen < e)).sum())}{'*' if a else ''}"
                                  for e, n, a in zip(ends.tolist(), layout.chunk_lens, alone, strict=True))
            rows = (chosen + layout.context_start).tolist() + list(range(layout.question_start, layout.total))
            share = chosen.float().mean().item() / max(1, layout.context_len)
            keys = sum(p + 1 for p in rows) / 1e6
            print(f"| {layout.context_len} | {method} | {chosen.numel()} | {share:.2f} | {keys:.2f} | {per_chunk} |")


def recording(select, seen: list):
    def wrapped(self, ctx):
        chosen = select(self, ctx)
        seen.append((ctx.layout, chosen, ctx.alone))
        return chosen
    return wrapped


if __name__ == "__main__":
    main()
