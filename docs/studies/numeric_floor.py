"""Study: how far do numerics alone move vanilla's answers? The floor under any fidelity target.

Vanilla (full prefill, fp32) is run again with its KV cache rounded to a narrower type as it is written:
fp16, and fp8 e4m3 (scale 1, as a serving stack's fp8 KV cache does by default). Nothing about the
prompt or the model changes: whatever answers move, they move for numerical reasons only. The same
examples as `kvfuse bench fidelity` (same task generator, seed and sizes), scored and compared with
vanilla by the benchmark's own aggregation (score / vanilla with its paired bootstrap interval, examples
above / below vanilla, same answer, first-token KL).

Usage: python docs/studies/numeric_floor.py TASKS N [SEED] [DOCS] [DOC_TOKENS] [JSON]
"""

import json
import sys
from pathlib import Path

import torch

from kvfuse.bench import report
from kvfuse.bench.fidelity import EngineBackend, Outcome, aggregate, kl_divergence, outcome_dicts
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import get_settings
from kvfuse.fusion import transformer

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
KV_TYPES = {"vanilla fp16 KV": torch.float16, "vanilla fp8 KV": torch.float8_e4m3fn}
STATE: dict = {"dtype": None}
_write_kv = transformer.Transformer.write_kv


def rounded_write_kv(cache, layer, rows, k, v):
    """Write K/V as a cache of STATE["dtype"] would hold them (rounded, read back in the compute type)."""
    dtype = STATE["dtype"]
    if dtype is not None:
        k, v = k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype)
    return _write_kv(cache, layer, rows, k, v)


transformer.Transformer.write_kv = staticmethod(rounded_write_kv)

tasks, n = sys.argv[1].split(","), int(sys.argv[2])
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
docs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
doc_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 512
out_json = Path(sys.argv[6]) if len(sys.argv) > 6 else None
be = EngineBackend(get_settings(), max_tokens=None)
cfg = TaskConfig(n=n, docs=docs, doc_tokens=doc_tokens, seed=seed)
hay = Haystack(be.tokenizer, DATA)
outcomes: list[Outcome] = []
for task in tasks:
    for ex in build_examples(task, be.tokenizer, DATA, cfg, hay):
        prefix, chunks, q = be.prepare(ex)
        ref = None
        for name, dtype in (("vanilla", None), *KV_TYPES.items()):
            STATE["dtype"] = dtype
            try:
                text, logits, ttft, stats = be.greedy(prefix, chunks, q, be.options("vanilla", None), ex.max_tokens)
            finally:
                STATE["dtype"] = None
            ref = logits if ref is None else ref
            outcomes.append(Outcome(task=task, example_id=ex.id, method=name, ratio=1.0, prediction=text.strip(),
                                    score=score_answer(ex.metric, text, ex.answers), ttft_s=ttft,
                                    context_tokens=int(stats["context_tokens"]),
                                    recomputed_tokens=int(stats["recomputed_tokens"]),
                                    kl_vs_vanilla=kl_divergence(ref, logits)))
        print(ex.id, [(o.method, round(o.score, 3), round(o.kl_vs_vanilla, 5)) for o in outcomes[-3:]], flush=True)
rows = report.sort_fidelity(aggregate(outcomes))
print(report.fidelity_against_vanilla(rows))
print(report.markdown_table(rows, [c for c in report.FIDELITY_TABLE if c[0] not in ("ratio", "ttft_vs_vanilla")]))
if out_json is not None:
    out_json.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows, "outcomes": outcome_dicts(outcomes)},
                                   indent=1) + "\n", encoding="utf-8")
