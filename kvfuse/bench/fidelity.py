"""The fidelity benchmark: every method on the same examples as `vanilla`, in the same run.

In-process (the default), the engine is loaded once, each example's prefix and chunks are precomputed
once and that KV is reused by every method; the first-token distribution of each method is compared
with vanilla's (KL). With `--url` the same examples go through a live server's REST API instead
(documents ingested, then queried with explicit `document_ids` and `fusion`); no KL there.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Example

# Methods whose recompute share is fixed by what they are, not by the ratio knob: run once, reported at
# this ratio; None = set by the chunk structure (epic's edge tokens), reported as the measured share.
# Every other method runs at each requested ratio.
FIXED_RATIO: dict[str, float | None] = {"vanilla": 1.0, "full_reuse": 0.0, "pie": 0.0, "epic": None,
                                         "kvlink": None}
FIDELITY_COLUMNS = (
    "task", "method", "ratio", "n", "score", "score_vs_vanilla", "score_vs_vanilla_ci", "gained_vs_vanilla",
    "lost_vs_vanilla", "kl_vs_vanilla", "same_answer_vs_vanilla", "ttft_s_median", "ttft_vs_vanilla",
    "context_tokens_mean", "recomputed_share", "kv_loaded_share", "fused_cache_tokens_mean",
)
SCORE_EPS = 1e-9  # scores closer than this count as equal (F1 is a float)
# The interval around score / vanilla: a paired percentile bootstrap over the examples (a resample draws
# examples, each with its method and vanilla score). Seeded, so a report re-rendered from the same JSON
# shows the same interval.
CI_LEVEL = 0.95
CI_RESAMPLES = 2000
CI_SEED = 0


def method_plan(methods: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, float | None]]:
    """(method, ratio) pairs to run, vanilla first (every other figure is relative to it)."""
    plan: list[tuple[str, float | None]] = [("vanilla", FIXED_RATIO["vanilla"])]
    for m in methods:
        if m == "vanilla":
            continue
        plan += [(m, FIXED_RATIO[m])] if m in FIXED_RATIO else [(m, float(r)) for r in ratios]
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
    kl_vs_vanilla: float | None = None
    kv_loaded_share: float | None = None  # share of the chunks' KV bytes read (samkv: selected blocks only)
    fused_cache_tokens: int | None = None  # positions in the fused cache (samkv: the sparse cache)
    first_token_logprobs: Any = None  # transient (in-process only): vanilla's reference for KL


def kl_divergence(ref_logits: Any, logits: Any) -> float:
    """KL(P_vanilla || P_method) of the first-token distributions, in nats."""
    import torch

    p_log = torch.log_softmax(ref_logits.double().flatten(), dim=-1)
    q_log = torch.log_softmax(logits.double().flatten(), dim=-1)
    return float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))


class EngineBackend:
    """The fusion engine in this process: load once, precompute each example once."""

    def __init__(self, settings: Any, *, max_tokens: int | None):
        """max_tokens: answer budget for every example (None: each example's own)."""
        from kvfuse.fusion import FusionEngine, FusionOptions, GenerationOptions

        m = settings.model
        self.settings = settings
        self.engine = FusionEngine.from_settings(settings, max_context_tokens=0)
        self._options_cls = FusionOptions
        self.max_tokens = max_tokens
        self.gen = GenerationOptions(max_tokens=max_tokens or 32, temperature=0.0, top_p=1.0)
        self.system_prompt = m.system_prompt

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def methods(self) -> list[str]:
        from kvfuse.fusion import available_methods

        return list(available_methods())

    def options(self, method: str, ratio: float | None) -> Any:
        # Every knob but method and ratio comes from config.fusion (same defaults as the service).
        names = {f.name for f in fields(self._options_cls)}
        base = {k: v for k, v in self.settings.fusion.model_dump().items() if k in names}
        base["method"] = method
        if ratio is not None:
            base["recompute_ratio"] = ratio
        return self._options_cls(**base)

    def prepare(self, ex: Example) -> Any:
        prefix_ids, question_ids = self.engine.prompt_parts(ex.question, self.system_prompt)
        if ex.answer_prefix:  # continues the assistant turn: more question tokens, always recomputed
            question_ids = question_ids + self.engine.tokenize(ex.answer_prefix)
        chunk_ids = [self.engine.tokenize(c) for c in ex.chunks]
        kvs = self.engine.precompute([prefix_ids, *chunk_ids])
        return kvs[0], kvs[1:], question_ids

    def run(self, ex: Example, prepared: Any, method: str, ratio: float | None) -> Outcome:
        prefix, chunks, question_ids = prepared
        opts = self.options(method, ratio)
        budget = self.max_tokens or ex.max_tokens
        self.ingest_artifacts(method, chunks)
        text, logits, ttft_s, stats = self.greedy(prefix, chunks, question_ids, opts, budget)
        share, cache_tokens = loaded_share_and_cache(method, stats)
        return Outcome(
            task=ex.task, example_id=ex.id, method=method, ratio=ratio, prediction=text.strip(),
            score=score_answer(ex.metric, text, ex.answers), ttft_s=ttft_s,
            context_tokens=int(stats["context_tokens"]), recomputed_tokens=int(stats["recomputed_tokens"]),
            first_token_logprobs=logits, kv_loaded_share=share, fused_cache_tokens=cache_tokens,
        )

    def ingest_artifacts(self, method: str, chunks: Any) -> None:
        """What ingest computes besides the KV, computed before the timed prefill as the service has it
        stored (samkv's per-chunk analysis, memoised by content in this process)."""
        from kvfuse.fusion.methods import get_method

        if get_method(method).own_pipeline:
            from kvfuse.fusion.methods.samkv import artifacts_for
            from kvfuse.fusion.sparse.source import MemorySource

            for c in chunks:
                artifacts_for(self.engine, MemorySource(c))

    def greedy(self, prefix: Any, chunks: Any, question_ids: list[int], opts: Any,
               max_tokens: int) -> tuple[str, Any, float, dict]:
        """Greedy answer from one fused prefill: its logits give both the first-token distribution (for
        KL) and the first token. `engine.generate` would fuse a second time to get the same answer, so
        the loop is repeated here with the engine's own `fuse`/`decode_step`/stop tokens; TTFT is
        measured as generate measures it (start of fuse to the first token chosen)."""
        import torch

        engine = self.engine
        t0 = time.perf_counter()
        fused = engine.fuse(prefix, chunks, question_ids, opts, max_tokens=max_tokens)
        token = int(torch.argmax(fused.logits))
        ttft_s = time.perf_counter() - t0
        generated: list[int] = []
        while token not in engine.stop_token_ids:
            generated.append(token)
            if len(generated) >= max_tokens:
                break
            token = int(torch.argmax(engine.decode_step(fused.cache, token)))
        text = engine.tokenizer.decode(generated, skip_special_tokens=True)
        return text, fused.logits.detach().float().cpu(), ttft_s, fused.stats

    def finish(self, ex: Example, prepared: Any) -> None:
        return None


def loaded_share_and_cache(method: str, stats: dict) -> tuple[float, int]:
    """(share of the chunks' stored KV bytes the prefill read, fused cache positions) from a prefill's
    stats: a method that reports them (samkv) is taken at its word; vanilla reads no KV; every other
    method reads all of it into a cache of the whole prompt."""
    cache = stats.get("fused_cache_tokens", stats["prefix_tokens"] + stats["context_tokens"] + stats["question_tokens"])
    if "kv_loaded_bytes" in stats:
        total = stats["kv_total_bytes"]
        return (stats["kv_loaded_bytes"] / total if total else 0.0), int(cache)
    return (0.0 if method == "vanilla" else 1.0), int(cache)


class HttpBackend:
    """A live kvfuse server: each example's chunks are ingested as documents, queried with explicit
    `document_ids` and `fusion`, then deleted. The API has no way to start the assistant's answer, so
    the answer prefix is not given here: answers run longer and scores are not comparable with an
    in-process run (they are comparable across methods of the same run)."""

    def __init__(self, url: str, *, max_tokens: int | None, api_key: str | None, tokenizer: Any, timeout_s: float):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer

    def methods(self) -> list[str]:
        # The server validates names against the same registry; a method it lacks answers 422.
        from kvfuse.fusion import available_methods

        return list(available_methods())

    def _check(self, resp: Any) -> Any:
        if resp.status_code >= 400:
            raise RuntimeError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
        return resp.json()

    def prepare(self, ex: Example) -> list[str]:
        ids = [f"bench-{ex.id}-{j}" for j in range(len(ex.chunks))]
        docs = [{"id": i, "text": t, "on_conflict": "overwrite"} for i, t in zip(ids, ex.chunks, strict=True)]
        self._check(self.client.post("/v1/documents", params={"wait": "true"}, json={"documents": docs}))
        return ids

    def run(self, ex: Example, prepared: list[str], method: str, ratio: float | None) -> Outcome:
        fusion: dict[str, Any] = {"method": method}
        if ratio is not None:
            fusion["recompute_ratio"] = ratio
        body = {
            "query": ex.question, "document_ids": prepared, "stream": False,
            "max_tokens": self.max_tokens or ex.max_tokens,
            "temperature": 0.0, "fusion": fusion,
        }
        out = self._check(self.client.post("/v1/query", json=body))
        usage = out.get("usage", {})
        return Outcome(
            task=ex.task, example_id=ex.id, method=method, ratio=ratio, prediction=out["answer"].strip(),
            score=score_answer(ex.metric, out["answer"], ex.answers),
            ttft_s=float(out["timings"]["ttft_ms"]) / 1000.0,
            context_tokens=int(usage["context_tokens"]),
            recomputed_tokens=usage.get("recomputed_tokens"),
        )

    def finish(self, ex: Example, prepared: list[str]) -> None:
        for doc_id in prepared:
            self.client.delete(f"/v1/documents/{doc_id}")


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
                    out = backend.run(ex, prepared, method, ratio)
                    if method == "vanilla":
                        ref = out.first_token_logprobs
                    if ref is not None and out.first_token_logprobs is not None:
                        out.kl_vs_vanilla = kl_divergence(ref, out.first_token_logprobs)
                    out.first_token_logprobs = None
                    outcomes.append(out)
                    bar.update(1)
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


def paired_ratio_ci(scores: Sequence[float], refs: Sequence[float], *, level: float = CI_LEVEL,
                    resamples: int = CI_RESAMPLES, seed: int = CI_SEED) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of mean(scores) / mean(refs) over paired examples. None when there
    are fewer than two pairs or vanilla scores 0 in too many resamples to leave an interval."""
    n = len(scores)
    if n < 2 or n != len(refs):
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ref = sum(refs[i] for i in idx)
        if ref > 0:
            ratios.append(sum(scores[i] for i in idx) / ref)
    if len(ratios) < resamples * level:  # vanilla's score is mostly 0: no meaningful interval
        return None
    ratios.sort()
    tail = (1.0 - level) / 2
    lo = ratios[int(tail * (len(ratios) - 1))]
    hi = ratios[int(round((1.0 - tail) * (len(ratios) - 1)))]
    return lo, hi


def aggregate(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per task × method × ratio; `*_vs_vanilla` against vanilla on the same examples."""
    groups: dict[tuple[str, str, float | None], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.task, o.method, o.ratio), []).append(o)
    vanilla = {(o.task, o.example_id): o for o in outcomes if o.method == "vanilla"}
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
        same = [o.prediction == r.prediction for o, r in zip(outs, refs, strict=True) if r is not None]
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
            "same_answer_vs_vanilla": sum(same) / len(same) if same else None,
            "ttft_s_median": ttft,
            "ttft_vs_vanilla": ttft / ref_ttft if ttft is not None and ref_ttft else None,
            "context_tokens_mean": _mean(o.context_tokens for o in outs),
            "recomputed_share": share,
            "kv_loaded_share": _mean(o.kv_loaded_share for o in outs),
            "fused_cache_tokens_mean": _mean(o.fused_cache_tokens for o in outs),
        })
    return rows


def outcome_dicts(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(o).items() if k != "first_token_logprobs"} for o in outcomes]
