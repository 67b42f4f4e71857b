"""Result files, markdown tables and the README results block (the figures are drawn by `plots`).

A run writes `<name>.json` (rows, per-example outcomes, command, machine) and renders it; `kvfuse bench
report` re-renders every `fidelity*.json` / `speed*.json` / `load*.json` of a results folder into
`<name>.md` and `<name>.png`, an `index.md` (every run), and the block between the markers below in a
README, by default the folder's own (docs/results/README.md; the newest run of each kind). Every number shown comes
from those JSON files."""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfuse.bench.memory import SAMPLE_INTERVAL_S
from kvfuse.bench.plots import method_key, plot_fidelity, plot_speed

README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"
# Relative to the working directory: the bench commands run from the repository root.
DEFAULT_RESULTS_DIR = Path("docs") / "results"
SCRATCH_DIR = Path("bench-results")  # git-ignored default output of a run

FIDELITY_TABLE = (
    ("task", "task"), ("method", "method"), ("ratio", "ratio"), ("n", "n"), ("score", "score"),
    ("score_vs_vanilla", "score / vanilla"), ("score_vs_vanilla_ci", "95 % interval"),
    ("gained_vs_vanilla", "above vanilla"), ("lost_vs_vanilla", "below vanilla"),
    ("same_answer_vs_vanilla", "same answer as vanilla"), ("same_answer_vs_vanilla_ci", "95 % interval"),
    ("same_value_vs_vanilla", "same value as vanilla"), ("same_value_vs_vanilla_ci", "95 % interval"),
    ("floor_gap", "floor − method (value)"), ("floor_gap_ci", "95 % interval"), ("within_floor", "within floor"),
    ("kl_vs_vanilla", "first-token KL (nats)"), ("answer_kl_vs_vanilla", "answer KL (nats)"),
    ("answer_kl_vs_vanilla_ci", "95 % interval"), ("ttft_s_median", "TTFT (s)"),
    ("ttft_vs_vanilla", "TTFT / vanilla"), ("context_tokens_mean", "context tokens"),
    ("kv_loaded_share", "KV loaded (share)"), ("fused_cache_tokens_mean", "fused cache tokens"),
)
SPEED_TABLE = (
    ("context_tokens", "context tokens"), ("method", "method"), ("ratio", "ratio"),
    ("ttft_s_median", "TTFT warm (s)"), ("ttft_vs_vanilla", "warm / vanilla"),
    ("ttft_cold_s_median", "TTFT cold (s)"), ("ttft_cold_vs_vanilla", "cold / vanilla"),
    ("kv_load_s", "KV load (s)"), ("decode_tok_s", "decode tok/s"), ("decode_vs_vanilla", "decode / vanilla"),
    ("peak_rss_mb", "peak RSS Δ (MB)"), ("peak_rss_vs_vanilla", "RSS / vanilla"),
    ("kv_loaded_share", "KV loaded (share)"), ("kv_loaded_mb", "KV loaded (MB)"),
    ("fused_cache_tokens", "fused cache tokens"), ("fused_cache_mb", "fused cache (MB)"),
)
PARTIAL_NOTE = ("_Partial run: it was stopped before every example (or context) was done; `n` says how "
                "many each row has._")


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):  # counts by name
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)) and len(value) == 2:  # an interval
        return f"{_fmt(value[0])}–{_fmt(value[1])}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}" if abs(value) >= 0.001 else f"{value:.1e}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(r.get(key)) for key, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def sort_fidelity(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["task"], method_key(r["method"]), r["ratio"]))


def sort_speed(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r.get("target_context_tokens", r["context_tokens"]),
                                       method_key(r["method"]), r["ratio"]))


