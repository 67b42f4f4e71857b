"""The load check: before a model serves, the engine's computation of it is compared with transformers'.

Why: the engine runs its own layer loop (transformer.py) over the HF modules, by a family table
(families.py). A checkpoint whose config asks for something that table does not compute -- a setting
the engine ignores, a new variant behind a known model type -- would load, and answer wrong. So the
worker runs a short canned prompt through both before it reports ready (`FusionEngine.from_settings`
with `model.check_on_load`), and `kvfuse models check PATH` runs the same from the command line.

The checks, on one canned prompt (prefix, three chunks, a question: `CHECK_TOKENS` tokens, or the
config's sliding window plus `WINDOW_MARGIN` where that is longer, so every window is crossed:
`prompt_length`) and a short canned continuation:
- `forward`: the engine's full prefill against transformers' forward: the embedding, the hidden state
  after every layer (transformers' `output_hidden_states`), every layer's K/V and the last row's logits;
- `decode`: the continuation decoded token by token through the engine's decode step, each step's
  logits against transformers' forward over prompt + continuation;
- `recovery`: a chunk cached after its context (its keys rotated back to positions 0..n-1 by each
  layer's rope) and moved back into place reproduces the full prefill's cache and logits exactly;
- `fused:<method>`: every selective method at recompute ratio 1.0, chunks cached alone, against the
  engine's full prefill (logits and every layer's K/V); a method that refuses the model is reported
  with its reason, not failed.
A failure names the first layer where the two part. Errors are measured relative to the reference's
RMS, against `tolerance`: what the rounding of the model's dtype allows, not a fixed number.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvfuse.fusion.engine import solo
from kvfuse.fusion.errors import UnsupportedModelError

log = logging.getLogger("kvfuse.fusion")

CHECK_TOKENS = 96  # the canned prompt's length
WINDOW_MARGIN = 48  # the prompt crosses the config's sliding window by this many tokens
DECODE_STEPS = 4
TOLERANCE_FACTOR = 4.0  # headroom over the rounding estimate of `tolerance`
FUSED_METHODS = ("anchor", "a3", "cacheblend", "prophetkv", "epic")
TEXT = ("The harbour town kept its records in a stone archive by the water. Every spring the clerks copied the "
        "ledgers of the previous year, counted the ships that had come and gone, and wrote down the price of "
        "salt, rope and timber. In the year of the long winter the archive flooded, and the oldest books were "
        "dried one page at a time on lines strung across the market square. ")


class ModelCheckError(UnsupportedModelError):
    """The engine computes this model differently from transformers: it must not serve it."""


@dataclass
class CheckResult:
    name: str
    verdict: str  # "ok" | "FAILED" | "refused"
    detail: str
    layer: int | None = None  # where the engine and the reference part (a failure)


@dataclass
class CheckReport:
    model_type: str
    tokens: int
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.verdict != "FAILED" for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.verdict == "FAILED"]

    def lines(self) -> list[str]:
        width = max((len(r.name) for r in self.results), default=0)
        return [f"{r.name:<{width}}  {r.verdict:<7}  {r.detail}" for r in self.results]

    def summary(self) -> str:
        head = (f"{self.model_type}: {len(self.results)} checks on {self.tokens} tokens in {self.seconds:.2f} s: "
                + ("passed" if self.ok else "FAILED"))
        return "\n".join([head, *self.lines()])

    def raise_on_failure(self) -> None:
        if not self.ok:
            first = self.failures[0]
            raise ModelCheckError(f"the engine does not compute this {self.model_type} model as transformers does "
                                  f"({first.name}: {first.detail}); refusing to serve it\n{self.summary()}")


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: bfloat16 2^-8, float16 2^-11, float32 2^-24."""
    return torch.finfo(dtype).eps / 2


def tolerance(dtype: torch.dtype, layers: int, inner: int, step: int = 0) -> float:
    """The RMS-relative error two correct computations of the model in `dtype` may part by, after
    `layers` layers whose inner products run over up to `inner` terms, at decode step `step` (0: a prefill).

    Why this form. Each of the two computations (the engine's and transformers') rounds every op's output
    to the dtype, relative error u (`unit_roundoff`), and accumulates its inner products (the hidden size,
    the MLP's width, the keys attended) in float32, as the CPU's and the GPU's kernels do, which adds
    about sqrt(inner) * u32 for rounding errors of random sign: one op errs by ~ u + sqrt(inner) * u32
    (in bfloat16 and float16 the output rounding dominates, in float32 the accumulation). The two round
    in different orders (other kernels, shapes and summation orders), so their errors are independent:
    along the residual stream they add like a random walk over the layers, ~ sqrt(layers) times one op's.
    A decode step s
    also reads the K/V of the s steps before it, which the engine computed and transformers did not:
    s more independent errors, ~ sqrt(1 + s). `TOLERANCE_FACTOR` is the headroom over that estimate
    (the ratio of measured error to it, over the default model in each dtype and every family's tiny model:
    docs/DESIGN.md, "The load check"). A wrong computation (a missed norm, window or soft-cap) parts by
    orders of magnitude more."""
    per_op = unit_roundoff(dtype) + inner**0.5 * unit_roundoff(torch.float32)
    return TOLERANCE_FACTOR * per_op * (layers * (1 + step)) ** 0.5


