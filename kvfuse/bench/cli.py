"""`kvfuse bench ...`: fidelity, speed, load, eviction, retriever, store, tiers, object-store, corpus, gpu,
decode, ingest, overload, choices and report.

Nothing heavy is imported until a subcommand runs, so `kvfuse --help` stays instant."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from kvfuse.bench.args import csv_list

DEFAULT_RATIOS = "0.05,0.15,0.3,1.0"
DEFAULT_CONTEXTS = "1024,2048,4096,8192"


def _flat(values: list[list] | None) -> list:
    return [x for group in values or [] for x in group]


def _fidelity(args: argparse.Namespace) -> int:
    from kvfuse import kvblob
    from kvfuse.bench import engine_backend, fidelity, report, tasks
    from kvfuse.bench.data import resolve_data_dir
    from kvfuse.bench.machine import command_line, load_info, machine_info
    from kvfuse.config import get_settings

    settings = get_settings()
    if args.precompute_context:
        store = settings.store.model_copy(update={"precompute_context": args.precompute_context})
        settings = settings.model_copy(update={"store": store})
    if args.prompt_layout:
        model = settings.model.model_copy(update={"prompt_layout": args.prompt_layout})
        settings = settings.model_copy(update={"model": model})
    if args.doc_order is None:  # the order the service puts retrieved documents in
        args.doc_order = [service_doc_order(settings.model.prompt_order)]
    data_dir = resolve_data_dir(args.data_dir)
    try:
        layout_tasks = _fidelity_tasks(args)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    task_names = sorted({t for names in layout_tasks.values() for t in names}, key=tasks.TASKS.index)
    bad = [f for f in args.kv_formats or [] if f not in kvblob.FORMATS]
    if bad or (args.kv_formats and args.url):
        print(f"--kv-formats: {', '.join(bad)} not among {', '.join(kvblob.FORMATS)}" if bad else
              "--kv-formats runs in-process only (a live server stores one format: store.kv_dtype)", file=sys.stderr)
        return 2
    if args.url:
        from transformers import AutoTokenizer

        from kvfuse.bench.http_backend import HttpBackend
        from kvfuse.model_files import resolve_llm

        tok = AutoTokenizer.from_pretrained(resolve_llm(settings.model.llm, settings.models_dir))
        backend = HttpBackend(args.url, max_tokens=args.max_tokens, api_key=args.api_key, tokenizer=tok,
                              timeout_s=settings.server.request_timeout_s)
    else:
        ref_dir = None if args.no_reference_cache else (args.reference_dir or settings.bench.reference_dir)
        backend = engine_backend.EngineBackend(settings, max_tokens=args.max_tokens, reference_dir=ref_dir,
                                               chunk_kv=args.chunk_kv, answer_prefix=args.answer_prefix)
    methods = args.methods or backend.methods()
    plan = fidelity.method_plan(methods, args.ratios, floor=not (args.url or args.no_floor),
                                kv_formats=args.kv_formats or ())
    cfg = tasks.TaskConfig(n=args.n, docs=args.docs, doc_tokens=args.doc_tokens, seed=args.seed)
    params = {"tasks": task_names, "layouts": layout_tasks,
              "doc_orders": args.doc_order if "multidoc" in layout_tasks else None,
              "n": args.n, "docs": args.docs, "doc_tokens": args.doc_tokens,
              "methods": methods, "ratios": args.ratios, "seed": args.seed, "max_tokens": args.max_tokens,
              "answer_prefix": args.answer_prefix, "system_prompt": settings.model.system_prompt,
              "kv_formats": args.kv_formats, "chunk_kv": args.chunk_kv,
              "url": args.url, "model": settings.model.llm, "prompt_layout": settings.model.prompt_layout, "fusion": settings.fusion.model_dump(),
              "precompute_context": {k: v for k, v in settings.store.model_dump().items()
                                     if k.startswith("precompute_")}}
    command, machine = command_line("kvfuse bench fidelity", args.parser, args), machine_info()
    json_path = Path(args.json)
    done: list = []

    def save(outcomes: list, *, partial: bool) -> list[dict]:
        rows = report.sort_fidelity(fidelity.aggregate(outcomes))
        payload = {"kind": "fidelity", "command": command, "machine": {**machine, **load_info()},
                   "params": params, "partial": partial, "rows": rows,
                   "vanilla_references": _reference_counts(backend),
                   "ingest": _ingest_rate(backend),
                   "outcomes": fidelity.outcome_dicts(outcomes)}
        report.write_result(payload, json_path)
        return rows

    for task, examples in _fidelity_examples(layout_tasks, args.doc_order, backend, settings, data_dir,
                                             cfg):
        print(f"{task}: {len(examples)} examples × {len(plan)} method/ratio runs", file=sys.stderr)
        # checkpoint after every example: a long run interrupted still leaves its results
        done += fidelity.run_examples(backend, examples, plan,
                                      on_example=lambda outs, prev=list(done): save(prev + outs, partial=True))
    rows = save(done, partial=False)
    md, png = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    print(report.fidelity_summary(rows))
    print()
    print(report.markdown_table(rows, report.FIDELITY_TABLE))
    print(f"\nwrote {args.json}, {md}, {png}", file=sys.stderr)
    return 0


def service_doc_order(prompt_order: str) -> str:
    """The multidoc document order (multidoc.ORDERS) of the service's `model.prompt_order`: its hits best
    first (`retrieval`) or reversed (`best-last`)."""
    return "retrieval" if prompt_order == "best-first" else "best-last"


def _fidelity_tasks(args: argparse.Namespace) -> dict[str, list[str]]:
    """The tasks of each requested layout; ValueError naming what is unknown or unsupported."""
    from kvfuse.bench import multidoc, tasks

    layouts = args.layout or ["haystack"]
    unknown = [x for x in layouts if x not in multidoc.LAYOUTS]
    unknown += [x for x in args.doc_order or [] if x not in multidoc.ORDERS]
    asked = _flat(args.task)
    unknown += [t for t in asked if t not in tasks.TASKS]
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)}: tasks are {', '.join(tasks.TASKS)}, layouts "
                         f"{', '.join(multidoc.LAYOUTS)}, document orders {', '.join(multidoc.ORDERS)}")
    out = {"haystack": asked or list(tasks.TASKS)} if "haystack" in layouts else {}
    if "multidoc" in layouts:
        bad = [t for t in asked if t not in multidoc.TASKS]
        if bad:
            raise ValueError(f"the multidoc layout has the tasks {', '.join(multidoc.TASKS)}, not {', '.join(bad)}")
        out["multidoc"] = asked or list(multidoc.TASKS)
    return out


def _fidelity_examples(layouts: dict[str, list[str]], orders: list[str], backend: object, settings: object,
                       data_dir: Path, cfg: object) -> Iterator[tuple[str, list]]:
    """(task label, examples) of every layout, order and task, built as they are reached."""
    from kvfuse.bench import engine_backend, multidoc, tasks

    hay = None
    for task in layouts.get("haystack", []):
        if task != "musique" and hay is None:
            hay = tasks.Haystack(backend.tokenizer, data_dir)
        yield task, tasks.build_examples(task, backend.tokenizer, data_dir, cfg, hay)
    if "multidoc" not in layouts:
        return
    corpus = multidoc.Corpus(backend.tokenizer, data_dir, cfg.doc_tokens)
    embedder = None
    for order in orders:
        if order != "shuffled" and embedder is None:
            embedder = backend.embedder() if hasattr(backend, "embedder") else engine_backend.load_embedder(settings)
        for task in layouts["multidoc"]:
            examples = multidoc.build_examples(task, corpus, cfg, order, embedder.embed if embedder else None)
            yield multidoc.label(task, order), examples


def _reference_counts(backend: object) -> dict | None:
    """How many vanilla outputs this run read back from the reference cache, and how many it computed."""
    refs = getattr(backend, "references", None)
    return None if refs is None else {"dir": str(refs.root), "reused": refs.hits, "computed": refs.misses}


def _ingest_rate(backend: object) -> dict | None:
    """Chunk precompute throughput of this run's context mode (chunk tokens per second)."""
    ing = getattr(backend, "ingest", None)
    if not ing or not ing["precompute_s"]:
        return None
    secs = ing["precompute_s"] + ing["embed_s"]
    return {**ing, "chunk_tokens_per_s": ing["chunk_tokens"] / secs}


