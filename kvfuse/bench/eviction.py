"""`kvfuse bench evict`: eviction after the first token (`fusion.evict_capacity`, fusion/eviction.py)
against the same method without it, in the same run.

Speed: one fused prompt per context and capacity C (C = 0: no eviction, the baseline); its cache is
copied to make the streams, and timed windows of engine core steps over them (kvfuse/bench/streams.py,
the step the service's worker runs) give decode tok/s at each stream count. The capacities are
timed in turn within every repeat, so drift hits them alike. Memory: the fused cache's bytes after
eviction (exact) and the process's peak RSS growth over the fused prefill with its eviction. Each row
also gives the ratio a pure bandwidth model predicts: a step reads the weights once and every
stream's cache, so (weights + streams x full cache) / (weights + streams x evicted cache).

Fidelity: the synthetic tasks of `kvfuse bench fidelity` at the same contexts; each example answered
greedily without eviction and at each C; agreement = the same answer text as without eviction, plus
each run's task score. Eviction happens after the first token, so the first token always agrees.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from kvfuse.bench.memory import PeakRSS
from kvfuse.bench.plots import plot_if_possible

SPEED_TABLE = (
    ("context_tokens", "context tokens"), ("prompt_tokens", "prompt tokens"), ("capacity", "C"),
    ("capacity_share", "C / prompt"), ("cache_mb", "cache MB / stream"), ("peak_rss_mb", "peak RSS Δ (MB)"),
    ("streams", "streams"), ("decode_tok_s", "decode tok/s"), ("decode_vs_full", "× no eviction"),
    ("bandwidth_model_vs_full", "× bandwidth model"),
)
FIDELITY_TABLE = (
    ("context_tokens", "context tokens"), ("capacity", "C"), ("capacity_share", "C / prompt"), ("n", "n"),
    ("agreement", "same answer as no eviction"), ("score", "score"), ("score_full", "score, no eviction"),
)


def _options(backend: Any, method: str, ratio: float, capacity: int) -> Any:
    opts = backend.options(method, ratio)
    opts.evict_capacity = capacity
    return opts


def _weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _time_window(core: Any, steps: int) -> float:
    """tok/s of `steps` engine core steps, each a batched decode step of every stream of `core`."""
    from kvfuse.bench.streams import time_steps

    return len(core.scheduler.decode_batch()) * steps / sum(time_steps(core, steps))


def run_speed(backend: Any, prepared: Any, *, method: str, ratio: float, capacities: list[int],
              streams: list[int], steps: int, repeats: int, warmup: int = 2) -> list[dict[str, Any]]:
    """Rows per (C, streams) for one prompt; C = 0 (no eviction) is always measured first."""
    prefix, chunks, question_ids = prepared
    engine = backend.engine
    caps = [0, *[c for c in capacities if c > 0]]
    from kvfuse.bench.streams import core_streams

    room = warmup + repeats * steps + 2  # the streams' first decode step runs as they start
    setups: dict[int, dict[str, Any]] = {}
    for c in caps:
        with PeakRSS() as mem:
            fused = engine.fuse(prefix, chunks, question_ids, _options(backend, method, ratio, c), max_tokens=room)
        groups = {s: core_streams(engine, fused, s) for s in streams}  # copies of the (evicted) cache
        for core in groups.values():
            _time_window(core, warmup)
        setups[c] = {"fused": fused, "groups": groups, "peak_rss_mb": mem.delta_mb, "tok_s": {s: [] for s in streams}}
    for _ in range(repeats):
        for c in caps:
            for s, core in setups[c]["groups"].items():
                setups[c]["tok_s"][s].append(_time_window(core, steps))
    weights = _weight_bytes(engine.model)
    st = setups[0]["fused"].stats
    prompt = st["prefix_tokens"] + st["context_tokens"] + st["question_tokens"]
    per_token = setups[0]["fused"].cache.nbytes / setups[0]["fused"].cache.capacity
    rows = []
    for c in caps:
        fused = setups[c]["fused"]
        kept = fused.stats.get("cache_tokens", prompt)
        for s in streams:
            tok_s = statistics.median(setups[c]["tok_s"][s])
            full = statistics.median(setups[0]["tok_s"][s])
            rows.append({
                "method": method, "ratio": ratio, "context_tokens": st["context_tokens"], "prompt_tokens": prompt,
                "capacity": c, "capacity_share": kept / prompt, "cache_tokens": kept,
                "cache_mb": kept * per_token / 2**20, "peak_rss_mb": setups[c]["peak_rss_mb"], "streams": s,
                "decode_tok_s": tok_s, "decode_vs_full": tok_s / full, "samples_tok_s": setups[c]["tok_s"][s],
                "bandwidth_model_vs_full": (weights + s * prompt * per_token) / (weights + s * kept * per_token),
                "weights_mb": weights / 2**20,
            })
    return rows


def run_fidelity(backend: Any, examples: list[Any], *, method: str, ratio: float, capacities: list[int],
                 on_example: Any = None) -> list[dict[str, Any]]:
    """One outcome per example and C (C = 0 first: the reference answer)."""
    from kvfuse.bench.scoring import score as score_answer

    out: list[dict[str, Any]] = []
    for ex in examples:
        prefix, chunks, question_ids = backend.prepare(ex)
        budget = backend.max_tokens or ex.max_tokens
        ref = None
        for c in [0, *capacities]:
            ans = backend.greedy(prefix, chunks, question_ids, _options(backend, method, ratio, c), budget)
            text, ttft_s, stats = ans.text, ans.ttft_s, ans.stats
            ref = text if c == 0 else ref
            prompt = stats["prefix_tokens"] + stats["context_tokens"] + stats["question_tokens"]
            out.append({"task": ex.task, "example_id": ex.id, "capacity": c, "context_tokens": stats["context_tokens"],
                        "prompt_tokens": prompt, "cache_tokens": stats.get("cache_tokens", prompt),
                        "prediction": text.strip(), "same_as_full": text == ref,
                        "score": score_answer(ex.metric, text, ex.answers), "ttft_s": ttft_s})
        if on_example is not None:
            on_example(out)
    return out


def aggregate_fidelity(outcomes: list[dict[str, Any]], target: int) -> list[dict[str, Any]]:
    rows = []
    caps = sorted({o["capacity"] for o in outcomes})
    for c in caps:
        sel = [o for o in outcomes if o["capacity"] == c]
        full = {o["example_id"]: o for o in outcomes if o["capacity"] == 0}
        rows.append({
            "target_context_tokens": target, "context_tokens": round(statistics.mean(o["context_tokens"] for o in sel)),
            "capacity": c, "capacity_share": statistics.mean(o["cache_tokens"] / o["prompt_tokens"] for o in sel),
            "n": len(sel), "agreement": statistics.mean(o["same_as_full"] for o in sel),
            "score": statistics.mean(o["score"] for o in sel),
            "score_full": statistics.mean(full[o["example_id"]]["score"] for o in sel),
        })
    return rows


def render(payload: dict[str, Any], json_path: Path) -> tuple[Path, Path | None]:
    from kvfuse.bench.report import machine_line, markdown_table

    md = json_path.with_suffix(".md")
    p = payload["params"]
    lines = [f"# Eviction after the first token (`fusion.evict_capacity`), method `{p['method']}` "
             f"(ratio {p['ratio']})", "",
             f"Command: `{payload['command']}`  ", f"Machine: {machine_line(payload['machine'])}  ",
             f"Date: {payload.get('created', '')}" + ("  \n**partial run**" if payload.get("partial") else ""), "",
             "C = 0 is the same method without eviction, measured in the same run. Decode: median of "
             f"{p['repeats']} windows of {p['steps']} batched decode steps per stream count (the streams are "
             "copies of one fused prompt). `× bandwidth model`: (weights + streams × full cache) / "
             "(weights + streams × evicted cache), the ratio if a step only read memory.", ""]
    if payload.get("speed_rows"):
        lines += ["## Decode speed and memory", "", markdown_table(payload["speed_rows"], SPEED_TABLE), ""]
    if payload.get("fidelity_rows"):
        lines += [f"## Fidelity (tasks {', '.join(p['tasks'])}, {p['n']} examples per task and context, greedy)", "",
                  markdown_table(payload["fidelity_rows"], FIDELITY_TABLE), ""]
    md.write_text("\n".join(lines), encoding="utf-8")
    png = plot_if_possible(plot, payload, json_path.with_suffix(".png"))
    return md, png


def plot(payload: dict[str, Any], path: Path) -> Path:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    fid, spd = payload.get("fidelity_rows") or [], payload.get("speed_rows") or []
    for ctx in sorted({r["target_context_tokens"] for r in fid}):
        rs = [r for r in fid if r["target_context_tokens"] == ctx and r["capacity"] > 0]
        ax1.plot([r["capacity"] for r in rs], [100 * r["agreement"] for r in rs], "o-", label=f"~{ctx} context")
    ax1.set(xlabel="C (cache tokens kept)", ylabel="same answer as no eviction (%)", title="fidelity", ylim=(0, 105))
    for ctx in sorted({r["target_context_tokens"] for r in spd}):
        for s in sorted({r["streams"] for r in spd}):
            rs = [r for r in spd if r["target_context_tokens"] == ctx and r["streams"] == s and r["capacity"] > 0]
            ax2.plot([r["capacity"] for r in rs], [r["decode_vs_full"] for r in rs], "o-",
                     label=f"~{ctx}, {s} stream{'s' if s > 1 else ''}")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xlabel="C (cache tokens kept)", ylabel="decode tok/s / no eviction", title="decode speed")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        if ax.get_legend_handles_labels()[0]:  # a fidelity-only or timing-only run leaves one side empty
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def combine(paths: list[Path], json_path: Path) -> tuple[Path, Path | None]:
    """One result (md + plot) from several runs' JSON, e.g. a timing run and a fidelity run: their speed
    rows, and fidelity rows recomputed from their outcomes (so a run cut short counts what it finished)."""
    import json

    runs = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    outcomes = [o for r in runs for o in r.get("outcomes", [])]
    fidelity_rows = []
    for ctx in sorted({o["target_context_tokens"] for o in outcomes}):
        mine = [o for o in outcomes if o["target_context_tokens"] == ctx]
        full_ids = {o["example_id"] for o in mine if o["capacity"] == 0}
        fidelity_rows += aggregate_fidelity([o for o in mine if o["example_id"] in full_ids], ctx)
    params = dict(runs[0]["params"])
    for r in runs[1:]:
        params.update({k: v for k, v in r["params"].items() if k in ("tasks", "n") and r.get("outcomes")})
    payload = {"kind": "eviction", "command": "; ".join(r["command"] for r in runs), "machine": runs[0]["machine"],
               "params": params, "partial": any(r.get("partial") for r in runs), "sources": [str(p) for p in paths],
               "speed_rows": [row for r in runs for row in r.get("speed_rows", [])],
               "fidelity_rows": fidelity_rows, "outcomes": outcomes, "created": runs[-1].get("created", "")}
    _write(payload, json_path)
    return render(payload, json_path)


def command(args: Any) -> int:
    if args.combine:
        md, png = combine([Path(p) for p in args.combine], Path(args.json))
        print(f"wrote {args.json}, {md}, {png}", file=sys.stderr)
        return 0
    from kvfuse.bench import tasks
    from kvfuse.bench.data import resolve_data_dir
    from kvfuse.bench.engine_backend import EngineBackend
    from kvfuse.bench.machine import command_line, load_info, machine_info
    from kvfuse.config import get_settings

    settings = get_settings()
    data_dir = resolve_data_dir(args.data_dir)
    machine = {**machine_info(), **{f"{k}_at_start": v for k, v in load_info().items()}}
    backend = EngineBackend(settings, max_tokens=args.max_tokens)
    hay = tasks.Haystack(backend.tokenizer, data_dir)
    params = {"contexts": args.contexts, "capacities": args.capacities, "method": args.method, "ratio": args.ratio,
              "tasks": args.task, "n": args.n, "streams": args.streams, "steps": args.steps,
              "repeats": args.repeats, "doc_tokens": args.doc_tokens, "max_tokens": args.max_tokens,
              "seed": args.seed, "model": settings.model.llm, "dtype": settings.model.dtype}
    json_path = Path(args.json)
    payload: dict[str, Any] = {"kind": "eviction", "command": command_line("kvfuse bench evict", args.parser, args),
                               "machine": machine, "params": params, "partial": True,
                               "speed_rows": [], "fidelity_rows": [], "outcomes": []}

    def save(*, partial: bool = True) -> None:
        payload["partial"] = partial
        payload["machine"] = {**machine, **load_info()}
        _write(payload, json_path)

    for ctx in args.contexts:
        cfg = tasks.TaskConfig(n=max(1, args.n), docs=max(1, round(ctx / args.doc_tokens)),
                               doc_tokens=args.doc_tokens, seed=args.seed)
        if args.steps > 0:
            print(f"~{ctx}: decode speed", file=sys.stderr)
            prepared = backend.prepare(tasks.synthetic("needle", hay, cfg, 0))
            rows = run_speed(backend, prepared, method=args.method, ratio=args.ratio, capacities=args.capacities,
                             streams=args.streams, steps=args.steps, repeats=args.repeats)
            payload["speed_rows"] += [{"target_context_tokens": ctx, **r} for r in rows]
            save()
        if args.n > 0:
            done = len(payload["outcomes"])
            for task in args.task:
                examples = tasks.build_examples(task, backend.tokenizer, data_dir, cfg, hay)
                print(f"~{ctx}: {task}, {len(examples)} examples", file=sys.stderr)

                base = list(payload["outcomes"])

                def progress(outs: list[dict[str, Any]], base: list = base, t: int = ctx) -> None:
                    payload["outcomes"] = base + [{"target_context_tokens": t, **o} for o in outs]
                    print(f"  {len(outs) // (len(args.capacities) + 1)} done", file=sys.stderr)
                    save()

                run_fidelity(backend, examples, method=args.method, ratio=args.ratio, capacities=args.capacities,
                             on_example=progress)
            mine = payload["outcomes"][done:]
            payload["fidelity_rows"] += aggregate_fidelity(mine, ctx)
            save()
    save(partial=False)
    md, png = render(payload, json_path)
    from kvfuse.bench.report import markdown_table

    print(markdown_table(payload["speed_rows"], SPEED_TABLE))
    print(markdown_table(payload["fidelity_rows"], FIDELITY_TABLE))
    print(f"\nwrote {json_path}, {md}, {png}", file=sys.stderr)
    return 0


def _write(payload: dict[str, Any], json_path: Path) -> None:
    import datetime as dt
    import json
    import os

    payload.setdefault("created", dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, json_path)


def register(bsub: Any) -> None:
    """Add `kvfuse bench evict` (imports nothing heavy)."""

    from kvfuse.bench.args import csv_list
    from kvfuse.bench.data import DATA_DIR_HELP

    p = bsub.add_parser("evict", help="eviction after the first token: decode tok/s, memory, answer agreement vs C")
    p.add_argument("--contexts", type=csv_list(int), default=[4096, 7680], help="context sizes in tokens")
    p.add_argument("--capacities", type=csv_list(int), default=[512, 1024, 2048], help="C values (0 = none is always run)")
    p.add_argument("--method", default="a3", help="fusion method whose prefill is evicted (A³'s pairing: a3)")
    p.add_argument("--ratio", type=float, default=0.15, help="its recompute ratio")
    p.add_argument("--task", type=csv_list(str), default=["needle", "multikey"], help="fidelity tasks")
    p.add_argument("--n", type=int, default=6, help="fidelity examples per task and context (0: no fidelity)")
    p.add_argument("--streams", type=csv_list(int), default=[1, 8], help="stream counts of the decode timing")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed window (0: no timing)")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per figure (median)")
    p.add_argument("--doc-tokens", type=int, default=512, help="tokens per chunk")
    p.add_argument("--max-tokens", type=int, default=None, help="answer budget (default: per task)")
    p.add_argument("--seed", type=int, default=0, help="example generation seed")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--json", default="docs/results/eviction/evict.json",
                   help="result file; the .md table and .png plot are written beside it")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="run nothing: write --json (+ .md, .png) from these runs' results (e.g. timing + fidelity)")
    p.set_defaults(func=command, parser=p)
