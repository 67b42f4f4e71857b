"""Study: chunk KV computed alone vs after the shared system prefix, for each selective method.

Usage: python studies/chunk_prefix.py N TASKS [SEED]   e.g. 4 needle,multikey,multivalue,musique,vartrack 0
Run from the repository root with the project's environment; the data directory defaults to
the evaluation data (setting bench.data_dir). Prints, per task, each variant's mean score, median and mean
first-token KL to vanilla (nats) and how many answers equal vanilla's, on the fidelity benchmark's own
examples (8 chunks x 512 tokens, r = 0.15, greedy, the configured system prompt).
"""

import dataclasses
import statistics
import sys
import time

import torch

from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import kl_divergence
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import load_settings
from kvfuse.fusion.types import ChunkKV

DATA = resolve_data_dir()  # the setting bench.data_dir (KVFUSE_BENCH__DATA_DIR)

n, tasks = int(sys.argv[1]), sys.argv[2].split(",")
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
be = EngineBackend(load_settings(model={"threads": 2}), max_tokens=None)
eng = be.engine
hay = Haystack(eng.tokenizer, DATA)

@torch.inference_mode()
def precompute_after(prefix_ids, chunks):
    """Each chunk run after the prefix; its K/V kept and its keys turned back to positions 0..n-1."""
    out = []
    P = len(prefix_ids)
    for c in chunks:
        ids = torch.tensor([prefix_ids + c])
        cache = eng.model.model(input_ids=ids, use_cache=True).past_key_values
        k = torch.stack([layer.keys[0, :, P:] for layer in cache.layers]).clone()
        v = torch.stack([layer.values[0, :, P:] for layer in cache.layers]).clone()
        eng.rope.shift_keys_(k, -P)
        out.append(ChunkKV(list(c), k, v))
    return out

# (label, method, anchor_tokens override or None for the configured default)
variants = [("anchor16", "anchor", 16), ("anchor0", "anchor", 0), ("anchor4", "anchor", 4),
            ("cacheblend", "cacheblend", None), ("prophetkv", "prophetkv", None), ("a3", "a3", None)]
res = {}
for task in tasks:
    exs = build_examples(task, eng.tokenizer, DATA, TaskConfig(n=n, docs=8, doc_tokens=512, seed=seed), hay)
    for ex in exs:
        t0 = time.time()
        prefix, alone, q = be.prepare(ex)
        after = precompute_after(prefix.token_ids, [c.token_ids for c in alone])
        budget = ex.max_tokens
        ans = be.greedy(prefix, alone, q, be.options("vanilla", None), budget)
        vt, vlog = ans.text, ans.first_logits
        vs = score_answer(ex.metric, vt, ex.answers)
        res.setdefault((task, "vanilla", "-"), []).append((vs, 0.0, True))
        for cname, ch in (("alone", alone), ("after", after)):
            for vname, m, a in variants:
                opts = be.options(m, 0.15)
                if a is not None:
                    opts = dataclasses.replace(opts, anchor_tokens=a)
                ans = be.greedy(prefix, ch, q, opts, budget)
                t, lg = ans.text, ans.first_logits
                res.setdefault((task, vname, cname), []).append((score_answer(ex.metric, t, ex.answers), kl_divergence(vlog, lg), t.strip() == vt.strip()))
            ans = be.greedy(prefix, ch, q, be.options("pie", None), budget)
            t, lg = ans.text, ans.first_logits
            res.setdefault((task, "pie", cname), []).append((score_answer(ex.metric, t, ex.answers), kl_divergence(vlog, lg), t.strip() == vt.strip()))
        print(f"{task} {ex.id} {time.time()-t0:.0f}s", flush=True)
    for key in sorted(k for k in res if k[0] == task):
        r = res[key]
        print(f"  {key[1]:12s} {key[2]:6s} score {statistics.mean(x[0] for x in r):.3f}  KL med {statistics.median(x[1] for x in r):.4f} mean {statistics.mean(x[1] for x in r):.4f}  same {sum(x[2] for x in r)}/{len(r)}", flush=True)
