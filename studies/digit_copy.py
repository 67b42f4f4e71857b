"""Study: why fused answers stop after the first digits of a magic number ("15." for "1541022.").

Most of the needle and multikey misses of every fused method are the same failure: the answer starts
the right number and ends it after one or two digits. For each given example this runs vanilla, then
each variant, and at the step where a variant leaves vanilla's answer it prints the probability of
vanilla's token and of the token it chose. Variants: `anchor` with stale scaling at -0.5 and
without it, `anchor` with the fact's tokens forced into its set (with and without scaling), `prophetkv`.

Usage: python studies/digit_copy.py TASK IDS [SEED] [DOCS] [DOC_TOKENS]
  IDS: comma-separated example indices of the benchmark's TASK examples for SEED.

Needs kvfuse at commit 163ffce: `fusion.stale_logit_bias`, which its variants set, was removed after it.
"""

import sys

import torch
from study_tools import DATA, FACT, fact_mask

from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import kl_divergence
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import get_settings


def trace(be, prefix, chunks, q, opts, max_tokens):
    """Greedy tokens and, per step, the softmax over the vocabulary."""
    eng = be.engine
    fused = eng.fuse(prefix, chunks, q, opts, max_tokens=max_tokens)
    logits = fused.logits
    first = logits.detach().float().clone()
    toks, probs = [], []
    while True:
        p = torch.softmax(logits.float(), -1)
        tok = int(torch.argmax(p))
        toks.append(tok)
        probs.append(p)
        if tok in eng.stop_token_ids or len(toks) >= max_tokens:
            break
        logits = eng.decode_step(fused.cache, tok)
    return toks, probs, first, fused


# Scaling named explicitly: its default changed (-0.5 when this study was run, 0 since).
VARIANTS = [("anchor", {"stale_logit_bias": -0.5}), ("anchor", {"stale_logit_bias": 0.0}),
            ("anchor_fact", {"stale_logit_bias": -0.5}), ("anchor_fact", {"stale_logit_bias": 0.0}),
            ("prophetkv", {})]

task, ids = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
docs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
doc_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 512
be = EngineBackend(get_settings(), max_tokens=None)
tok = be.tokenizer
examples = build_examples(task, tok, DATA, TaskConfig(n=max(ids) + 1, docs=docs, doc_tokens=doc_tokens, seed=seed),
                          Haystack(tok, DATA))
for i in ids:
    ex = examples[i]
    prefix, chunks, q = be.prepare(ex)
    FACT["mask"] = fact_mask(tok, ex.chunks, ex.facts)
    vt, _, vfirst, _ = trace(be, prefix, chunks, q, be.options("vanilla", None), ex.max_tokens)
    vtext = tok.decode(vt, skip_special_tokens=True)
    print(f"\n{ex.id}: vanilla {vtext!r} score {score_answer(ex.metric, vtext, ex.answers)}", flush=True)
    for name, extra in VARIANTS:
        opts = be.options(name, 0.15)
        for k, v in extra.items():
            setattr(opts, k, v)
        mt, mp, mfirst, fused = trace(be, prefix, chunks, q, opts, ex.max_tokens)
        text = tok.decode(mt, skip_special_tokens=True)
        picked = torch.zeros_like(FACT["mask"])
        picked[fused.selected - len(prefix)] = True
        recall = float((picked & FACT["mask"]).sum() / FACT["mask"].sum())
        where = next((s for s, (a, b) in enumerate(zip(vt, mt, strict=False)) if a != b), None)
        detail = ""
        if where is not None:
            p = mp[where]
            detail = (f" | step {where}: vanilla's {tok.decode([vt[where]])!r} p={float(p[vt[where]]):.3f}, "
                      f"chosen {tok.decode([mt[where]])!r} p={float(p[mt[where]]):.3f}")
        label = name + "".join(f" {k}={v}" for k, v in extra.items())
        print(f"  {label:36s} {text[:24]!r:28s} score {score_answer(ex.metric, text, ex.answers):.2f} "
              f"KL {kl_divergence(vfirst, mfirst):.4f} fact recall {recall:.2f}{detail}", flush=True)
