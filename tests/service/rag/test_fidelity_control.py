"""The ratio controller's policy (rag/fidelity_control.py) and the ledger that feeds it (rag/fidelity.py):
pure code, no model. The policy is pinned to its rules: the Wilson interval's formula, a rise when the
interval lies below the target or the judged record cannot clear it, a fall only after enough clear
checks, counts restarting at each move (hysteresis), and state kept with the model's fingerprint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvfuse.config import load_settings
from kvfuse.service.metrics import Metrics
from kvfuse.service.rag.fidelity import FidelityLedger, load_state, save_state, state_path
from kvfuse.service.rag.fidelity_control import Z95, Policy, RatioController, ladder, size_bucket, wilson
from kvfuse.service.wire import protocol as P


def policy(**kw) -> Policy:
    base = dict(target=0.9, min_ratio=0.1, max_ratio=0.5, step=0.1, judge_checks=50, fall_checks=100)
    return Policy(**{**base, **kw})


def feed(c: RatioController, n: int, agreed: bool, method: str = "anchor", bucket: str = "0-1024") -> list:
    return [c.observe(method, bucket, c.ratio(method, bucket), agreed) for _ in range(n)]


def test_wilson_matches_its_formula_and_is_honest_at_the_edges() -> None:
    z = Z95
    for k, n in ((0, 5), (3, 10), (10, 10), (97, 100)):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lo, hi = wilson(k, n)
        assert lo == pytest.approx(max(0.0, centre - half)) and hi == pytest.approx(min(1.0, centre + half))
        assert lo <= p <= hi
    assert wilson(10, 10)[0] == pytest.approx(10 / (10 + z * z))  # all agree: n / (n + z^2)
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] > 0.2  # no agreement is not certainty of 0
    assert wilson(0, 0) is None


def test_buckets_and_ladder() -> None:
    assert [size_bucket(t, [1024, 4096]) for t in (0, 1023, 1024, 4095, 4096, 10**6)] == [
        "0-1024", "0-1024", "1024-4096", "1024-4096", "4096+", "4096+"]
    assert size_bucket(5, []) == "0+"
    assert ladder(0.05, 0.2, 0.05) == [0.05, 0.1, 0.15, 0.2]
    assert ladder(0.0, 1.0, 0.3) == [0.0, 0.3, 0.6, 0.9, 1.0]
    c = RatioController(policy(), 0.15)
    assert c.start == 0.2 and c.snap(0.0) == 0.1 and c.snap(0.9) == 0.5  # up to the ladder, capped


def test_a_failing_ratio_rises_as_soon_as_its_interval_is_below_the_target() -> None:
    c = RatioController(policy(), 0.1)
    assert feed(c, 1, False) == ["raise"]  # 0 of 1: hi = 0.79 < 0.9 already
    assert c.ratio("anchor", "0-1024") == 0.2 and c.hold("anchor", "0-1024").checks == 0  # counts restart
    assert feed(c, 3, True) == [None] * 3
    assert c.ratio("anchor", "1024-4096") == 0.1 and c.ratio("epic", "0-1024") == 0.1  # per method and bucket


def test_a_clean_record_holds_until_judged_then_must_show_the_target() -> None:
    c = RatioController(policy(judge_checks=20), 0.1)
    assert feed(c, 19, True) == [None] * 19  # hi = 1 >= T: no evidence of failure
    # the 20th check: 20/20 gives lo = 0.84 < 0.9, so the record cannot show the target: up one step
    assert feed(c, 1, True) == ["raise"] and c.ratio("anchor", "0-1024") == 0.2
    c = RatioController(policy(judge_checks=40), 0.1)
    assert feed(c, 60, True) == [None] * 60  # 40/40: lo = 0.912 >= 0.9, held
    lo, _ = wilson(60, 60)
    assert lo >= 0.9


def test_it_falls_only_after_enough_clear_checks_and_a_failed_try_waits_again() -> None:
    c = RatioController(policy(judge_checks=40, fall_checks=100), 0.3)
    assert feed(c, 99, True) == [None] * 99
    assert feed(c, 1, True) == ["fall"] and c.ratio("anchor", "0-1024") == 0.2
    feed(c, 1, False)
    assert c.ratio("anchor", "0-1024") == 0.3  # the lower ratio failed at once: back up
    assert feed(c, 99, True) == [None] * 99  # hysteresis: another fall_checks before the next try
    assert feed(c, 1, True) == ["fall"]


def test_bounds_other_ratios_sampled_answers_and_no_target() -> None:
    c = RatioController(policy(), 0.5)
    assert feed(c, 5, False) == [None] * 5 and c.ratio("anchor", "b") == 0.5  # at max_ratio: stays
    c = RatioController(policy(), 0.1)
    assert c.observe("anchor", "b", 0.4, False) is None and c.hold("anchor", "b").checks == 0  # a request's own ratio
    assert c.observe("anchor", "b", 0.1, None) is None and c.hold("anchor", "b").checks == 0  # sampled: KL only
    off = RatioController(policy(target=0.0), 0.1)
    assert feed(off, 10, False) == [None] * 10 and off.ratio("anchor", "b") == 0.1


def test_state_round_trip() -> None:
    c = RatioController(policy(), 0.1)
    feed(c, 1, False)
    feed(c, 3, True)
    d = RatioController(policy(), 0.1)
    d.load(c.to_dict())
    assert d.holds == c.holds
    e = RatioController(policy(step=0.15), 0.1)  # another ladder: the ratio snapped, its counts dropped
    e.load(c.to_dict())
    assert e.hold("anchor", "0-1024").ratio == 0.25 and e.hold("anchor", "0-1024").checks == 0


def _ledger(tmp_path: Path, **fidelity) -> tuple[FidelityLedger, Metrics]:
    settings = load_settings(data_dir=tmp_path, fidelity={"target_agreement": 0.9, "min_ratio": 0.1, "ratio_step": 0.1,
                                                         **fidelity}, fusion={"recompute_ratio": 0.1})
    metrics = Metrics()
    return FidelityLedger(settings, metrics), metrics


def _result(agreed: bool | None, ratio: float = 0.1, kl: float = 0.25, tokens: int = 500) -> P.ShadowResult:
    return P.ShadowResult("anchor", ratio, tokens, agreed, kl, 8)


def test_ledger_counts_reports_and_resolves_auto(tmp_path: Path) -> None:
    ledger, metrics = _ledger(tmp_path)
    ledger.attach_model("fp-a")
    for agreed in (True, True, None, False):
        ledger.record(_result(agreed))
    ledger.record(P.ShadowDropped("anchor"))
    rep = ledger.report()["methods"]["anchor"]
    assert (rep["shadowed"], rep["compared"], rep["agreements"], rep["dropped"]) == (4, 3, 2, 1)
    assert rep["interval_95"] == [round(x, 6) for x in wilson(2, 3)]
    assert rep["mean_answer_kl"] == pytest.approx(0.25)
    # 2 of 3 at 0.1: hi = 0.94, still held; one more failure and the ratio rises
    ledger.record(_result(False))
    assert rep is not None and ledger.report()["methods"]["anchor"]["buckets"]["0-1024"]["ratio_in_use"] == 0.2
    sample = lambda name, **labels: metrics.registry.get_sample_value(name, labels)  # noqa: E731
    assert sample("kvfuse_shadow_queries_total", method="anchor") == 4
    assert sample("kvfuse_shadow_agreements_total", method="anchor") == 2
    assert sample("kvfuse_shadow_answer_kl_count", method="anchor") == 5
    assert sample("kvfuse_shadow_dropped_total", method="anchor") == 1
    assert sample("kvfuse_fidelity_ratio", method="anchor", bucket="0-1024") == 0.2
    fusion = {"method": "anchor", "recompute_ratio": 0.1}
    assert ledger.auto(None) and ledger.auto("auto") and not ledger.auto(0.3)
    assert ledger.resolve(fusion, 500) == "0-1024" and fusion["recompute_ratio"] == 0.2
    assert ledger.resolve(fusion, 5000) == "4096+" and fusion["recompute_ratio"] == 0.1  # another bucket


def test_state_persists_with_the_fingerprint_and_resets_on_another_model(tmp_path: Path) -> None:
    ledger, _ = _ledger(tmp_path)
    ledger.attach_model("fp-a")
    ledger.record(_result(False))
    assert load_state(state_path(ledger.settings), "fp-a")["holds"][0]["ratio"] == 0.2
    again, _ = _ledger(tmp_path)
    again.attach_model("fp-a")
    assert again.controller.ratio("anchor", "0-1024") == 0.2  # a restart resumes
    other, _ = _ledger(tmp_path)
    other.attach_model("fp-b")
    assert other.controller.ratio("anchor", "0-1024") == 0.1  # another model starts over
    assert load_state(state_path(ledger.settings), "fp-b") is None
    save_state(state_path(ledger.settings), "fp-a", again.controller, "text")
    retarget, _ = _ledger(tmp_path)  # saved under another metric: the ratio kept, its counts dropped
    retarget.attach_model("fp-a")
    assert retarget.controller.hold("anchor", "0-1024").ratio == 0.2
    assert retarget.controller.hold("anchor", "0-1024").checks == 0


def test_a_request_may_ask_for_the_held_ratio_by_name() -> None:
    from kvfuse.service.api.schemas import QueryIn, validate
    from kvfuse.service.errors import APIError

    assert validate(QueryIn, {"query": "q", "fusion": {"recompute_ratio": "auto"}}).fusion.recompute_ratio == "auto"
    assert validate(QueryIn, {"query": "q", "fusion": {"recompute_ratio": 0.3}}).fusion.recompute_ratio == 0.3
    for bad in ("fast", 1.5, -0.1):
        with pytest.raises(APIError) as err:
            validate(QueryIn, {"query": "q", "fusion": {"recompute_ratio": bad}})
        assert err.value.status == 422 and err.value.param.startswith("fusion.recompute_ratio")
