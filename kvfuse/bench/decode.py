"""`kvfuse bench decode`: the decode step against the weight-read bound of this machine, per path.

The bound: one decode step of one stream must read every weight once, so it cannot take less than
copying the weights' bytes (`weight_bytes`, tied embeddings counted once) at the machine's memcpy rate,
measured in the same run (a weight-sized float32 buffer copied, median of five). Each row is a ratio to
that bound and to the same path's one-stream tokens/s, so the figures hold on a busy machine as ratios.

Paths, timed in turn within every repeat so that drift hits them alike; each is `EngineCore.step` over
streams in one KV memory, an extent each (kvfuse/bench/streams.py): the runner's batched forward, the
tokens chosen on the device for the batch (`sampling.choose`) with one host copy, the non-finite check
and each row's detokenizer, as the worker decodes:
- `eager`: one attention call per stream over its own extent (the default off CUDA);
- `static` (`--compile`): the static path, FlexAttention over the memory with a block mask per row,
  compiled per batch bucket (on CUDA also captured as graphs); its compile is the runner's warm-up;
- `eager+schema` (`--schema`): the eager path with every row under a JSON schema's grammar (a
  `response_format` answer: `SCHEMA`, a string field the answer stays in, so the grammar never ends within
  the steps), its mask computed and applied per row and its matcher advanced, as the worker does
  (kvfuse/fusion/engine/grammar.py); its ratio to `eager` at the same batch is the grammar's cost.

The cache of every stream is one real prefill (vanilla) of `--context-tokens` seeded random tokens,
copied. docs/results/decode/README.md.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

WARMUP_STEPS = 2
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters, each stored tensor once (tied embeddings are one tensor)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """GB/s of copying an `nbytes` float32 buffer into another (median of `repeats`)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _prefill(engine: Any, tokens: int, room: int, seed: int) -> Any:
    import torch

    from kvfuse.fusion import FusionOptions

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, engine.model.config.vocab_size - 100, (tokens,), generator=gen).tolist()
    return engine.fuse(None, [], ids, FusionOptions(method="vanilla"), max_tokens=room)


def _time_path(engine: Any, fused: Any, path: str, streams: int, steps: int) -> list[float]:
    """Seconds per step of `steps` steps of `streams` copies of `fused` on an engine core (after the
    warm-up steps)."""
    from kvfuse.bench.streams import core_streams, time_steps

    grammar = None
    if path == "eager+schema":
        from kvfuse.fusion.engine.grammar import json_grammar

        grammar = json_grammar(SCHEMA)
    core = core_streams(engine, fused, streams, static=path == "static", grammar=grammar)
    return time_steps(core, steps, warmup=WARMUP_STEPS)


def run(args: Any) -> dict:
    from kvfuse.bench.machine import load_info, machine_info
    from kvfuse.config import get_settings
    from kvfuse.fusion import FusionEngine

    settings = get_settings()
    engine = FusionEngine.from_settings(settings)
    nbytes = weight_bytes(engine.model)
    room = (WARMUP_STEPS + args.steps) + 8
    fused = _prefill(engine, args.context_tokens, room, args.seed)
    paths = ["eager"] + (["static"] if args.compile else []) + (["eager+schema"] if args.schema else [])
    times: dict[tuple[str, int], list[float]] = {}
    rates = []
    for _ in range(args.repeats):
        rates.append(memcpy_gbps(nbytes))
        for streams in args.streams:
            for path in paths:
                times.setdefault((path, streams), []).extend(_time_path(engine, fused, path, streams, args.steps))
    rate = statistics.median(rates)
    bound_ms = nbytes / (rate * 1e9) * 1e3
    rows = []
    for (path, streams), ts in times.items():
        step_ms = statistics.median(ts) * 1e3
        rows.append({"path": path, "streams": streams, "step_ms": round(step_ms, 2),
                     "tok_s": round(streams / step_ms * 1e3, 2), "step_vs_bound": round(step_ms / bound_ms, 3)})
    for row in rows:
        one = next((r for r in rows if r["path"] == row["path"] and r["streams"] == 1), None)
        row["tok_s_vs_one_stream"] = round(row["tok_s"] / one["tok_s"], 3) if one else None
        plain = next((r for r in rows if r["path"] == "eager" and r["streams"] == row["streams"]), None)
        row["tok_s_vs_eager"] = round(row["tok_s"] / plain["tok_s"], 3) if plain else None
    return {"params": {"context_tokens": args.context_tokens, "streams": args.streams, "steps": args.steps,
                       "repeats": args.repeats, "compile": args.compile,
                       "schema": args.schema, "seed": args.seed,
                       "model": settings.model.llm, "dtype": settings.model.dtype},
            "machine": machine_info(), "load_at_end": load_info(), "weight_bytes": nbytes,
            "memcpy_gbps": round(rate, 2), "memcpy_gbps_runs": [round(r, 2) for r in rates],
            "weight_read_bound_ms": round(bound_ms, 2), "rows": rows}


def table(result: dict) -> str:
    lines = [f"weights {result['weight_bytes'] / 1e6:.0f} MB, memcpy {result['memcpy_gbps']} GB/s -> weight-read "
             f"bound {result['weight_read_bound_ms']} ms/step",
             "| path | streams | step ms | tokens/s | step / bound | tokens/s vs 1 stream | tokens/s vs eager |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['path']} | {r['streams']} | {r['step_ms']} | {r['tok_s']} | {r['step_vs_bound']} | "
                     f"{r['tok_s_vs_one_stream']} | {r.get('tok_s_vs_eager')} |")
    return "\n".join(lines)


def command(args: Any) -> int:
    from kvfuse.bench.machine import command_line

    result = run(args)
    result["command"] = command_line("kvfuse bench decode", args.parser, args)
    text = table(result)
    print(text)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(f"    {result['command']}\n\n{text}\n")
    return 0


def register(bsub: Any) -> None:
    """Add `kvfuse bench decode` (imports nothing heavy)."""
    from kvfuse.bench.args import csv_list

    p = bsub.add_parser("decode", help="decode step per path vs the weight-read bound and vs one stream")
    p.add_argument("--context-tokens", type=int, default=1024, help="tokens in every stream's cache")
    p.add_argument("--streams", type=csv_list(int), default=[1, 6], help="stream counts (batch sizes)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per path, stream count and repeat")
    p.add_argument("--repeats", type=int, default=3, help="rounds over every path (median of all steps)")
    p.add_argument("--compile", action="store_true", help="also time the static path (compiled FlexAttention)")
    p.add_argument("--schema", action="store_true",
                   help="also time the eager path with every row under a JSON schema (response_format)")
    p.add_argument("--seed", type=int, default=0, help="the prompt's random tokens")
    p.add_argument("--json", default="", help="result file (.md beside it); empty = print only")
    p.set_defaults(func=command, parser=p)
