"""Study: which grouping a 4-bit KV format should use, measured on the model's own chunk KV.

    python studies/kv_format_error.py SEED N [JSON]

For N multi-document examples of each of needle and multikey (kvfuse.bench.multidoc, 8 documents of 512
tokens, best-last order, chunks cached alone), every chunk's KV is stored in each variant below and read
back (`kv_formats.round_trip_side`), and the fused prefill's first-token distribution is compared with the
one from float16 storage on the same example: KL(P_float16 || P_variant) in nats, and whether the top token
is the same, for `pie` (no recompute: every stored value is used as it is, the most exposed case) and
`anchor` at r = 0.15 (the default). It also reports each variant's stored bytes per token against
float16's (scales included) and the relative error of K and V (Frobenius norm of the error over that of
the values). Variants: the formats kvfuse stores (fp8, int8, int4) and the int4 groupings KIVI compared
(keys per channel or per token; value groups of 32 or 64 channels). Why: docs/results/kv-formats/README.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from kvfuse import kv_formats as F
from kvfuse.bench import multidoc, tasks
from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import kl_divergence
from kvfuse.config import get_settings
from kvfuse.fusion import ChunkKV

I4 = dict(code="U8", qmax=15.0, zero=True)
VARIANTS: dict[str, tuple[F.Side, F.Side] | None] = {
    "float16": None,
    "fp8": F.QUANTIZED["fp8"],
    "int8": F.QUANTIZED["int8"],
    "int4 (K channel/64, V token/32)": F.QUANTIZED["int4"],
    "int4 K channel/64, V token/64": (F.Side(**I4, per_channel=True, group=64), F.Side(**I4, per_channel=False, group=64)),
    "int4 K token/32, V token/32": (F.Side(**I4, per_channel=False, group=32), F.Side(**I4, per_channel=False, group=32)),
    "int4 K channel/32, V token/32": (F.Side(**I4, per_channel=True, group=32), F.Side(**I4, per_channel=False, group=32)),
    "int4 K channel/32, V token/64": (F.Side(**I4, per_channel=True, group=32), F.Side(**I4, per_channel=False, group=64)),
}
METHODS = (("pie", None), ("anchor", 0.15))


def stored_bytes(sides: tuple[F.Side, F.Side] | None, n: int, d: int) -> float:
    """Bytes per token per head of k and v in a variant (fp16 scales and zeros counted)."""
    if sides is None:
        return 2 * 2 * d
    total = 0.0
    for s in sides:
        codes = d // 2 if s.packed else d
        per = (d / s.group) if s.per_channel else d // (s.group or d)
        total += codes + 2 * per * (2 if s.zero else 1)
    return total


def round_trip(c: ChunkKV, sides: tuple[F.Side, F.Side] | None) -> tuple[ChunkKV, float, float]:
    if sides is None:
        k, v = c.k.half().float(), c.v.half().float()
    else:
        k, v = F.round_trip_side(c.k, sides[0]), F.round_trip_side(c.v, sides[1])
    err = [float((a - b.float()).norm() / b.float().norm()) for a, b in ((k, c.k), (v, c.v))]
    return ChunkKV(c.token_ids, k, v, after_context=c.after_context), err[0], err[1]


def main(argv: list[str]) -> int:
    seed, n = int(argv[0]), int(argv[1])
    out_json = Path(argv[2]) if len(argv) > 2 else None
    settings = get_settings()
    be = EngineBackend(settings, max_tokens=None)
    be.context_mode = "none"
    corpus = multidoc.Corpus(be.tokenizer, resolve_data_dir(None), 512)
    cfg = tasks.TaskConfig(n=n, docs=8, doc_tokens=512, seed=seed)
    embed = be.embedder().embed
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    for task in ("needle", "multikey"):
        for ex in multidoc.build_examples(task, corpus, cfg, "best-last", embed):
            prefix, chunks, question = be.prepare(ex)
            ref: dict[str, torch.Tensor] = {}
            for name, sides in VARIANTS.items():
                stored = [round_trip(c, sides) for c in chunks]
                acc = rows[name]
                acc.setdefault("k_rel_err", []).extend(e for _, e, _ in stored)
                acc.setdefault("v_rel_err", []).extend(e for _, _, e in stored)
                for method, ratio in METHODS:
                    fused = be.engine.fuse(prefix, [c for c, _, _ in stored], question, be.options(method, ratio))
                    logits = fused.logits.float().cpu()
                    ref.setdefault(method, logits)
                    acc.setdefault(f"{method}_kl", []).append(kl_divergence(ref[method], logits))
                    acc.setdefault(f"{method}_same_top", []).append(float(ref[method].argmax() == logits.argmax()))
            print(ex.id, {name: round(r["anchor_kl"][-1], 5) for name, r in rows.items()}, flush=True)
    d = be.engine.head_dim
    table = []
    for name, acc in rows.items():
        row = {"variant": name, "bytes_vs_float16": stored_bytes(VARIANTS[name], 512, d) / stored_bytes(None, 512, d),
               **{k: statistics.mean(v) for k, v in acc.items()}}
        table.append(row)
    cols = list(table[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in table:
        print("| " + " | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |")
    if out_json is not None:
        out_json.write_text(json.dumps({"argv": argv, "examples": 2 * n, "rows": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
