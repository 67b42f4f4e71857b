"""`kvfuse` subcommands of the store package (registered by kvfuse.cli)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from kvfuse.store import KVStore
    from kvfuse.store.check import CheckReport
    from kvfuse.store.convert import ConvertReport

T = TypeVar("T")
R = TypeVar("R", bound="_Report")


class _Report(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def _on_store(run: Callable[[KVStore], T], *, readonly: bool = False) -> T | None:
    """`run(store)` on the configured store; None once the error is printed when the store cannot be used."""
    from kvfuse.config import get_settings
    from kvfuse.store import KVStore, StoreError

    try:
        with KVStore.open(get_settings(), readonly=readonly) as store:
            return run(store)
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def _print_report(rep: R, as_json: bool, as_text: Callable[[R], None]) -> None:
    if as_json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        as_text(rep)


def _rebuild_index(args: argparse.Namespace) -> int:
    counts = _on_store(lambda store: store.rebuild_index())
    if counts is None:
        return 1
    print(json.dumps(counts))
    return 0


def _check(args: argparse.Namespace) -> int:
    from kvfuse.store.check import check_store

    rep = _on_store(lambda store: check_store(store, repair=args.repair), readonly=not args.repair)
    if rep is None:
        return 1
    _print_report(rep, args.json, lambda r: _print_check(r, args.repair))
    return 0 if (not rep.problems or args.repair) else 1


def _print_check(rep: CheckReport, repaired: bool) -> None:
    objects = f", {rep.objects} objects in the object store" if rep.objects else ""
    print(f"{rep.documents} documents, {rep.chunks} chunk blobs{objects}")
    if rep.evicted:  # not a problem: rebuilt from their tokens or read from a lower tier when queried
        print(f"chunks evicted by store.lmdb_budget_mb (not lost): {rep.evicted}")
    for title, items in (
        ("orphan blobs", rep.orphans),
        ("orphan blobs within the grace period (kept)", rep.young_orphans),
        ("missing blobs (document, chunk)", rep.missing),
        ("corrupt blobs", rep.corrupt),
        ("blobs of another model (fingerprint)", rep.foreign),
        ("index drift", rep.index_drift),
        ("chunks in use missing from the object store", rep.object_missing),
        ("unused objects not listed for deletion", rep.object_orphans),
        ("repaired", rep.repaired),
    ):
        if items:
            print(f"{title}: {len(items)}")
            for item in items[:20]:
                print(f"  {item}")
    if rep.ref_drift:
        print(f"chunk refs disagreeing with documents: {rep.ref_drift}")
    if rep.kv_bytes_drift:
        print(f"kv_bytes counter off by {rep.kv_bytes_drift}")
    print("ok" if not rep.problems else ("repaired" if repaired else "problems found (--repair fixes them)"))


def _convert(args: argparse.Namespace) -> int:
    from kvfuse.config import get_settings
    from kvfuse.store.convert import convert_store

    progress = None if args.json else (lambda done, total: print(f"{done}/{total}", file=sys.stderr))
    rep = _on_store(lambda store: convert_store(store, args.kv_dtype, batch=args.batch, limit=args.limit,
                                                progress=progress))
    if rep is None:
        return 1
    _print_report(rep, args.json, lambda r: _print_convert(r, get_settings().store.kv_dtype))
    return 0


def _print_convert(rep: ConvertReport, configured: str) -> None:
    ratio = f" ({rep.bytes_after / rep.bytes_before:.3f}x the bytes)" if rep.bytes_before else ""
    print(f"converted {rep.converted} chunk blobs to {rep.kv_dtype}{ratio} in {rep.seconds:.1f} s; "
          f"{rep.remaining} left (run it again to go on)")
    for key, why in rep.skipped[:20]:
        print(f"  left alone {key[:16]}: {why}")
    if configured != rep.kv_dtype:
        print(f"note: store.kv_dtype is {configured}: new chunks are still stored in it; set "
              f"KVFUSE_STORE__KV_DTYPE={rep.kv_dtype} (or store.kv_dtype in config.yaml) to store them in "
              f"{rep.kv_dtype} too. Chunks in either format are read.")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this package's subcommands; import nothing heavy here."""
    store = sub.add_parser("store", help="KV store maintenance")
    ssub = store.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    ssub.add_parser(
        "rebuild-index", help="rebuild the index (Redis) from LMDB, the source of truth"
    ).set_defaults(func=_rebuild_index)
    chk = ssub.add_parser("check", help="find orphan, missing and corrupt blobs, blobs of another model, and index drift")
    chk.add_argument("--repair", action="store_true",
                     help="delete orphans, corrupt blobs and those of another model, mark affected documents "
                          "kv_lost (rebuilt at the next start), fix the index")
    chk.add_argument("--json", action="store_true", help="print the report as JSON")
    chk.set_defaults(func=_check)
    from kvfuse.chunk_keys import FORMATS

    cnv = ssub.add_parser("convert", help="rewrite every stored chunk's KV in another format, in place, without "
                                          "the model (resumable: run it again after an interruption)")
    cnv.add_argument("--kv-dtype", required=True, choices=FORMATS, help="the KV format to convert to")
    cnv.add_argument("--batch", type=int, default=16, help="chunks per LMDB transaction")
    cnv.add_argument("--limit", type=int, default=None, help="convert at most this many chunks in this run")
    cnv.add_argument("--json", action="store_true", help="print the report as JSON")
    cnv.set_defaults(func=_convert)