def fidelity_summary(rows: Sequence[dict[str, Any]]) -> str:
    """Score per task (columns) for each method@ratio (rows): the table to read first."""
    from kvfuse.bench.fidelity import FIXED_RATIO

    tasks = sorted({r["task"] for r in rows})
    cells: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for r in rows:
        # a method whose share is set by the chunks (epic) is one line, at its mean measured share
        measured = r["method"] in FIXED_RATIO and FIXED_RATIO[r["method"]] is None
        cells.setdefault((r["method"], -1.0 if measured else r["ratio"]), {})[r["task"]] = r
    head = "| method | ratio | " + " | ".join(tasks) + " | mean score / vanilla | mean TTFT / vanilla |"
    sep = "|---|---|" + "---|" * (len(tasks) + 2)
    lines = [head, sep]
    for method, key in sorted(cells, key=lambda mr: (method_key(mr[0]), mr[1])):
        by_task = cells[(method, key)]
        ratios = [r["ratio"] for r in by_task.values()]
        ratio = sum(ratios) / len(ratios)
        vs = [by_task[t]["score_vs_vanilla"] for t in tasks if t in by_task and by_task[t]["score_vs_vanilla"]
              is not None]
        tt = [by_task[t]["ttft_vs_vanilla"] for t in tasks if t in by_task and by_task[t]["ttft_vs_vanilla"]
              is not None]
        scores = " | ".join(_fmt(by_task[t]["score"]) if t in by_task else "–" for t in tasks)
        lines.append(f"| {method} | {'≈' if key < 0 else ''}{_fmt(ratio)} | {scores} | {_fmt(sum(vs) / len(vs) if vs else None)} | "
                     f"{_fmt(sum(tt) / len(tt) if tt else None)} |")
    return "\n".join(lines)


