"""The fidelity benchmark through a live server (`kvfuse bench fidelity --url`): each example's chunks are
ingested as documents, then queried with explicit `document_ids` and `fusion`; no KL (the API returns no
distributions). The in-process backend and the measures are in kvfuse.bench.fidelity."""

from __future__ import annotations

from typing import Any

from kvfuse.bench.fidelity import Outcome
from kvfuse.bench.reference import Reference
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Example


def checked(resp: Any) -> Any:
    """The JSON of a successful response; RuntimeError naming the request and the server's answer else."""
    if resp.status_code >= 400:
        raise RuntimeError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
    return resp.json()


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

    def prepare(self, ex: Example) -> list[str]:
        ids = [f"bench-{ex.id}-{j}" for j in range(len(ex.chunks))]
        # titled as in-process, so the server's labelled prompt (model.prompt_layout) names them the same
        docs = [{"id": i, "text": t, "on_conflict": "overwrite", "metadata": {"title": name}}
                for i, t, name in zip(ids, ex.chunks, ex.names(), strict=True)]
        checked(self.client.post("/v1/documents", params={"wait": "true"}, json={"documents": docs}))
        return ids

    def run(self, ex: Example, prepared: list[str], method: str, ratio: float | None,
            reference: Reference | None = None) -> Outcome:
        fusion: dict[str, Any] = {"method": method}
        if ratio is not None:
            fusion["recompute_ratio"] = ratio
        body = {
            "query": ex.question, "document_ids": prepared, "stream": False,
            "max_tokens": self.max_tokens or ex.max_tokens,
            "temperature": 0.0, "fusion": fusion,
        }
        out = checked(self.client.post("/v1/query", json=body))
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
