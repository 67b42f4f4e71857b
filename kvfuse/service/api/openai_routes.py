"""OpenAI-compatible POST /v1/chat/completions, GET /v1/models and GET /v1/models/{id}, usable by the
`openai` client unchanged (/v1/completions: openai_completions.py; /v1/embeddings: openai_embeddings.py).

The question is the last user message; earlier user and assistant turns go into the prompt and help
retrieval (rag/conversation.py); system/developer messages replace the configured system prompt.
Retrieval and fusion knobs (`top_k`, `document_ids`, `filters`, `retrieval`, `fusion`) ride along as extra
body fields, and `use_retrieval: false` answers from the messages alone. `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens whose stored KV was
reused; `sources` (an extra field) carries the chunks the answer is built on, with their text and their
documents' metadata. Errors, model names and refused parameters follow OpenAI (openai_conventions.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvfuse.service.api import sse
from kvfuse.service.api.answers import answer_of, sources_of
from kvfuse.service.api.auth import Principal
from kvfuse.service.api.dependencies import Caller, Queries, State
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.openai_conventions import (
    check_logit_bias,
    check_request,
    choice_logprobs,
    choices_of,
    embedder_names,
    openai_error,
    served_names,
)
from kvfuse.service.api.openai_responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatUsage,
    ChunkChoice,
    ChunkDelta,
    ModelCard,
    ModelList,
)
from kvfuse.service.api.openai_schemas import ChatIn
from kvfuse.service.api.query_routes import CLIENT_CLOSED, collect_answer
from kvfuse.service.api.schemas import documented_body, parse_json, validate
from kvfuse.service.errors import APIError
from kvfuse.service.rag.conversation import ROLES
from kvfuse.service.rag.query import ClientGone, QueryRun, QueryService

router = APIRouter(responses=ERROR_RESPONSES)


def model_cards(state: Any) -> list[ModelCard]:
    """The chat model's names (the one answers carry first), then the embedder's."""
    created = int(state.started_at)
    names = served_names(state.settings) + embedder_names(state.settings)
    return [ModelCard(id=name, created=created) for name in names]


@router.get("/v1/models")
async def models(state: State) -> ModelList:
    return ModelList(data=model_cards(state))


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State) -> ModelCard:
    """A listed model's card; model ids hold "/" (HuggingFaceTB/SmolLM2-135M-Instruct): a path parameter."""
    for card in model_cards(state):
        if card.id == model_id:
            return card
    names = ", ".join(repr(c.id) for c in model_cards(state))
    raise APIError(404, f"model {model_id!r} does not exist; this service serves {names}", code="model_not_found",
                   param="model")


async def start_openai_query(queries: QueryService, request: Request, body: Any, caller: Principal, *, gen: Any,
                             question: str, system_prompt: str | None, arrived: float,
                             turns: list[tuple[str, str]] | None = None) -> QueryRun:
    """Plan and queue a query from an OpenAI body (ChatIn, CompletionIn), retrieving only from what the
    caller's key sees, or from nothing with `use_retrieval: false`. `gen`: the sampling knobs as
    QueryService.generation_options reads them."""
    plan = await queries.prepare(question=question, system_prompt=system_prompt, top_k=body.top_k,
                                 document_ids=body.document_ids, filters=body.filters, retrieval=body.retrieval,
                                 fusion=body.fusion, gen=gen, arrived=arrived, turns=turns,
                                 visible=caller.allowed_collections, retrieve=body.use_retrieval)
    plan.n = body.n  # every choice decoded from the one fused prefill (fusion/engine/sequence.py)
    return await queries.start(plan, request.is_disconnected)


def _finish(reason: str) -> Literal["stop", "length"]:
    return "length" if reason == "length" else "stop"


def _conversation(body: ChatIn) -> tuple[str, list[tuple[str, str]], str | None]:
    """(the last user message, the user and assistant turns before it, the system prompt if any)."""
    last = max((i for i, m in enumerate(body.messages) if m.role == "user"), default=None)
    if last is None or not body.messages[last].text().strip():
        raise APIError(422, "messages must contain a non-empty user message", code="invalid_value",
                       param="messages")
    turns = [(m.role, m.text()) for m in body.messages[:last] if m.role in ROLES and m.text().strip()]
    system = "\n".join(m.text() for m in body.messages if m.role in ("system", "developer")) or None
    return body.messages[last].text(), turns, system


