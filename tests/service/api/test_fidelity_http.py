"""The quality contract over real HTTP (docs/usage.md, "The quality contract"): a real server, the real
default model. Shadow checks at rate 1 report the agreements one counts by asking for each vanilla
answer separately; with a target and a deliberately lossy method the held ratio rises until the live
estimate meets the target, every answer says the ratio it used, and the ratio survives a restart."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_helpers import API_KEY, ServerProcess, ingest, make_client, serving, until

from kvfuse.answer_match import same_answer
from kvfuse.bench import tasks

pytestmark = pytest.mark.slow

N_DOCS = 5  # two questions each: 10 queries
MAX_TOKENS = 12
BASE_ENV = {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_GENERATION__MAX_TOKENS": str(MAX_TOKENS),
            "KVFUSE_MODEL__THREADS": "1", "KVFUSE_FIDELITY__SHADOW_RATE": "1.0"}


def corpus() -> tuple[list[dict], list[tuple[str, list[str]]]]:
    """N_DOCS short documents of four keyed numbers each (the fidelity benchmark's multikey facts) and two
    questions on each, asked over its document and the next one."""
    docs, questions = [], []
    for i in range(N_DOCS):
        f = tasks.FACTS["multikey"](random.Random(f"contract/{i}"))
        docs.append({"id": f"facts-{i}", "text": " ".join(f.facts)})
        for fact in f.facts[:2]:
            key = fact.split(" for ")[1].split(" is")[0]
            questions.append((f"What is the special magic number for {key}?", [f"facts-{i}", f"facts-{(i + 1) % N_DOCS}"]))
    return docs, questions


def fidelity(c: httpx.Client, method: str = "anchor") -> dict:
    body = c.get("/v1/fidelity")
    assert body.status_code == 200, body.text
    return body.json()["methods"].get(method, {})


def ask(c: httpx.Client, question: str, ids: list[str], **fusion) -> dict:
    body = {"query": question, "document_ids": ids, **({"fusion": fusion} if fusion else {})}
    resp = c.post("/v1/query", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def questions() -> list[tuple[str, list[str]]]:
    return corpus()[1]


@pytest.fixture(scope="module")
def shadowing(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with serving(tmp_path_factory.mktemp("shadow"), BASE_ENV, setup=lambda c: ingest(c, corpus()[0])) as h:
        yield h


def test_shadow_checks_report_the_agreements_of_separately_requested_vanilla_answers(shadowing, questions) -> None:
    with make_client(shadowing.server) as c:
        expected = 0
        for q, ids in questions:
            fused = ask(c, q, ids, method="anchor")
            vanilla = ask(c, q, ids, method="vanilla")
            assert fused["fusion"] == {"method": "anchor", "recompute_ratio": 0.15, "ratio_source": "config",
                                       "size_bucket": None}
            expected += same_answer(fused["answer"], vanilla["answer"], "value")
        # a sampled answer is checked for its answer KL only
        c.post("/v1/query", json={"query": questions[0][0], "document_ids": questions[0][1], "temperature": 0.8,
                                  "seed": 3}).raise_for_status()
        n = len(questions)
        rep = until(lambda: (r := fidelity(c)).get("shadowed") == n + 1 and r, 300, "every shadow check reported")
        assert (rep["compared"], rep["agreements"], rep["dropped"]) == (n, expected, 0)
        assert rep["mean_answer_kl"] > 0
        lo, hi = rep["interval_95"]
        assert lo <= expected / n <= hi
        assert "vanilla" not in c.get("/v1/fidelity").json()["methods"]  # the full prefill is never shadowed
        text = c.get("/metrics").text
        assert f'kvfuse_shadow_queries_total{{method="anchor"}} {float(n)}' in text
        assert f'kvfuse_shadow_agreements_total{{method="anchor"}} {float(expected)}' in text
        assert f'kvfuse_shadow_answer_kl_count{{method="anchor"}} {float(n + 1)}' in text


TARGET_ENV = {**BASE_ENV, "KVFUSE_FIDELITY__TARGET_AGREEMENT": "0.9", "KVFUSE_FIDELITY__MIN_RATIO": "0.0",
              "KVFUSE_FIDELITY__RATIO_STEP": "1.0", "KVFUSE_FIDELITY__JUDGE_CHECKS": "8",
              # the deliberately lossy start: anchor at ratio 0 with no forced anchor rows is full reuse
              "KVFUSE_FUSION__RECOMPUTE_RATIO": "0.0", "KVFUSE_FUSION__ANCHOR_TOKENS": "0"}


def test_a_target_raises_the_ratio_until_the_live_estimate_meets_it_and_survives_a_restart(
        tmp_path: Path, questions) -> None:
    with serving(tmp_path, TARGET_ENV, setup=lambda c: ingest(c, corpus()[0])) as h, make_client(h.server) as c:
        used = []
        for i in range(3 * len(questions)):
            q, ids = questions[i % len(questions)]
            before = fidelity(c).get("shadowed", 0)
            answer = ask(c, q, ids)  # no ratio named: "auto" while a target is held
            used.append(answer["fusion"])
            until(lambda b=before: fidelity(c).get("shadowed", 0) > b, 120, "the query's shadow check")
            held = fidelity(c)["buckets"]["0-1024"]
            if held["ratio_in_use"] == 1.0 and held["checks_at_ratio"] >= 12:
                break
        assert all(u["ratio_source"] == "auto" and u["size_bucket"] == "0-1024" for u in used)
        ratios = [u["recompute_ratio"] for u in used]
        assert ratios[0] == 0.0 and ratios[-1] == 1.0 and ratios == sorted(ratios)  # it rose, once, and held
        assert held["agreements_at_ratio"] / held["checks_at_ratio"] >= 0.9  # the live estimate meets 0.9
        low = fidelity(c)
        assert low["compared"] > held["checks_at_ratio"]  # checks at 0.0 came first
        # ask explicitly: the request's ratio wins and is not counted toward the hold
        explicit = ask(c, *questions[0], method="anchor", recompute_ratio=0.5)
        assert explicit["fusion"]["ratio_source"] == "request" and explicit["fusion"]["recompute_ratio"] == 0.5
        h.server.stop()
        h.server = ServerProcess(h.server.data_dir, tmp_path / "server2.log", **TARGET_ENV).start()
        with make_client(h.server) as c2:
            assert fidelity(c2)["buckets"]["0-1024"]["ratio_in_use"] == 1.0  # resumed with the same model
            assert ask(c2, *questions[1])["fusion"]["recompute_ratio"] == 1.0
