"""Study: how far do numerics alone move vanilla's answers? The floor under any fidelity target.

Vanilla (full prefill, fp32) is run again with its KV cache rounded to a narrower type as it is written:
fp16, and fp8 e4m3 (scale 1, as a serving stack's fp8 KV cache does by default). Nothing about the
prompt or the model changes: whatever answers move, they move for numerical reasons only. The same
examples as `kvfuse bench fidelity` (same task generator, seed and sizes), scored and compared with
vanilla by the benchmark's own aggregation (score / vanilla with its paired bootstrap interval, examples
above / below vanilla, same answer, first-token KL).

Usage: python studies/numeric_floor.py TASKS N [SEED] [DOCS] [DOC_TOKENS] [JSON]
"""

import torch
from study_tools import DATA, outcome, report_outcomes, task_args

from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import Outcome
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import get_settings
from kvfuse.fusion.engine.fused_cache import FusedCache

KV_TYPES = {"vanilla fp16 KV": torch.float16, "vanilla fp8 KV": torch.float8_e4m3fn}
STATE: dict = {"dtype": None}
_write = FusedCache.write


def rounded_write(cache, layer, positions, k, v):
    """Write K/V as a cache of STATE["dtype"] would hold them (rounded, read back in the compute type)."""
    dtype = STATE["dtype"]
    if dtype is not None:
        k, v = k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype)
    return _write(cache, layer, positions, k, v)


FusedCache.write = rounded_write  # every K/V write of the engine (prefill and decode) goes through it

tasks, n, seed, docs, doc_tokens, out_json = task_args()
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
                result = be.greedy(prefix, chunks, q, be.options("vanilla", None), ex.max_tokens)
            finally:
                STATE["dtype"] = None
            ref = result.first_logits if ref is None else ref
            outcomes.append(outcome(ex, name, 1.0, result, ref))
        print(ex.id, [(o.method, round(o.score, 3), round(o.kl_vs_vanilla, 5)) for o in outcomes[-3:]], flush=True)
report_outcomes(outcomes, out_json)
