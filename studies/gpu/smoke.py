"""Every fusion method once on CUDA, and the recompute-everything identity, before a long GPU run.

    python studies/gpu/smoke.py [TASK] [SHAPE]

With the model of `KVFUSE_MODEL__LLM` on `KVFUSE_MODEL__DEVICE` (a random-weight copy of the default
model does for this: the code paths and shapes are the same), one example of TASK (default needle) at
SHAPE chunks x tokens (default 8x512): each method at r = 0.15 with chunks cached alone and after their
document's text; a failure is printed with its traceback and the run goes on. Then the identity every
selective method must keep: at r = 1 its first-token logits equal vanilla's (max |diff| printed). Last,
the seconds one example of the decision run takes (context_modes.py's plan), to size the run.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from kvfuse.bench import tasks
from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import FIXED_RATIO
from kvfuse.config import get_settings
from kvfuse.fusion import available_methods

SELECTIVE = ("anchor", "cacheblend", "a3", "prophetkv")


def main(argv: list[str]) -> int:
    task = argv[0] if argv else "needle"
    docs, doc_tokens = (int(x) for x in (argv[1] if len(argv) > 1 else "8x512").split("x"))
    settings = get_settings()
    backend = EngineBackend(settings, max_tokens=None)
    print("device", backend.engine.device, torch.cuda.get_device_name() if torch.cuda.is_available() else "",
          "dtype", backend.engine.dtype, flush=True)
    data_dir = resolve_data_dir(None)
    cfg = tasks.TaskConfig(n=1, docs=docs, doc_tokens=doc_tokens, seed=99)
    ex = tasks.build_examples(task, backend.tokenizer, data_dir, cfg, tasks.Haystack(backend.tokenizer, data_dir))[0]
    failures = 0
    for mode in ("none", "document"):
        backend.context_mode = mode
        t = time.perf_counter()
        prepared = backend.prepare(ex)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        print(f"[{mode}] prepare {time.perf_counter() - t:.2f} s", flush=True)
        ref = backend.run(ex, prepared, "vanilla", 1.0)
        for method in available_methods():
            if method == "vanilla":
                continue
            t = time.perf_counter()
            try:
                ratio = FIXED_RATIO[method] if method in FIXED_RATIO else 0.15
                out = backend.run(ex, prepared, method, ratio, reference=ref.reference)
                print(f"[{mode}] {method:10s} ok {time.perf_counter() - t:6.2f} s  answer KL "
                      f"{out.answer_kl_vs_vanilla}  recomputed {out.recomputed_tokens}", flush=True)
            except Exception:
                failures += 1
                print(f"[{mode}] {method:10s} FAILED", flush=True)
                traceback.print_exc()
    backend.context_mode = "none"
    prepared = backend.prepare(ex)
    prefix, chunks, question_ids = prepared
    van = backend.engine.fuse(prefix, chunks, question_ids, backend.options("vanilla", 1.0), max_tokens=4)
    for method in SELECTIVE:
        try:
            fused = backend.engine.fuse(prefix, chunks, question_ids, backend.options(method, 1.0), max_tokens=4)
            diff = float((fused.logits.float() - van.logits.float()).abs().max())
            scale = float(van.logits.float().abs().max())
            print(f"r = 1: {method:10s} max |logits - vanilla| {diff:.2e} (max |logit| {scale:.1f})", flush=True)
            failures += diff > 1e-3 * max(scale, 1.0)
        except Exception:
            failures += 1
            print(f"r = 1: {method} FAILED", flush=True)
            traceback.print_exc()
    # one example of the decision run's plan: both precomputes, vanilla, 4 methods x 2 modes + 1
    t = time.perf_counter()
    for mode in ("none", "document"):
        backend.context_mode = mode
        prepared = backend.prepare(ex)
        ref = backend.run(ex, prepared, "vanilla", 1.0)
        for method in SELECTIVE + (("anchor",) if mode != "none" else ()):
            backend.run(ex, prepared, method, 0.15, reference=ref.reference)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    print(f"one decision-run example ({task}, {docs}x{doc_tokens}): {time.perf_counter() - t:.2f} s", flush=True)
    print("FAILURES", failures, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
