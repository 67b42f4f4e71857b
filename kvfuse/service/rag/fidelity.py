"""The API side of the quality contract: the ledger of shadow-check verdicts, the ratio held for the target,
and what `GET /v1/fidelity` and the Prometheus metrics report (docs/DESIGN.md, "The quality contract";
docs/usage.md, "The quality contract").

Workers send a `ShadowResult` per check (worker/shadow.py) through the dispatcher's `shadow_sink`; the
ledger counts it per method and prompt-size bucket, feeds the controller (fidelity_control.py) and saves
the controller's state beside the store (`fidelity.state_file` under `data_dir`), stamped with the model's
fingerprint: a restart with the same model resumes the ratios, another model starts over.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfuse.service.rag.fidelity_control import Policy, RatioController, size_bucket, wilson
from kvfuse.service.wire import protocol as P

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.service.metrics import Metrics

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class Tally:
    """Checks of one method (or one method and bucket) since the API started."""

    checks: int = 0  # with an agreement verdict (greedy fused answers)
    agreements: int = 0
    kl_checks: int = 0  # with an answer KL (every check)
    kl_sum: float = 0.0
    dropped: int = 0

    def add(self, msg: P.ShadowResult) -> None:
        if msg.agreed is not None:
            self.checks += 1
            self.agreements += bool(msg.agreed)
        self.kl_checks += 1
        self.kl_sum += msg.answer_kl

    def report(self) -> dict[str, Any]:
        interval = wilson(self.agreements, self.checks)
        return {"shadowed": self.kl_checks, "compared": self.checks, "agreements": self.agreements,
                "agreement": round(self.agreements / self.checks, 6) if self.checks else None,
                "interval_95": [round(x, 6) for x in interval] if interval else None,
                "mean_answer_kl": round(self.kl_sum / self.kl_checks, 8) if self.kl_checks else None,
                "dropped": self.dropped}


def state_path(settings: Settings) -> Path:
    return settings.data_dir / settings.fidelity.state_file


def load_state(path: Path, fingerprint: str) -> dict[str, Any] | None:
    """The saved controller state for this model, or None (none saved, unreadable, or another model's)."""
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("fidelity state %s is unreadable (%s): starting over", path, err)
        return None
    if state.get("version") != STATE_VERSION or state.get("fingerprint") != fingerprint:
        log.info("fidelity state %s is for another model: starting over", path)
        return None
    return state


def save_state(path: Path, fingerprint: str, controller: RatioController, metric: str, **extra: Any) -> None:
    from kvfuse.retriever.files import atomic_write

    state = {"version": STATE_VERSION, "fingerprint": fingerprint, "metric": metric,
             "target_agreement": controller.policy.target, **controller.to_dict(), **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(state, indent=1).encode())


class FidelityLedger:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.fid = settings.fidelity
        self.controller = RatioController(Policy.from_settings(self.fid), settings.fusion.recompute_ratio)
        self.methods: dict[str, Tally] = {}
        self.buckets: dict[tuple[str, str], Tally] = {}
        self.fingerprint: str | None = None
        metrics.fidelity_target.set(self.fid.target_agreement)

    @property
    def holding(self) -> bool:
        return self.fid.target_agreement > 0

    def attach_model(self, fingerprint: str) -> None:
        """The worker's model is known: resume its saved ratios (another model's are dropped)."""
        self.fingerprint = fingerprint
        state = load_state(state_path(self.settings), fingerprint)
        if state is not None:
            if state.get("metric") != self.fid.metric or state.get("target_agreement") != self.fid.target_agreement:
                state = {"holds": [{**h, "checks": 0, "agreements": 0} for h in state.get("holds", [])]}
            self.controller.load(state)
        for (method, bucket), hold in self.controller.holds.items():
            self.metrics.fidelity_ratio.labels(method, bucket).set(hold.ratio)

    # -- ratios ---------------------------------------------------------------------------------------------
    def auto(self, requested: Any) -> bool:
        """Whether a request's `recompute_ratio` means the held one: "auto", or none given while a target
        is held."""
        return requested == "auto" or (requested is None and self.holding)

    def resolve(self, fusion: dict[str, Any], context_tokens: int) -> str | None:
        """Set an "auto" request's `fusion["recompute_ratio"]`: the ratio held for its method and size
        bucket (returned), or the configured ratio when no target is held (None)."""
        if not self.holding:
            fusion["recompute_ratio"] = self.settings.fusion.recompute_ratio
            return None
        bucket = size_bucket(context_tokens, self.fid.size_buckets)
        fusion["recompute_ratio"] = self.controller.ratio(fusion["method"], bucket)
        return bucket

    # -- verdicts -------------------------------------------------------------------------------------------
    def record(self, msg: Any) -> None:
        """A worker's ShadowResult or ShadowDropped (called on the event loop)."""
        m = self.metrics
        if isinstance(msg, P.ShadowDropped):
            self.methods.setdefault(msg.method, Tally()).dropped += 1
            m.shadow_dropped.labels(msg.method).inc()
            return
        if not isinstance(msg, P.ShadowResult):
            return
        bucket = size_bucket(msg.context_tokens, self.fid.size_buckets)
        self.methods.setdefault(msg.method, Tally()).add(msg)
        self.buckets.setdefault((msg.method, bucket), Tally()).add(msg)
        m.shadow_answer_kl.labels(msg.method).observe(msg.answer_kl)
        if msg.agreed is not None:
            m.shadow_queries.labels(msg.method).inc()
            m.shadow_agreements.labels(msg.method).inc(bool(msg.agreed))
        move = self.controller.observe(msg.method, bucket, msg.recompute_ratio, msg.agreed)
        if not self.holding or msg.agreed is None:
            return
        ratio = self.controller.ratio(msg.method, bucket)
        m.fidelity_ratio.labels(msg.method, bucket).set(ratio)
        if move is not None:
            log.info("fidelity: %s in %s %s the recompute ratio to %.3f", msg.method, bucket,
                     "raised" if move == "raise" else "lowered", ratio)
        if self.fingerprint is not None:
            try:
                save_state(state_path(self.settings), self.fingerprint, self.controller, self.fid.metric)
            except OSError as err:
                log.warning("fidelity state not saved: %s", err)

    def report(self) -> dict[str, Any]:
        """GET /v1/fidelity: per method, the checks, the agreement with its 95 % Wilson interval, the mean
        answer KL, and per size bucket the same plus the ratio held."""
        methods = {}
        for method in sorted({*self.methods, *(m for m, _ in self.controller.holds)}):
            entry = self.methods.get(method, Tally()).report()
            buckets = {}
            for (m, bucket), tally in sorted(self.buckets.items()):
                if m == method:
                    buckets[bucket] = tally.report()
            for (m, bucket), hold in sorted(self.controller.holds.items()):
                if m == method:
                    held = wilson(hold.agreements, hold.checks)
                    buckets.setdefault(bucket, Tally().report()).update(
                        ratio_in_use=hold.ratio, checks_at_ratio=hold.checks, agreements_at_ratio=hold.agreements,
                        interval_at_ratio=[round(x, 6) for x in held] if held else None)
            entry["buckets"] = buckets
            methods[method] = entry
        f = self.fid
        return {"metric": f.metric, "shadow_rate": f.shadow_rate, "target_agreement": f.target_agreement,
                "default_ratio": self.controller.start if self.holding else self.settings.fusion.recompute_ratio,
                "size_buckets": list(f.size_buckets), "methods": methods}