@router.post("/v1/chat/completions", response_model=ChatCompletion, openapi_extra=documented_body(ChatIn))
async def chat_completions(request: Request, state: State, queries: Queries, caller: Caller
                           ) -> ChatCompletion | Response:
    """The body is read by hand, as for /v1/query; its schema is `ChatIn`. Errors in OpenAI's statuses."""
    try:
        return await _complete(request, state, queries, caller)
    except APIError as err:
        raise openai_error(err) from None


async def _complete(request: Request, state: Any, queries: QueryService, caller: Principal
                    ) -> ChatCompletion | Response:
    arrived = time.monotonic()
    body = validate(ChatIn, parse_json(await request.body()))
    names = served_names(state.settings)
    check_request(body, names, state.settings.server.max_choices)
    check_logit_bias(body, len(state.corpus.chunker.tokenizer))
    question, turns, system = _conversation(body)
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    try:
        run = await start_openai_query(queries, request, body, caller, gen=body, question=question,
                                       system_prompt=system, arrived=arrived, turns=turns)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    tokenizer = state.corpus.chunker.tokenizer
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse.stream(_stream(queries, run, cid, created, names[0], include_usage, tokenizer),
                          state.settings.server.sse_ping_s)
    answer = await collect_answer(queries, run, request, what="request")
    if answer is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=_finish(reason),
                          logprobs=choice_logprobs(tokenizer, entries))
               for i, text, reason, entries in choices_of(answer.answer, answer.finish_reason, run)]
    return ChatCompletion(id=cid, created=created, model=names[0], choices=choices, usage=ChatUsage.of(answer.usage),
                          sources=answer.sources, dropped_sources=answer.dropped_sources, warning=answer.warning,
                          timings=answer.timings, fusion=answer.fusion)


async def _stream(queries: QueryService, run: QueryRun, cid: str, created: int, name: str,
                  include_usage: bool, tokenizer: Any) -> AsyncIterator[bytes]:
    def chunk(choices: list[ChunkChoice], **extra: object) -> bytes:
        # Only the fields given are sent (exclude_unset): each chunk carries what OpenAI's would, plus ours.
        c = ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created, model=name, choices=choices,
                                **extra)
        return sse.event(c.model_dump(mode="json", exclude_unset=True))

    def choice(delta: ChunkDelta, finish: Literal["stop", "length"] | None = None,
               logprobs: list | None = None, index: int = 0) -> list[ChunkChoice]:
        return [ChunkChoice(index=index, delta=delta, finish_reason=finish,
                            logprobs=choice_logprobs(tokenizer, logprobs))]

    # Each chunk carries one choice (OpenAI's shape for n > 1): its role first, then its deltas, then its end.
    retrieved = sources_of(run)
    yield chunk(choice(ChunkDelta(role="assistant", content="")), sources=retrieved.sources, warning=retrieved.warning)
    for i in range(1, run.plan.n):
        yield chunk(choice(ChunkDelta(role="assistant", content=""), index=i))
    sent = [0] * run.plan.n  # per choice, tokens whose logprobs went out with their text
    try:
        async for kind, p in queries.stream(run):
            if kind == "delta":
                sent[p["index"]] += len(p["logprobs"] or [])
                yield chunk(choice(ChunkDelta(content=p["text"]), logprobs=p["logprobs"], index=p["index"]))
            else:
                a = answer_of(run, p)
                for i, _, reason, entries in choices_of(a.answer, a.finish_reason, run):
                    rest = None if entries is None else entries[sent[i]:]
                    yield chunk(choice(ChunkDelta(), _finish(reason), rest, index=i), timings=a.timings,
                                fusion=a.fusion)
                if include_usage:
                    yield chunk([], usage=ChatUsage.of(a.usage))
    except APIError as err:
        yield sse.event(openai_error(err).body())
    yield sse.DONE
