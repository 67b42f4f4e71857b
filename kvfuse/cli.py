"""kvfuse: RAG serving over reusable per-chunk KV caches.

Each package registers its own subcommands; nothing heavy is imported until a
subcommand runs, so `kvfuse --help` is instant."""

from __future__ import annotations

import argparse
import logging
import sys

from kvfuse import __version__

# (module, attribute): each `register(subparsers)` adds that package's subcommands.
_REGISTRARS = (
    "kvfuse.service.cli",
    "kvfuse.store.cli",
    "kvfuse.bench.cli",
    "kvfuse.bench.calibrate_report",
    "kvfuse.train.cli",
)


def _models_prepare(args: argparse.Namespace) -> int:
    """No SOURCE: locate or convert the configured LLM and embedder. A SOURCE (a GGUF file, a checkpoint
    folder or an installed model package: kvfuse/model_sources.py) is written as a served model folder,
    checked as a worker would load it, and the settings that serve it are printed."""
    from kvfuse.config import get_settings
    from kvfuse.model_files import ModelFilesError, resolve_embedder, resolve_llm

    s = get_settings()
    if not args.source:
        print(f"llm: {resolve_llm(s.model.llm, s.models_dir)}")
        print(f"embedder: {resolve_embedder(s.model.embedder)}")
        return 0
    from kvfuse.fusion import UnsupportedModelError
    from kvfuse.model_sources import prepare

    try:
        done = prepare(args.source, s.models_dir, name=args.name, dtype=args.write_dtype)
    except (ModelFilesError, UnsupportedModelError) as err:
        print(f"{args.source}: {err}", file=sys.stderr)
        return 2
    print(f"{'prepared' if done.converted else 'already prepared'}: {done.name} in {done.path}")
    if not args.no_check and _check(str(done.path), args.device, args.dtype) != 0:
        return 2
    print(f"to serve it, set in config.yaml:\n  model:\n    llm: {done.path}\n"
          f"(or KVFUSE_MODEL__LLM={done.path}); /v1/models lists it as {done.name!r}")
    return 0


def _models_check(args: argparse.Namespace) -> int:
    """Load PATH as the worker would and run the load check (kvfuse/fusion/model/check.py): a verdict per
    check, exit 0 when every check passed (the pass kept for workers: check_cache.py), 2 otherwise (or
    when the model cannot load)."""
    from kvfuse.config import get_settings
    from kvfuse.model_files import resolve_llm

    return _check(resolve_llm(args.path, get_settings().models_dir), args.device, args.dtype, args.path)


def _check(path: str, device: str | None, dtype: str | None, shown: str | None = None) -> int:
    from kvfuse.config import get_settings
    from kvfuse.fusion import FusionEngine, UnsupportedModelError
    from kvfuse.fusion.model.check import check_model
    from kvfuse.fusion.model.check_cache import remember_pass

    m = get_settings().model
    try:
        engine = FusionEngine.load(path, device=device or m.device, dtype=dtype or m.dtype, threads=m.threads)
    except UnsupportedModelError as err:
        print(f"{shown or path}: refused: {err}", file=sys.stderr)
        return 2
    report = check_model(engine)
    print(report.summary())
    kept = remember_pass(engine, report, get_settings())
    if kept is not None:
        print(f"the pass is kept in {kept}: a worker loading this model on this code, device and torch skips the check")
    return 0 if report.ok else 2


def _models_docs(args: argparse.Namespace) -> int:
    from kvfuse.fusion.model.models_doc import write

    text = write(args.output)
    if not args.output:
        sys.stdout.write(text)
    return 0


def _config_show(args: argparse.Namespace) -> int:
    import json

    from kvfuse.config import get_settings

    print(json.dumps(get_settings().model_dump(mode="json"), indent=2))
    return 0


def _config_docs(args: argparse.Namespace) -> int:
    from kvfuse.config_docs import write

    write(args.output)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuse", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"kvfuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    models = sub.add_parser("models", help="prepare the configured models, check a model, list the supported ones")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    mprep = msub.add_parser("prepare", help="convert/locate the configured models, or prepare SOURCE to serve "
                            "(one time, idempotent)")
    mprep.add_argument("source", nargs="?", help="a GGUF file, a checkpoint folder or an installed model package "
                       "(its distribution name); none: the configured LLM and embedder")
    mprep.add_argument("--name", help="the model's id on /v1/models and its folder's name (default: its own name)")
    mprep.add_argument("--write-dtype", choices=["float32", "float16", "bfloat16"],
                       help="what a GGUF is written in (default: float32 when it fits half the memory, else bfloat16)")
    mprep.add_argument("--no-check", action="store_true", help="skip the load check after preparing")
    mprep.add_argument("--device", help="the check's device (default: model.device)")
    mprep.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="the check's dtype (default: model.dtype)")
    mprep.set_defaults(func=_models_prepare)
    mcheck = msub.add_parser("check", help="compare the engine with transformers' forward on PATH (exit 0 or 2)")
    mcheck.add_argument("path", help='a model directory or hub id ("default": the default LLM)')
    mcheck.add_argument("--device", help="default: model.device")
    mcheck.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: model.dtype")
    mcheck.set_defaults(func=_models_check)
    mdocs = msub.add_parser("docs", help="render the supported-models page (docs/models.md)")
    mdocs.add_argument("-o", "--output", help="write the page here (e.g. docs/models.md), not stdout")
    mdocs.set_defaults(func=_models_docs)
    config = sub.add_parser("config", help="show the effective configuration, or render its reference")
    csub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    csub.add_parser("show", help="print every setting after env overrides").set_defaults(func=_config_show)
    docs = csub.add_parser("docs", help="render the configuration reference (docs/configuration.md)")
    docs.add_argument("-o", "--output", help="write the page here (e.g. docs/configuration.md), not stdout")
    docs.set_defaults(func=_config_docs)

    import importlib

    for name in _REGISTRARS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from kvfuse.config import ConfigError, get_settings

    try:
        level = get_settings().log_level.upper()
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
