"""Response bodies of the OpenAI-compatible endpoints (`/v1/models`, `/v1/chat/completions`,
`/v1/completions`, `/v1/embeddings`): OpenAI's shapes, with kvfuse's sources, timings and fusion where an OpenAI client ignores them and a RAG client
reads them (docs/usage.md). The shapes they share with `/v1/query` come from responses.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from kvfuse.service.api.responses import FusionUsed, Source, Timings, Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfuse"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class ChatUsage(BaseModel):
    """OpenAI's usage, with kvfuse's reuse figures where OpenAI clients look for them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    recomputed_tokens: int

    @classmethod
    def of(cls, u: Usage) -> ChatUsage:
        return cls(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                   total_tokens=u.prompt_tokens + u.completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
                   recomputed_tokens=u.recomputed_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """OpenAI's `logprobs` of a choice: each generated token's, with `top_logprobs` alternatives. The
    model's own distribution, before temperature and top-p (kvfuse/fusion/engine/logprobs.py)."""

    content: list[TokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    """`POST /v1/chat/completions` (not streamed): OpenAI's shape plus the query answer's sources,
    timings and fusion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    sources: list[Source]
    dropped_sources: list[Source]
    warning: str | None
    timings: Timings
    fusion: FusionUsed


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChoiceLogprobs | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion, sent with only the fields it was given
    (`model_dump(exclude_unset=True)`): `sources` and `warning` ride on the first chunk, `timings` and
    `fusion` on the one with the finish reason, `usage` on a last chunk with no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None
    sources: list[Source] | None = None
    warning: str | None = None
    timings: Timings | None = None
    fusion: FusionUsed | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions endpoint's `logprobs` (see openai_conventions.completion_logprobs)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class TextCompletion(BaseModel):
    """`POST /v1/completions`, the answer or (with `object` the same) one streamed event. Sent with only
    the fields given (`exclude_unset`) when streamed, as ChatCompletionChunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: ChatUsage | None = None
    sources: list[Source] | None = None
    dropped_sources: list[Source] | None = None
    warning: str | None = None
    timings: Timings | None = None
    fusion: FusionUsed | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str: base64 of the little-endian float32 vector (encoding_format)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int  # in the embedder's own tokenizer
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