def fidelity_against_vanilla(rows: Sequence[dict[str, Any]]) -> str:
    """Per task, each method@ratio against vanilla on the same examples: score / vanilla with its paired
    bootstrap interval, and how many examples it scored above (+) and below (−) vanilla."""
    tasks = sorted({r["task"] for r in rows})
    cells: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["method"] != "vanilla":
            cells.setdefault((r["method"], r["ratio"]), {})[r["task"]] = r
    lines = ["| method | ratio | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    for method, ratio in sorted(cells, key=lambda mr: (method_key(mr[0]), mr[1])):
        by_task = cells[(method, ratio)]
        out = []
        for t in tasks:
            r = by_task.get(t)
            if r is None:
                out.append("–")
                continue
            ci = r.get("score_vs_vanilla_ci")
            out.append(f"{_fmt(r['score_vs_vanilla'])}" + (f" ({_fmt(ci)})" if ci else "")
                       + f", +{r.get('gained_vs_vanilla', '?')}/−{r.get('lost_vs_vanilla', '?')}")
        lines.append(f"| {method} | {_fmt(ratio)} | " + " | ".join(out) + " |")
    return "\n".join(lines)


FLOOR_TABLE = (
    ("task", "task"), ("method", "method"), ("ratio", "ratio"), ("n", "n"),
    ("same_value_vs_vanilla", "same value as vanilla"), ("same_value_vs_vanilla_ci", "95 % interval"),
    ("floor_gap", "floor − method"), ("floor_gap_ci", "95 % interval"), ("within_floor", "within the floor"),
    ("answer_kl_vs_vanilla", "answer KL (nats)"),
)


def floor_section(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The report's part on the model's floor: each method's value agreement beside the floor's (vanilla
    with two fact-free documents swapped, kvfuse.bench.fidelity.FLOOR), paired; none when the run has
    no floor."""
    from kvfuse.bench.fidelity import FLOOR, FLOOR_MARGIN, FLOOR_MIN_N

    if not any(r["method"] == FLOOR for r in rows):
        return []
    shown = [r for r in sort_fidelity(rows) if r["method"] != "vanilla"]
    return [
        "## Against the model's floor", "",
        f"`{FLOOR}` is vanilla again with two documents that hold no fact swapped: how often that neutral change "
        "moves the answer's value is the model's own noise. `floor − method`: the floor's value agreement "
        "minus the method's on the same examples (positive: the method changes values more often), with its "
        f"95 % bootstrap interval; `within the floor`: yes when the interval's upper end is ≤ {FLOOR_MARGIN:g} "
        f"on at least {FLOOR_MIN_N} examples, no when the mean is above it, `not shown` when the run is too "
        "small to tell.", "",
        markdown_table(shown, FLOOR_TABLE), "",
    ]


FORMAT_TABLE = (
    ("task", "task"), ("method", "method"), ("n", "n"), ("same_value_vs_vanilla", "same value as vanilla"),
    ("vs_float16_gap", "float16 − format (value)"), ("vs_float16_gap_ci", "95 % interval"),
    ("answer_kl_vs_vanilla", "answer KL (nats)"), ("answer_kl_vs_float16", "answer KL / float16's"),
    ("answer_kl_vs_float16_ci", "95 % interval"), ("ttft_vs_float16", "TTFT / float16's"),
)


def formats_section(rows: list[dict[str, Any]]) -> list[str]:
    """Each KV format's rows against float16 storage on the same examples (`--kv-formats`); none without."""
    shown = [r for r in sort_fidelity(rows) if "[" in r["method"]]
    if not shown:
        return []
    return ["## KV formats against float16 storage", "",
            "`method[format]`: the method on chunks stored in that format and read back through the engine's "
            "loader. `float16 − format`: float16's value agreement with vanilla minus the format's on the same "
            "examples, with its 95 % bootstrap interval; the answer KL and median TTFT as ratios to float16's.",
            "", markdown_table(shown, FORMAT_TABLE), ""]


def fidelity_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The payload's rows, re-aggregated from its per-example outcomes when it has them (so a report
    re-rendered from an older file gains figures added to the aggregation since)."""
    from kvfuse.bench.fidelity import Outcome, aggregate

    outcomes = payload.get("outcomes")
    if not outcomes:
        return list(payload["rows"])
    return sort_fidelity(aggregate([Outcome(**o) for o in outcomes]))


def machine_line(machine: dict[str, Any]) -> str:
    return (f"{machine.get('cpu_model')}, {machine.get('cpu_cores')} cores "
            f"({machine.get('torch_threads')} torch threads), torch {machine.get('torch')}, "
            f"transformers {machine.get('transformers')}, Python {machine.get('python')}"
            + (f", commit {machine['git_commit']}" if machine.get("git_commit") else "")
            + (f"; load average {machine['load_avg_1m_at_start']} at start, {machine['load_avg_1m']} at end"
               if "load_avg_1m" in machine and "load_avg_1m_at_start" in machine else ""))


def render(payload: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    """Write `<stem>.md` and `<stem>.png` beside the JSON file; returns their paths."""
    stem = json_path.with_suffix("")
    png = stem.with_suffix(".png")
    md = stem.with_suffix(".md")
    kind = payload["kind"]
    rows = fidelity_rows(payload) if kind == "fidelity" else payload["rows"]
    head = [
        f"# {kind.capitalize()} benchmark: `{json_path.stem}`", "",
        f"Command: `{payload['command']}`  ", f"Machine: {machine_line(payload['machine'])}  ",
        f"Date: {payload.get('created', '?')}", "",
    ]
    if payload.get("partial"):
        head += [PARTIAL_NOTE, ""]
    if kind == "fidelity":
        plot_fidelity(rows, png)
        body = [
            "Score per task (exact match for needle/multikey, share of values found for multivalue/vartrack,"
            " token F1 for musique), greedy decoding, every method on the same examples as vanilla; the "
            "synthetic tasks give RULER's answer prefix after the assistant header. `ratio` of epic is its "
            "measured share (its edge tokens are fixed per chunk).", "",
            fidelity_summary(rows), "", f"![fidelity]({png.name})", "", "## Against vanilla", "",
            "Score / vanilla on the same examples, its 95 % paired bootstrap interval (examples "
            "resampled), and the examples scored above (+) and below (−) vanilla. An interval that "
            "contains 1 means the run cannot tell the method from vanilla; no interval: vanilla scored 0 "
            "on most resamples.", "",
            fidelity_against_vanilla(rows), "", *floor_section(rows), *formats_section(rows), "## All figures", "",
            markdown_table(sort_fidelity(rows), FIDELITY_TABLE), "",
            "`score / vanilla`: mean score over mean vanilla score on the same examples; `same answer`: "
            "share of examples whose normalised answer equals vanilla's; `same value`: whose extracted "
            "value (the first number, else the first sentence; kvfuse/answer_match.py) does; `first-token KL`: mean "
            "KL(P_vanilla ‖ P_method) of the first answer token; `answer KL`: the same per token over "
            "vanilla's whole answer, teacher-forced on the method's cache, averaged per example, then over "
            "examples; intervals: 95 % paired bootstrap over examples; TTFT: median over examples.",
        ]
    elif kind == "speed":
        plot_speed(rows, png)
        body = [
            markdown_table(sort_speed(rows), SPEED_TABLE), "", f"![speed]({png.name})", "",
            "TTFT warm: chunk KV already in memory; cold: chunk blobs read back from a real LMDB `KVStore` "
            "(hot tier off, OS page cache warm) and decoded before fusing; KV load is that read. Medians "
            f"over {payload.get('params', {}).get('repeats', '?')} repeats (one warmup per method first). Peak RSS Δ: "
            f"peak VmRSS (sampled every {SAMPLE_INTERVAL_S * 1000:g} ms) during one generation minus VmRSS before it, after freeing "
            "unused heap (malloc_trim). Decode tok/s: forward steps after the first token over their time (the step that produced EOS included).",
        ]
    elif kind == "load":
        from kvfuse.bench import load_report

        load_report.plot(rows, png)
        params = payload.get("params", {})
        ingest = (f" Ingestion before the load: {params['context_tokens']} tokens in {params['ingest_s']:.1f} s "
                  f"({params['context_tokens'] / params['ingest_s']:.1f} tokens/s, documents one at a time, each "
                  "waited for)." if params.get("ingest_s") else "")
        body = [
            "Closed loop: N users each send their next streamed query when the last answer ends; open loop: "
            "Poisson arrivals at the given rate. TTFT and ITL as the client sees them (ITL between token "
            "events), TPOT per request (decode time over its tokens after the first); tokens/s and requests/s "
            "over each level's wall time." + ingest, "", markdown_table(rows, load_report.table(rows)), "",
            f"![load]({png.name})",
            "", "## What batching buys", "",
            markdown_table(load_report.scaling(load_report.first_rate(rows)), load_report.SCALING_TABLE),
        ]
        cost = load_report.shadow_cost(rows, payload.get("fidelity", {}))
        if cost:
            body += ["", "## What shadow checks cost", "",
                     "The same load against one server per `fidelity.shadow_rate`, started in turn; TTFT at each "
                     "rate over the first rate's; checks: those the server had finished when its load ended.", "",
                     markdown_table(cost, load_report.SHADOW_TABLE)]
    else:
        raise ValueError(f"unknown result kind {kind!r} in {json_path}")
    md.write_text("\n".join(head + body) + "\n", encoding="utf-8")
    return md, png


def write_result(payload: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    payload.setdefault("created", _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, json_path)
    return render(payload, json_path)


KINDS = ("fidelity", "speed", "load")


def result_files(results_dir: Path) -> list[Path]:
    return [p for kind in KINDS for p in sorted(results_dir.glob(f"{kind}*.json"))]


def newest_of_each_kind(files: list[Path]) -> list[Path]:
    """The most recent result file of each kind (by its `created` stamp): what the README shows."""
    newest: dict[str, tuple[str, Path]] = {}
    for path in files:
        payload = json.loads(path.read_text(encoding="utf-8"))
        stamp = str(payload.get("created", ""))
        if payload["kind"] not in newest or stamp > newest[payload["kind"]][0]:
            newest[payload["kind"]] = (stamp, path)
    return [newest[k][1] for k in KINDS if k in newest]


def readme_block(results_dir: Path, readme: Path, *, every_file: bool = False) -> str:
    """Markdown for a results section: per result file (the newest of each kind, or `every_file`), its
    command, machine, headline table and plot."""
    rel = os.path.relpath(results_dir, readme.parent)
    files = result_files(results_dir)
    shown = files if every_file else newest_of_each_kind(files)
    more = "" if every_file else f" The newest run of each kind; every run is in [`{rel}/index.md`]({rel}/index.md)."
    parts = [README_START, "", "_Generated by `kvfuse bench report` from the JSON files in "
             f"[`{rel}/`]({rel}/); do not edit by hand._{more}", ""]
    for path in shown:
        payload = json.loads(path.read_text(encoding="utf-8"))
        kind = payload["kind"]
        rows = fidelity_rows(payload) if kind == "fidelity" else payload["rows"]
        parts += [f"#### {kind.capitalize()}: `{path.stem}`", "",
                  f"`{payload['command']}` — {machine_line(payload['machine'])}, {payload.get('created', '')}",
                  ""]
        if payload.get("partial"):
            parts += [PARTIAL_NOTE, ""]
        if kind == "fidelity":
            parts.append(fidelity_summary(rows))
        elif kind == "load":
            from kvfuse.bench import load_report

            parts.append(markdown_table(load_report.scaling(rows), load_report.SCALING_TABLE))
        else:
            cols = [c for c in SPEED_TABLE if c[0] in ("context_tokens", "method", "ratio", "ttft_s_median",
                                                        "ttft_vs_vanilla", "ttft_cold_s_median",
                                                        "kv_load_s", "decode_tok_s", "peak_rss_mb")]
            parts.append(markdown_table(sort_speed(rows), cols))
        parts += ["", f"![{path.stem}]({rel}/{path.stem}.png) · [all figures]({rel}/{path.stem}.md)", ""]
    parts.append(README_END)
    return "\n".join(parts)


def update_readme(results_dir: Path, readme: Path) -> bool:
    """Replace the block between the markers; False (README untouched) when the markers are absent."""
    if not readme.is_file():
        return False
    text = readme.read_text(encoding="utf-8")
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        return False
    new = text[:start] + readme_block(results_dir, readme) + text[end + len(README_END):]
    if new != text:
        readme.write_text(new, encoding="utf-8")
    return True


METHODOLOGY = """\
How these numbers are made (`kvfuse/bench/`):

- **Tasks.** `needle`, `multikey`, `multivalue`, `vartrack` follow RULER's NIAH single / multi-key /
  multi-value and variable tracking, over Paul Graham essays cut into `docs` chunks of about `doc_tokens`
  tokens (one cached chunk each), the facts hidden at random sentence boundaries; the model gets RULER's
  answer prefix after the assistant header. `musique` is real multi-hop QA (the CacheBlend sample of
  MuSiQue): its 10 passages are the chunks (cut to `doc_tokens`), with LongBench's instruction.
  `--layout multidoc` puts the needle, multikey and multivalue facts in `docs` short documents instead
  (rows `TASK-docs`, `TASK-docs-shuffled`): passages of distinct essays, one chunk each, each fact in its
  own document, fused in the embedder's order of similarity to the question (kvfuse/bench/multidoc.py).
- **Scores.** Exact match of the value (whole word, case-insensitive) for needle/multikey; share of the
  values (variables) found for multivalue/vartrack; LongBench token F1 against the best reference for
  musique. Greedy decoding.
- **Same examples, same run.** The engine is loaded once; each example's prefix and chunks are precomputed
  once and that KV is reused by every method; vanilla (full prefill of the whole prompt) runs on every
  example, and every `*_vs_vanilla` figure compares with it on the same examples. KL is
  KL(P_vanilla ‖ P_method) of the first-token distribution from the fused prefill's logits.
- **Ratio.** The share of context tokens recomputed (question tokens always are). vanilla is 1,
  full_reuse and pie 0; epic's edge tokens are fixed per chunk, so its ratio is the measured share.
- **TTFT** is the time from the start of the fused prefill to the first token chosen, with the chunk KV
  already in memory (speed: also read back from LMDB first). Timings come from a CPU machine shared with
  other work: its load average is recorded with every result; compare ratios to vanilla from the same
  run rather than absolute seconds.
"""


def regenerate(results_dir: Path, readme: Path | None) -> list[Path]:
    """Re-render every result file of `results_dir`, its index.md, and the README block."""
    written: list[Path] = []
    files = result_files(results_dir)
    for path in files:
        written += render(json.loads(path.read_text(encoding="utf-8")), path)
    index = results_dir / "index.md"
    block = readme_block(results_dir, index, every_file=True).replace(README_START, "").replace(README_END, "")
    index.write_text(f"# Benchmark results\n\n{METHODOLOGY}\n{block.strip()}\n", encoding="utf-8")
    written.append(index)
    if readme is not None and update_readme(results_dir, readme):
        written.append(readme)
    return written
