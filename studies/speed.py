"""Study: quick TTFT check of the fused prefill against vanilla, with each method's arithmetic floor
(the full benchmark is `kvfuse bench speed`).

    python studies/speed.py --essays ../shared/data/paul_graham_essays --contexts 8,16 --ratio 0.15 --threads 1

Chunks are 512-token pieces of the Paul Graham essays; stored KV is cast to `--kv-dtype` first, as the
store keeps it. Each measurement is the minimum over `--repeats` runs, methods interleaved with vanilla.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from kvfuse.fusion import ChunkKV, FusionEngine, FusionOptions
from kvfuse.fusion.methods.anchor import Anchor, layer_window
from kvfuse.fusion.model.loading import torch_dtype


def probe_layers(method: str, num_layers: int) -> int:
    """Layers the method's question-only probe runs (0: none): prophetkv all, anchor up to its window's end."""
    if method == "prophetkv":
        return num_layers
    if method == "anchor":
        return layer_window(num_layers, *Anchor.window).stop
    return 0


def work_share(engine: FusionEngine, stats: dict, selected: torch.Tensor, method: str) -> float:
    """The method's arithmetic floor: multiply-adds of the rows it must run through the layers it must
    run them through, as a share of vanilla's (per row and layer: projections + MLP, plus attention
    over the keys up to the row's position; a question-only probe adds the question rows through the
    layers it runs)."""
    cfg = engine.model.config
    hd = engine.num_kv_heads * engine.head_dim
    qd = cfg.num_attention_heads * engine.head_dim
    linear = 2 * cfg.hidden_size * (qd + hd) + 3 * cfg.hidden_size * cfg.intermediate_size

    def cost(positions: torch.Tensor) -> float:
        return float(positions.numel() * linear + 2 * qd * (positions.double() + 1).sum())

    p, n, q = stats["prefix_tokens"], stats["context_tokens"], stats["question_tokens"]
    total, layers, full = p + n + q, engine.num_layers, stats["full_layers"]
    everything = torch.arange(total)
    question = torch.arange(p + n, total)
    rows = torch.cat([selected.cpu(), question])
    work = full * cost(everything[p:]) + (layers - full) * cost(rows) if full < layers else layers * cost(everything)
    work += probe_layers(method, layers) * cost(question)
    return work / (layers * cost(everything))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--contexts", default="8,16", help="chunk counts, comma-separated")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--methods", default="a3,cacheblend,prophetkv,anchor,epic,pie")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--kv-dtype", default="float16")
    ap.add_argument("--essays", required=True, help="folder of the Paul Graham essays (text files)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from kvfuse.config import get_settings
    from kvfuse.model_files import resolve_llm

    settings = get_settings()
    engine = FusionEngine.from_settings(settings, threads=args.threads) if args.model == "default" else \
        FusionEngine.load(resolve_llm(args.model, settings.models_dir), threads=args.threads)
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(Path(args.essays).iterdir()))
    ids = engine.tokenize(text[:2_000_000])
    prefix_ids, question_ids = engine.prompt_parts("What does the author say about startups and money?",
                                                   "Answer the question using the documents.")
    kv_dtype = torch_dtype(args.kv_dtype)
    results = []
    for count in (int(c) for c in args.contexts.split(",")):
        # as many tokens per chunk as fit the model's context, up to --chunk-tokens
        size = min(args.chunk_tokens,
                   (engine.max_context_tokens - len(prefix_ids) - len(question_ids)) // count)
        pieces = [ids[i * size : (i + 1) * size] for i in range(count)]
        kvs = [ChunkKV(kv.token_ids, kv.k.to(kv_dtype), kv.v.to(kv_dtype))
               for kv in engine.precompute([prefix_ids, *pieces])]
        prefix, chunks = kvs[0], kvs[1:]
        n = count * size

        def ttft(method: str, prefix=prefix, chunks=chunks) -> tuple[float, float, dict, dict]:
            t, c = time.perf_counter(), time.process_time()
            fused = engine.fuse(prefix, chunks, question_ids, FusionOptions(method=method,
                                                                            recompute_ratio=args.ratio))
            int(torch.argmax(fused.logits))
            stats = dict(fused.stats, floor=work_share(engine, fused.stats, fused.selected, method))
            return time.perf_counter() - t, time.process_time() - c, fused.timings, stats

        best: dict[str, tuple[float, dict, dict]] = {}
        cpu: dict[str, float] = {}
        methods = ["vanilla", *args.methods.split(",")]
        for _ in range(args.repeats):
            for m in methods:
                s, c, timings, stats = ttft(m)
                cpu[m] = min(cpu.get(m, c), c)
                if m not in best or s < best[m][0]:
                    best[m] = (s, timings, stats)
        with torch.inference_mode():
            t = time.perf_counter()
            engine.model(torch.tensor([prefix_ids + [x for p in pieces for x in p] + question_ids]),
                         logits_to_keep=1)
            hf = time.perf_counter() - t
        v = best["vanilla"][0]
        for m in methods:
            floor = best[m][2]["floor"]
            row = {"context_tokens": n, "method": m, "ttft_s": round(best[m][0], 3),
                   "ratio": round(best[m][0] / v, 3), "floor": round(floor, 3),
                   "vs_floor": round(best[m][0] / v / floor, 2), "cpu_s": round(cpu[m], 3),
                   "cpu_ratio": round(cpu[m] / cpu["vanilla"], 3),
                   "cpu_vs_floor": round(cpu[m] / cpu["vanilla"] / floor, 2),
                   **{k: round(x, 3) for k, x in best[m][1].items()}}
            results.append(row)
            print(json.dumps(row), flush=True)
        print(json.dumps({"context_tokens": n, "hf_forward_s": round(hf, 3)}), flush=True)
    print(json.dumps({"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