def _speed(args: argparse.Namespace) -> int:
    from kvfuse.bench import report, speed, tasks
    from kvfuse.bench.data import resolve_data_dir
    from kvfuse.bench.engine_backend import EngineBackend
    from kvfuse.bench.machine import command_line, load_info, machine_info
    from kvfuse.config import get_settings

    settings = get_settings()
    data_dir = resolve_data_dir(args.data_dir)
    load_at_start = load_info()
    backend = EngineBackend(settings, max_tokens=args.max_tokens)
    machine = {**machine_info(), **{f"{k}_at_start": v for k, v in load_at_start.items()}}  # threads as loaded
    methods = args.methods or backend.methods()
    hay = tasks.Haystack(backend.tokenizer, data_dir)
    params = {"contexts": args.contexts, "methods": methods, "ratio": args.ratio, "repeats": args.repeats,
              "doc_tokens": args.doc_tokens, "max_tokens": args.max_tokens, "seed": args.seed,
              "cold": not args.no_cold, "kv_dtype": settings.store.kv_dtype, "model": settings.model.llm,
              "fusion": settings.fusion.model_dump()}
    command, json_path = command_line("kvfuse bench speed", args.parser, args), Path(args.json)

    def save(rows: list[dict], raw: list[dict], *, partial: bool) -> list[dict]:
        rows = report.sort_speed(rows)
        report.write_result({"kind": "speed", "command": command, "machine": {**machine, **load_info()},
                             "params": params, "partial": partial, "rows": rows,
                   "vanilla_references": _reference_counts(backend),
                   "ingest": _ingest_rate(backend), "samples": raw}, json_path)
        return rows

    rows, raw = speed.run_speed(backend, hay, contexts=args.contexts, methods=methods, ratio=args.ratio,
                                repeats=args.repeats, doc_tokens=args.doc_tokens, seed=args.seed,
                                cold=not args.no_cold,
                                on_context=lambda r, w: save(r, w, partial=True))  # a context at a time
    rows = save(rows, raw, partial=False)
    md, png = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    print(report.markdown_table(rows, report.SPEED_TABLE))
    print(f"\nwrote {args.json}, {md}, {png}", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    from kvfuse.bench import report

    results = Path(args.results_dir)
    if not report.result_files(results):
        print(f"no fidelity*.json or speed*.json in {results}", file=sys.stderr)
        return 1
    readme = None if args.no_readme else Path(args.readme) if args.readme else results / "README.md"
    written = report.regenerate(results, readme)
    for path in written:
        print(path)
    if readme is not None and readme not in written:
        print(f"note: {readme} has no {report.README_START} ... {report.README_END} block (or is missing): "
              "not updated", file=sys.stderr)
    return 0


def _add_common(p: argparse.ArgumentParser, *, max_tokens: int | None) -> None:
    from kvfuse.bench.data import DATA_DIR_HELP

    p.add_argument("--methods", type=csv_list(str), default=None,
                   help="comma-separated fusion methods (default: every registered method); vanilla always runs")
    p.add_argument("--seed", type=int, default=0, help="example generation seed")
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="greedy answer length limit" + (f" (default {max_tokens})" if max_tokens else
                                                        " (default: per task, tasks.ANSWER_TOKENS)"))
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)