def engine_tolerance(engine, tokens: int, step: int = 0) -> float:
    """`tolerance` for `engine`'s model over a prompt of `tokens` tokens (the keys attended)."""
    cfg, tf = engine.tf.config, engine.tf
    inner = max(int(cfg.hidden_size), int(getattr(cfg, "intermediate_size", 0) or 0), tf.num_heads * tf.head_dim,
                tokens + step)
    return tolerance(engine.dtype, tf.num_layers, inner, step)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of the difference over the RMS of the reference (fp32)."""
    ref = ref.float()
    diff = (got.float() - ref).pow(2).mean().sqrt()
    return float(diff / ref.pow(2).mean().sqrt().clamp_min(1e-12))


def first_parting(pairs: list[tuple[str, int | None, torch.Tensor, torch.Tensor]], tol: float | list[float]
                  ) -> tuple[float, tuple[str, int | None, float, float] | None]:
    """(largest error, (what, layer, error, tolerance) of the first pair over its tolerance, or None).
    tol: one for every pair, or one per pair."""
    tols = tol if isinstance(tol, list) else [tol] * len(pairs)
    worst, parted = 0.0, None
    for (what, layer, got, ref), t in zip(pairs, tols, strict=True):
        err = rel_error(got, ref)
        worst = max(worst, err)
        if parted is None and not err <= t:  # NaN parts too
            parted = (what, layer, err, t)
    return worst, parted


def _verdict(engine, name: str, pairs, tol: float | list[float], passed: str) -> CheckResult:
    worst, parted = first_parting(pairs, tol)
    if parted is None:
        shown = f"{min(tol):.1e} to {max(tol):.1e}" if isinstance(tol, list) else f"{tol:.1e}"
        return CheckResult(name, "ok", f"{passed} within {worst:.1e} (tolerance {shown})")
    what, layer, err, t = parted
    where = f"at layer {layer}" if layer is not None else "at the output"
    return CheckResult(name, "FAILED", f"parts {where}: {what} error {err:.2e} > {t:.1e} "
                                       f"({layer_features(engine, layer)})", layer)


def canned_ids(engine, total: int) -> list[int]:
    ids = engine.tokenize(TEXT)
    while len(ids) < total:
        ids = ids + ids
    return ids[:total]


def config_window(config) -> int | None:
    """The sliding window transformers applies to some layer of this config, read from the config alone
    (`sliding_window`, on a layer whose `layer_types` entry is sliding, if the config has them), never
    from the engine's family table: that table is what the check judges, and a table that drops a window
    must still meet a prompt that crosses it. None when no layer has one (or it spans every position)."""
    window = getattr(config, "sliding_window", None)
    if not window or int(window) >= int(config.max_position_embeddings):
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def prompt_length(engine) -> int:
    """`CHECK_TOKENS`, or the config's window plus `WINDOW_MARGIN` where that is longer, so every
    windowed layer's rows see past their window (within the engine's context)."""
    window = config_window(engine.tf.config)
    n = CHECK_TOKENS if window is None else max(CHECK_TOKENS, window + WINDOW_MARGIN)
    return min(n, engine.max_context_tokens - DECODE_STEPS)


def layer_features(engine, layer: int | None) -> str:
    """What the engine computes at `layer` (None: the output) by its family table, for a failure's
    message: so a feature the table lacks or gets wrong shows beside where the two part."""
    tf, fam = engine.tf, engine.family
    if layer is None:
        tied = tf.lm_head.weight is tf.embed_tokens.weight
        cap = f"final soft-cap {tf.final_softcap:g}" if tf.final_softcap is not None else "no final soft-cap"
        return f"the engine's output: final norm, {'tied' if tied else 'untied'} LM head, {cap}"
    window = tf.windows[layer]
    rope = tf.rope_of(layer)
    parts = [f"sliding window {window}" if window is not None else "no window",
             f"rope {rope.rope_type}" + (f" of {rope.layer_type} layers" if rope.layer_type else ""),
             f"attention soft-cap {tf.softcap:g}" if tf.softcap is not None else "no attention soft-cap",
             f"{fam.layout} norms", f"q/k norm per {fam.qk_norm}" if fam.qk_norm else "no q/k norm"]
    return f"the engine's layer {layer}: " + ", ".join(parts)


@torch.inference_mode()
def check_model(engine) -> CheckReport:
    """Run every check on `engine` (a kvfuse.fusion.FusionEngine); the report says what passed, and
    `raise_on_failure()` refuses a model that failed. Logs the verdict and the time it took."""
    t = time.perf_counter()
    n = prompt_length(engine)
    ids = canned_ids(engine, n + DECODE_STEPS)
    report = CheckReport(engine.family.model_type, n)
    ref = _reference(engine, ids)
    overflow = _out_of_range(engine, ref)
    if overflow is not None:  # nothing to compare: the reference itself is inf / NaN
        report.results.append(overflow)
    else:
        report.results.append(_forward(engine, ids[:n], ref))
        report.results.append(_decode(engine, ids, n, ref))
        parts = _parts(n)
        report.results.append(_recovery(engine, ids[:n], parts, ref))
        report.results += _fused(engine, ids[:n], parts)
    report.seconds = time.perf_counter() - t
    log.log(logging.INFO if report.ok else logging.ERROR, "model check %s in %.2f s (%d checks, %d tokens)%s",
            "passed" if report.ok else "FAILED", report.seconds, len(report.results), n,
            "" if report.ok else ":\n" + "\n".join(report.lines()))
    return report


@dataclass
class _Reference:
    hidden: tuple[torch.Tensor, ...]  # transformers' hidden states: embedding, after layers 0..L-2, final (normed)
    logits: torch.Tensor  # [T, vocab] fp32
    keys: list[torch.Tensor]  # per layer [Hkv, T, D]
    values: list[torch.Tensor]


def _reference(engine, ids: list[int]) -> _Reference:
    """transformers' own forward over prompt + continuation: a cache that keeps every layer's keys."""
    from transformers import DynamicCache

    out = engine.model(torch.tensor([ids], device=engine.device), use_cache=True, output_hidden_states=True,
                       past_key_values=DynamicCache())
    layers = out.past_key_values.layers
    return _Reference(tuple(h[0] for h in out.hidden_states), out.logits[0].float(),
                      [layer.keys[0] for layer in layers], [layer.values[0] for layer in layers])


def _out_of_range(engine, ref: _Reference) -> CheckResult | None:
    """A FAILED `range` result when transformers' own forward leaves the dtype's range (inf, then NaN),
    naming the first hidden state that does; None when every one is finite. Some models' residual
    stream grows past float16's largest value (65504): Gemma 3's does (docs/models.md, "Dtypes"), and
    its checkpoints are meant to run in bfloat16 or float32. No engine can serve such a model in that
    dtype, so the check says so instead of reporting a NaN error at some layer."""
    states = [*ref.hidden, ref.logits]
    bad = next((i for i, h in enumerate(states) if not bool(torch.isfinite(h).all())), None)
    if bad is None:
        return None
    where = ("the embedding" if bad == 0 else "the logits" if bad == len(states) - 1
             else f"the hidden state after layer {bad - 1}")
    peak = max(float(h.float().abs().max()) for h in states[:bad]) if bad else float("nan")
    limit = torch.finfo(engine.dtype).max
    return CheckResult("range", "FAILED",
                       f"transformers' own forward in {str(engine.dtype).removeprefix('torch.')} overflows at "
                       f"{where} (the hidden states before it reach {peak:.3g}; the dtype's largest value is "
                       f"{limit:.4g}): the model's activations leave this dtype's range; serve it in bfloat16 "
                       "or float32", None if bad == len(states) - 1 else max(bad - 1, 0))


def _forward(engine, ids: list[int], ref: _Reference) -> CheckResult:
    tf, n = engine.tf, len(ids)
    tol = engine_tolerance(engine, n)
    cache = engine.new_cache(n)
    rows = tf.rows(torch.arange(n, device=engine.device))
    h = tf.embed(torch.tensor(ids, device=engine.device))
    pairs = [("embedding", 0, h[0], ref.hidden[0][:n])]
    for layer in range(tf.num_layers):
        h = tf.layer(cache, layer, h, rows, last_only=layer == tf.num_layers - 1)
        pairs += [("keys", layer, cache.k[layer, :, :n], ref.keys[layer][:, :n]),
                  ("values", layer, cache.v[layer, :, :n], ref.values[layer][:, :n])]
        if layer < tf.num_layers - 1:
            pairs.append(("hidden state", layer, h[0], ref.hidden[layer + 1][:n]))
    pairs.append(("logits", None, tf.logits(h[:, -1])[0], ref.logits[n - 1]))
    return _verdict(engine, "forward", pairs, tol, f"embedding, {tf.num_layers} layers' hidden states and K/V, logits")


def _decode(engine, ids: list[int], n: int, ref: _Reference) -> CheckResult:
    from kvfuse.fusion.types import FusionOptions

    fused = engine.fuse(None, [], ids[:n], FusionOptions(method="vanilla"), max_tokens=DECODE_STEPS)
    # the prompt's next tokens forced through an engine core, the decode every request runs (engine/solo.py)
    logits = solo.forced_logits(engine, fused, ids[n : n + DECODE_STEPS - 1])
    pairs = [("prefill logits", None, logits[0], ref.logits[n - 1])]
    pairs += [(f"step {step} logits", None, logits[step], ref.logits[n + step - 1]) for step in range(1, len(logits))]
    tols = [engine_tolerance(engine, n, step) for step in range(len(pairs))]
    return _verdict(engine, "decode", pairs, tols, f"{DECODE_STEPS - 1} decode steps' logits")


def _parts(n: int) -> list[tuple[int, int]]:
    """[start, stop) of the prefix, three chunks and the question in a prompt of n tokens."""
    prefix, question = max(2, n // 12), max(4, n // 8)
    body = n - prefix - question
    cuts = [prefix, prefix + body // 3, prefix + 2 * body // 3, n - question, n]
    return [(0, prefix)] + [(cuts[i], cuts[i + 1]) for i in range(4)]


def _recovery(engine, ids: list[int], parts, ref: _Reference) -> CheckResult:
    """The last chunk cached after everything before it, its keys rotated to 0..n-1 and moved back by
    position recovery (pie): the full prefill's cache, every layer, and its logits."""
    from kvfuse.fusion.types import FusionOptions

    tol = engine_tolerance(engine, len(ids))
    (_, c0), (q0, _) = parts[-2], parts[-1]
    context, chunk, question = ids[:c0], ids[c0:q0], ids[q0:]
    [before] = engine.precompute([context])
    moved = engine.precompute_after(context, chunk)
    fused = engine.fuse(before, [moved], question, FusionOptions(method="pie"))
    n = len(ids)
    pairs = []
    for layer in range(engine.num_layers):
        pairs += [("keys", layer, fused.cache.k[layer, :, :n], ref.keys[layer][:, :n]),
                  ("values", layer, fused.cache.v[layer, :, :n], ref.values[layer][:, :n])]
    pairs.append(("logits", None, fused.logits, ref.logits[n - 1]))
    return _verdict(engine, "recovery", pairs, tol, f"a chunk moved by {c0} positions: every layer's K/V and the logits")


