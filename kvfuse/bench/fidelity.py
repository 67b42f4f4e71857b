"""The fidelity benchmark: every method on the same examples as `vanilla`, in the same run.

In-process (the default), the engine is loaded once, each example's prefix and chunks are precomputed
once and that KV is reused by every method. Each method is compared with vanilla on the same example: by
the first-token KL, the answer KL over vanilla's whole answer (teacher-forced, kvfuse.bench.agreement) and
answer agreement (kvfuse.answer_match: the same normalised answer, and the same extracted value).

The model's floor: `vanilla_swap` (FLOOR) is vanilla again on the example with two documents that hold
no fact swapped, a change that should not move the answer. How often it does is the model's own noise;
each method's value agreement is paired with it on the same examples (`floor_gap`, its bootstrap
interval, `within_floor`). Its second perturbation, `vanilla_fp8` (FLOOR_FP8), is vanilla with its own
KV of the documents rounded to fp8 (kvfuse/kv_formats.py: e4m3, a scale per token and head) before the
question is prefilled over it: the storage error alone, no fusion. See docs/DESIGN.md, "Fidelity
measures".

KV formats at rest (`--kv-formats`): each method runs once per format, labelled `method[format]`, its
chunks' KV stored in that format and read back through the engine's own loader; each format's row is
paired with the same method's float16 row on the same examples (`vs_float16_gap`: float16's value
agreement minus the format's, `answer_kl_vs_float16`: the ratio of their answer KLs), so what a format
costs is seen apart from what fusion costs.

Vanilla's outputs are kept on disk (kvfuse.bench.reference) and reused by later runs over the same
examples. With `--url` the same examples go through a live server's REST API instead
(kvfuse.bench.http_backend); no KL and no floor there.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvfuse.answer_match import same_answer
from kvfuse.bench.agreement import bootstrap_ci, paired_ratio_ci
from kvfuse.bench.reference import Reference
from kvfuse.bench.tasks import Example

FLOOR = "vanilla_swap"  # vanilla with two documents that hold no fact swapped: the model's own noise
FLOOR_FP8 = "vanilla_fp8"  # vanilla with its own documents' KV rounded to fp8: the floor's second perturbation
STORAGE_BASELINE = "float16"  # the KV format every other one is paired with
# A method is within the floor when the upper end of the 95 % interval of (floor's value agreement minus
# the method's, paired per example) is at most this: it changes answers at most this much more often.
FLOOR_MARGIN = 0.05
# ... and only on at least this many examples: below it a bootstrap interval of per-example 0/1 differences
# is often degenerate (all equal: a zero-width interval) and would claim what the run cannot show.
FLOOR_MIN_N = 20

# Methods whose recompute share is fixed by what they are, not by the ratio knob: run once, reported at
# this ratio; None = set by the chunk structure (epic's edge tokens), reported as the measured share.
# Every other method runs at each requested ratio.
FIXED_RATIO: dict[str, float | None] = {"vanilla": 1.0, FLOOR: 1.0, FLOOR_FP8: 1.0, "full_reuse": 0.0, "pie": 0.0,
                                         "epic": None, "kvlink": None}
FIDELITY_COLUMNS = (
    "task", "method", "ratio", "n", "score", "score_vs_vanilla", "score_vs_vanilla_ci", "gained_vs_vanilla",
    "lost_vs_vanilla", "kl_vs_vanilla", "answer_kl_vs_vanilla", "answer_kl_vs_vanilla_ci",
    "same_answer_vs_vanilla", "same_answer_vs_vanilla_ci", "same_value_vs_vanilla", "same_value_vs_vanilla_ci",
    "floor_gap", "floor_gap_ci", "within_floor", "vs_float16_gap", "vs_float16_gap_ci", "answer_kl_vs_float16",
    "answer_kl_vs_float16_ci", "ttft_vs_float16", "ttft_s_median", "ttft_vs_vanilla",
    "context_tokens_mean", "recomputed_share", "kv_loaded_share", "fused_cache_tokens_mean",
)
SCORE_EPS = 1e-9  # scores closer than this count as equal (F1 is a float)


def with_format(method: str, kv_format: str | None) -> str:
    """The label of `method` run on chunks stored in `kv_format` (None: the KV as computed)."""
    return method if kv_format is None else f"{method}[{kv_format}]"


def split_format(label: str) -> tuple[str, str | None]:
    """(method, KV format or None) of a label `with_format` made."""
    if label.endswith("]") and "[" in label:
        method, fmt = label[:-1].split("[", 1)
        return method, fmt
    return label, None


def method_plan(methods: Sequence[str], ratios: Sequence[float], *, floor: bool = True,
                kv_formats: Sequence[str] = ()) -> list[tuple[str, float | None]]:
    """(method, ratio) pairs to run, vanilla first (every other figure is relative to it), then the floor
    (FLOOR, FLOOR_FP8) unless `floor` is off; with `kv_formats`, each method once per format
    (`with_format`), float16 first."""
    plan: list[tuple[str, float | None]] = [("vanilla", FIXED_RATIO["vanilla"])]
    if floor:
        plan += [(FLOOR, FIXED_RATIO[FLOOR]), (FLOOR_FP8, FIXED_RATIO[FLOOR_FP8])]
    formats = sorted(kv_formats, key=lambda f: f != STORAGE_BASELINE) or [None]
    for m in methods:
        if m in ("vanilla", FLOOR, FLOOR_FP8):
            continue
        for fmt in formats:
            label = with_format(m, fmt)
            plan += [(label, FIXED_RATIO[m])] if m in FIXED_RATIO else [(label, float(r)) for r in ratios]
    return plan


@dataclass
class Outcome:
    """One method on one example."""

    task: str
    example_id: str
    method: str
    ratio: float | None  # None: fixed by the method (see FIXED_RATIO)
    prediction: str
    score: float
    ttft_s: float
    context_tokens: int
    recomputed_tokens: int | None
    kl_vs_vanilla: float | None = None  # first answer token
    answer_kl_vs_vanilla: float | None = None  # mean over vanilla's answer, teacher-forced
    kv_loaded_share: float | None = None  # share of the chunks' KV bytes read (samkv: selected blocks only)
    fused_cache_tokens: int | None = None  # positions in the fused cache (samkv: the sparse cache)
    # Signals known at query time, without vanilla (what a quality gate could act on): the fused first
    # token's probability margin over the runner-up and its entropy (nats), and anchor's evidence coverage.
    first_margin: float | None = None
    first_entropy: float | None = None
    evidence_coverage: float | None = None
    reference: Reference | None = None  # transient (in-process vanilla only): what the others compare with


def neutral_swap(ex: Example) -> list[int] | None:
    """The chunk order of the floor: two chunks that hold no fact swapped (chosen by a generator seeded
    with the example's id), the rest in place; None when fewer than two hold none or where the facts
    are not known (MuSiQue)."""
    if not ex.fact_chunks:
        return None
    free = [i for i in range(len(ex.chunks)) if i not in set(ex.fact_chunks)]
    if len(free) < 2:
        return None
    a, b = random.Random(f"floor/{ex.id}").sample(free, 2)
    order = list(range(len(ex.chunks)))
    order[a], order[b] = b, a
    return order


def first_token_signals(logits: Any) -> tuple[float, float]:
    """(top-1 probability minus top-2, entropy in nats) of a first-token distribution."""
    import torch

    logp = torch.log_softmax(logits.double().flatten(), dim=-1)
    top = torch.topk(logp.exp(), 2).values
    return float(top[0] - top[1]), float(-(logp.exp() * logp).sum())


def kl_divergence(ref_logits: Any, logits: Any) -> float:
    """KL(P_vanilla || P_method) of the first-token distributions, in nats."""
    import torch

    p_log = torch.log_softmax(ref_logits.double().flatten(), dim=-1)
    q_log = torch.log_softmax(logits.double().flatten(), dim=-1)
    return float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))


def run_examples(
    backend: Any, examples: Sequence[Example], plan: Sequence[tuple[str, float | None]],
    on_example: Callable[[list[Outcome]], None] | None = None,
) -> list[Outcome]:
    """Run every (method, ratio) of `plan` on every example; vanilla must come first in `plan`.
    `on_example(outcomes so far)` runs after each example (the CLI checkpoints its JSON there)."""
    from tqdm import tqdm

    assert plan and plan[0][0] == "vanilla", "vanilla runs first: the other methods are compared with it"
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(examples) * len(plan), file=sys.stderr, unit="run", dynamic_ncols=True)
    try:
        for ex in examples:
            prepared = backend.prepare(ex)
            try:
                ref = None
                for method, ratio in plan:
                    bar.set_description(f"{ex.task} {method}" + (f"@{ratio:g}" if ratio is not None else ""))
                    out = backend.run(ex, prepared, method, ratio, reference=ref)
                    bar.update(1)
                    if out is None:  # the floor where the example has no neutral change
                        continue
                    if method == "vanilla":
                        ref = out.reference
                    out.reference = None
                    outcomes.append(out)
            finally:
                backend.finish(ex, prepared)
            if on_example is not None:
                on_example(outcomes)
    finally:
        bar.close()
    return outcomes


def median(xs: Iterable[float | None]) -> float | None:
    """Median of the values given (None values skipped); None when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _mean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def aggregate(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per task × method × ratio; `*_vs_vanilla` against vanilla on the same examples."""
    groups: dict[tuple[str, str, float | None], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.task, o.method, o.ratio), []).append(o)
    vanilla = {(o.task, o.example_id): o for o in outcomes if o.method == "vanilla"}
    floors = {(o.task, o.example_id): o for o in outcomes if o.method == FLOOR}
    rows = []
    for (task, method, ratio), outs in groups.items():
        refs = [vanilla.get((task, o.example_id)) for o in outs]
        ref_score = _mean(r.score for r in refs if r is not None)
        ref_ttft = median(r.ttft_s for r in refs if r is not None)
        score = _mean(o.score for o in outs) or 0.0
        ttft = median(o.ttft_s for o in outs)
        if method == "vanilla":
            score_vs = 1.0
        else:
            score_vs = score / ref_score if ref_score else None
        same = [float(same_answer(o.prediction, r.prediction, "text"))
                for o, r in zip(outs, refs, strict=True) if r is not None]
        value = [float(same_answer(o.prediction, r.prediction, "value"))
                 for o, r in zip(outs, refs, strict=True) if r is not None]
        answer_kl = [o.answer_kl_vs_vanilla for o in outs if o.answer_kl_vs_vanilla is not None]
        pairs = [(o.score, r.score) for o, r in zip(outs, refs, strict=True) if r is not None]
        ci = None if method == "vanilla" else paired_ratio_ci([a for a, _ in pairs], [b for _, b in pairs])
        recomputed = [o.recomputed_tokens / o.context_tokens for o in outs
                      if o.recomputed_tokens is not None and o.context_tokens]
        share = _mean(recomputed)
        rows.append({
            "task": task, "method": method,
            "ratio": ratio if ratio is not None else round(share or 0.0, 3),  # measured, for fixed methods
            "n": len(outs), "score": score,
            "score_vs_vanilla": score_vs,
            "score_vs_vanilla_ci": list(ci) if ci is not None else None,
            # examples where the method scored above / below vanilla on the same example
            "gained_vs_vanilla": sum(a > b + SCORE_EPS for a, b in pairs),
            "lost_vs_vanilla": sum(a < b - SCORE_EPS for a, b in pairs),
            "kl_vs_vanilla": _mean(o.kl_vs_vanilla for o in outs),
            "answer_kl_vs_vanilla": _mean(answer_kl),
            "answer_kl_vs_vanilla_ci": None if method == "vanilla" else _interval(bootstrap_ci(answer_kl)),
            # same normalised answer / same extracted value (kvfuse.answer_match) as vanilla on the example
            "same_answer_vs_vanilla": sum(same) / len(same) if same else None,
            "same_answer_vs_vanilla_ci": None if method == "vanilla" else _interval(bootstrap_ci(same)),
            "same_value_vs_vanilla": sum(value) / len(value) if value else None,
            "same_value_vs_vanilla_ci": None if method == "vanilla" else _interval(bootstrap_ci(value)),
            **floor_pairing(method, outs, vanilla, floors),
            **storage_pairing(method, ratio, outs, vanilla, groups),
            "ttft_s_median": ttft,
            "ttft_vs_vanilla": ttft / ref_ttft if ttft is not None and ref_ttft else None,
            "context_tokens_mean": _mean(o.context_tokens for o in outs),
            "recomputed_share": share,
            "kv_loaded_share": _mean(o.kv_loaded_share for o in outs),
            "fused_cache_tokens_mean": _mean(o.fused_cache_tokens for o in outs),
        })
    return rows


def floor_pairing(method: str, outs: Sequence[Outcome], vanilla: dict, floors: dict) -> dict[str, Any]:
    """The method's value agreement against the floor's on the same examples: the mean of (floor agrees
    − method agrees) per example, its bootstrap interval, and `within_floor`: "yes" when the interval's
    upper end is at most FLOOR_MARGIN on at least FLOOR_MIN_N examples, "no" when even the mean is above
    the margin, "not shown" between (the run is too small to tell)."""
    if method in ("vanilla", FLOOR):
        return {"floor_gap": None, "floor_gap_ci": None, "within_floor": None}
    gaps = []
    for o in outs:
        ref, fl = vanilla.get((o.task, o.example_id)), floors.get((o.task, o.example_id))
        if ref is not None and fl is not None:
            gaps.append(float(same_answer(fl.prediction, ref.prediction, "value"))
                        - float(same_answer(o.prediction, ref.prediction, "value")))
    if not gaps:
        return {"floor_gap": None, "floor_gap_ci": None, "within_floor": None}
    gap, ci = sum(gaps) / len(gaps), bootstrap_ci(gaps)
    shown = ci is not None and ci[1] <= FLOOR_MARGIN and len(gaps) >= FLOOR_MIN_N
    within = "yes" if shown else "no" if gap > FLOOR_MARGIN else "not shown"
    return {"floor_gap": gap, "floor_gap_ci": _interval(ci), "within_floor": within}


def storage_pairing(label: str, ratio: float | None, outs: Sequence[Outcome], vanilla: dict, groups: dict
                    ) -> dict[str, Any]:
    """A KV format's row against the same method's float16 row on the same examples: float16's value
    agreement minus the format's (mean and bootstrap interval), the ratio of their answer KLs and of their
    median TTFTs. None for rows with no format, and for float16's own."""
    method, fmt = split_format(label)
    none = {"vs_float16_gap": None, "vs_float16_gap_ci": None, "answer_kl_vs_float16": None,
            "answer_kl_vs_float16_ci": None, "ttft_vs_float16": None}
    if fmt is None or fmt == STORAGE_BASELINE or not outs:
        return none
    base = {o.example_id: o for o in groups.get((outs[0].task, with_format(method, STORAGE_BASELINE), ratio), [])}
    pairs = [(o, base[o.example_id]) for o in outs if o.example_id in base]
    if not pairs:
        return none
    gaps = []
    for o, b in pairs:
        ref = vanilla.get((o.task, o.example_id))
        if ref is not None:
            gaps.append(float(same_answer(b.prediction, ref.prediction, "value"))
                        - float(same_answer(o.prediction, ref.prediction, "value")))
    kls = [(o.answer_kl_vs_vanilla, b.answer_kl_vs_vanilla) for o, b in pairs
           if o.answer_kl_vs_vanilla is not None and b.answer_kl_vs_vanilla is not None]
    mean_b = _mean(b for _, b in kls)
    ttft_b = median(b.ttft_s for _, b in pairs)
    return {"vs_float16_gap": sum(gaps) / len(gaps) if gaps else None, "vs_float16_gap_ci": _interval(bootstrap_ci(gaps)),
            "answer_kl_vs_float16": _mean(a for a, _ in kls) / mean_b if kls and mean_b else None,
            "answer_kl_vs_float16_ci": _interval(paired_ratio_ci([a for a, _ in kls], [b for _, b in kls])),
            "ttft_vs_float16": median(o.ttft_s for o, _ in pairs) / ttft_b if ttft_b else None}


def _interval(ci: tuple[float, float] | None) -> list[float] | None:
    return list(ci) if ci is not None else None


def outcome_dicts(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(o).items() if k != "reference"} for o in outcomes]
