"""Does anchor's probe lose the needle on Gemma 3 because most of its layers slide? (docs/results/fidelity-gemma3)

    python studies/anchor_sliding.py MODEL N [DOC_TOKENS]

Gemma 3 270M has 18 layers, five of every six sliding (window 512); anchor's probe window (layers 4-14)
holds nine sliding layers and two global ones. A sliding layer's question rows see only the last 512 keys,
and `evidence_scores` renormalises each (layer, head) over the context, so each sliding head puts a whole
vote on the last 512 tokens wherever the fact is. Per needle example (multidoc, seed 43, best last, chunks
cached alone: the run of docs/results/fidelity-gemma3), this prints how many tokens follow the fact's
document, whether the fact's value tokens are recomputed by anchor as it is and by anchor voting with the
global layers alone (the sliding layers' rows zeroed before the vote), and the greedy answer of each (vanilla's: the run's JSON).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvfuse.bench import multidoc, tasks
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.config import get_settings
from kvfuse.fusion.methods import selection


def main(argv: list[str]) -> int:
    model, n = argv[0], int(argv[1])
    doc_tokens = int(argv[2]) if len(argv) > 2 else 256
    s = get_settings()
    s = s.model_copy(update={"model": s.model.model_copy(update={"llm": model}),
                             "store": s.store.model_copy(update={"precompute_context": "none"})})
    backend = EngineBackend(s, max_tokens=12)
    eng, tf = backend.engine, backend.engine.tf
    corpus = multidoc.Corpus(eng.tokenizer, Path("../shared/data"), doc_tokens)
    cfg = tasks.TaskConfig(n=n, docs=8, doc_tokens=doc_tokens, seed=43)
    examples = multidoc.build_examples("needle", corpus, cfg, "best-last", backend.embedder().embed)
    original = selection.SelectionContext.question_probe
    sliding = [w is not None for w in tf.windows]

    def global_only(self, layers):
        probe = original(self, layers).clone()
        for i, layer in enumerate(layers):
            if sliding[layer]:
                probe[i] = 0.0  # no vote (evidence_scores leaves an all-zero row at zero)
        return probe

    print("| example | tokens after the fact's document | anchor: value recomputed | answer | global layers only: "
          "value recomputed | answer |")
    print("|---|---|---|---|---|---|")
    for ex in examples:
        prefix, chunks, question = backend.prepare(ex)
        f = ex.fact_chunks[0]
        value = ex.answers[0]
        ids = [t for c in chunks for t in c.token_ids]
        start = sum(len(c.token_ids) for c in chunks[:f])
        text_ids = chunks[f].token_ids
        enc = eng.tokenizer(ex.chunks[f], add_special_tokens=False, return_offsets_mapping=True)
        assert list(enc["input_ids"]) == list(text_ids)
        at = ex.chunks[f].index(value)
        pos = [start + i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < at + len(value) and b > at]
        after = len(ids) - start - len(text_ids)
        row = [ex.id, str(after)]
        for patched in (False, True):
            selection.SelectionContext.question_probe = global_only if patched else original
            try:
                ans = backend.greedy(prefix, chunks, question, backend.options("anchor", 0.15), 12)
            finally:
                selection.SelectionContext.question_probe = original
            chosen = set((ans.fused.selected - len(prefix.token_ids)).tolist())
            row += [f"{sum(p in chosen for p in pos)}/{len(pos)}", repr(ans.text.strip()[:20])]
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