def _fused(engine, ids: list[int], parts) -> list[CheckResult]:
    from kvfuse.fusion.methods import available_methods, get_method
    from kvfuse.fusion.types import FusionOptions

    tol = engine_tolerance(engine, len(ids))
    kvs = engine.precompute([ids[a:b] for a, b in parts[:-1]])
    question = ids[parts[-1][0] :]
    vanilla = engine.fuse(kvs[0], kvs[1:], question, FusionOptions(method="vanilla"))
    n = len(ids)
    globals_ = [i for i, w in enumerate(engine.tf.windows) if w is None and i >= 1]
    out = []
    for name in [m for m in FUSED_METHODS if m in available_methods()]:
        options = FusionOptions(method=name, recompute_ratio=1.0, edge_tokens=n, edge_tokens_end=n,
                                check_layer=globals_[0] if globals_ and engine.num_layers > 1 else 1)
        if options.check_layer >= engine.num_layers:
            options.check_layer = 0
        reason = get_method(name).refusal(engine, options)
        if reason:
            out.append(CheckResult(f"fused:{name}", "refused", reason))
            continue
        fused = engine.fuse(kvs[0], kvs[1:], question, options)
        pairs = []
        for layer in range(engine.num_layers):
            pairs += [("keys", layer, fused.cache.k[layer, :, :n], vanilla.cache.k[layer, :, :n]),
                      ("values", layer, fused.cache.v[layer, :, :n], vanilla.cache.v[layer, :, :n])]
        pairs.append(("logits", None, fused.logits, vanilla.logits))
        out.append(_verdict(engine, f"fused:{name}", pairs, tol, "ratio 1.0 against the full prefill: K/V and logits"))
    return out