def _add_fidelity(bsub: argparse._SubParsersAction) -> None:
    """`kvfuse bench fidelity`: its many options (tasks, layouts, orders, contexts) in one place."""
    from typing import get_args

    from kvfuse.bench.report import SCRATCH_DIR
    from kvfuse.config.sections import StoreSettings

    # The modes as the setting declares them: importing kvfuse.fusion here would load torch for `--help`.
    context_modes = get_args(StoreSettings.model_fields["precompute_context"].annotation)

    fid = bsub.add_parser("fidelity", help="answer quality of every fusion method vs vanilla")
    fid.add_argument("--task", type=csv_list(str), action="append",
                     help="needle, multikey, multivalue, vartrack, musique (repeatable or comma list; default all)")
    fid.add_argument("--n", type=int, default=20, help="examples per task")
    fid.add_argument("--docs", type=int, default=8, help="chunks per synthetic example (musique: its 10 passages)")
    fid.add_argument("--doc-tokens", type=int, default=512, help="tokens per chunk (musique: passages cut to this)")
    fid.add_argument("--ratios", type=csv_list(float), default=csv_list(float)(DEFAULT_RATIOS),
                     help=f"recompute ratios of the selective methods (default {DEFAULT_RATIOS})")
    fid.add_argument("--json", default=str(SCRATCH_DIR / "fidelity.json"),
                     help="result file; the .md table and .png plot are written beside it")
    fid.add_argument("--url", default=None, help="run through a live server's REST API instead (no KL)")
    fid.add_argument("--api-key", default=None, help="API key for --url")
    fid.add_argument("--reference-dir", default=None,
                     help="where vanilla's outputs are kept and reused between runs (default: bench.reference_dir)")
    fid.add_argument("--precompute-context", choices=context_modes, default=None,
                     help="what each chunk's KV is computed after (default: store.precompute_context)")
    fid.add_argument("--chunk-kv", choices=("ingestion", "first-prompt"), default="ingestion",
                     help="each chunk's KV: ingestion (after store.precompute_context, as eager ingestion and "
                          "first use with the recorded context compute it) or first-prompt (kept from the "
                          "vanilla prefill of the same chunks in reverse order: first use's option (b))")
    fid.add_argument("--layout", type=csv_list(str), default=None,
                     help="haystack (one text's consecutive chunks, in order), multidoc (short documents of "
                          "one chunk each, distinct essays; tasks needle, multikey, multivalue; rows named "
                          "TASK-docs), or both (default haystack)")
    fid.add_argument("--doc-order", type=csv_list(str), default=None,
                     help="multidoc: retrieval (by the embedder's similarity to the question, highest first), "
                          "best-last (the same, reversed: the best next to the question) and/or shuffled "
                          "(default: the service's, model.prompt_order)")
    fid.add_argument("--answer-prefix", action="store_true",
                     help="continue each answer with the task's answer prefix (RULER's), which the service "
                          "never sends (default: the service's prompt, none)")
    fid.add_argument("--prompt-layout", choices=("plain", "labelled"), default=None,
                     help="how chunks are rendered (default: model.prompt_layout; kvfuse/fusion/prompt.py)")
    fid.add_argument("--no-floor", action="store_true",
                     help="skip the model's floor (vanilla with two fact-free documents swapped, and with its "
                          "documents' KV rounded to fp8)")
    fid.add_argument("--kv-formats", type=csv_list(str), default=None,
                     help="run each method once per KV format at rest (float16, bfloat16, float32, fp8, int8, "
                          "int4), its chunks stored in it and read back; rows `method[format]`, each paired "
                          "with float16's (default: the KV as computed, unstored)")
    fid.add_argument("--no-reference-cache", action="store_true", help="compute vanilla every run, keep nothing")
    _add_common(fid, max_tokens=None)
    fid.set_defaults(func=_fidelity, parser=fid)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvfuse bench ...`; import nothing heavy here."""
    from kvfuse.bench import retriever
    from kvfuse.bench.report import DEFAULT_RESULTS_DIR, SCRATCH_DIR

    bench = sub.add_parser("bench", help="fidelity and speed benchmarks, reports and plots")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    _add_fidelity(bsub)

    spd = bsub.add_parser("speed", help="TTFT (warm and from LMDB), KV load, decode speed, peak memory")
    spd.add_argument("--contexts", type=csv_list(int), default=csv_list(int)(DEFAULT_CONTEXTS),
                     help=f"context sizes in tokens (default {DEFAULT_CONTEXTS})")
    spd.add_argument("--ratio", type=float, default=0.15, help="recompute ratio of the selective methods")
    spd.add_argument("--repeats", type=int, default=3, help="timed repeats per figure (median; warmup first)")
    spd.add_argument("--doc-tokens", type=int, default=512, help="tokens per chunk")
    spd.add_argument("--no-cold", action="store_true", help="skip the LMDB (cold) measurements")
    spd.add_argument("--json", default=str(SCRATCH_DIR / "speed.json"),
                     help="result file; the .md table and .png plot are written beside it")
    _add_common(spd, max_tokens=32)
    spd.set_defaults(func=_speed, parser=spd)

    rep = bsub.add_parser("report", help="re-render tables, plots and the results README block from JSON")
    rep.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR), help="folder of fidelity*/speed*.json")
    rep.add_argument("--readme", default=None,
                     help="page whose block between <!-- results:start/end --> is replaced "
                          "(default: README.md in the results folder, docs/results/README.md)")
    rep.add_argument("--no-readme", action="store_true", help="leave that page alone")
    rep.set_defaults(func=_report)

    from kvfuse.bench import load

    load.register(bsub)  # `bench load`: concurrent streams through a real server

    from kvfuse.bench import eviction

    eviction.register(bsub)  # `bench evict`: eviction after the first token vs none

    retriever.register(bsub)

    from kvfuse.bench import gpu

    gpu.register(bsub)  # `bench gpu`: the worker at an 8B shape on a GPU

    from kvfuse.bench import store

    store.register(bsub)  # `bench store`: KV blob write and read rates per dtype

    from kvfuse.bench import tiers

    tiers.register(bsub)  # `bench tiers`: eviction policies of a bounded KV tier on a Zipf trace

    from kvfuse.bench import object_store

    object_store.register(bsub)  # `bench object-store`: S3 clients on chunk-sized objects

    from kvfuse.bench import corpus

    corpus.register(bsub)  # `bench corpus`: a corpus 10x the LMDB budget on an object store

    from kvfuse.bench import decode

    decode.register(bsub)  # `bench decode`: the decode step vs the weight-read bound

    from kvfuse.bench import first_use

    first_use.register(bsub)  # `bench ingest`: precompute_at first_use against ingest

    from kvfuse.bench import overload

    overload.register(bsub)  # `bench overload`: a server flooded past every bound while queries run

    from kvfuse.bench import choices

    choices.register(bsub)  # `bench choices`: n choices from one fused prefill against n = 1
