"""Request bodies of the OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions` and
`/v1/embeddings`, with OpenAI's own bounds where they are narrower than `/v1/query`'s (temperature <= 2).

They are not strict: OpenAI clients send fields this service has no use for (`user`, `metadata`), which
are accepted as extras. Fields that would change the answer and are not implemented are declared with
OpenAI's bounds and refused by `openai_conventions.check_sampling` when set to anything but their no-op
value, never ignored. docs/usage.md, "OpenAI-compatible endpoints".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kvfuse.service.api.schemas import GenerationIn, RetrievalIn

# The content part types a message may carry that this text-only model reads (OpenAI also has image_url,
# input_audio and file: refused by name, see openai_conventions.check_content_parts).
TEXT_PARTS = ("text",)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        # Parts of any other type are refused before this is read (check_content_parts).
        return "".join(str(p.get("text", "")) for p in self.content or [] if p.get("type") in TEXT_PARTS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class OpenAIGenerationIn(GenerationIn):
    """The sampling fields OpenAI's completion endpoints share, within OpenAI's bounds."""

    model_config = ConfigDict(extra="allow", strict=False)
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100] (checked with its key's name)
    use_retrieval: bool = True  # false: no documents; the prompt is answered from what it holds


class ChatIn(OpenAIGenerationIn, RetrievalIn):
    model_config = ConfigDict(extra="allow", strict=False)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's bounds (fusion/engine/logprobs.py MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None  # checked and compiled by openai_structured.response_grammar
    _grammar: str | None = PrivateAttr(None)

    @property
    def response_grammar(self) -> str | None:
        """The compiled grammar of `response_format` (set by the route), which the sampler follows."""
        return self._grammar


class CompletionIn(OpenAIGenerationIn, RetrievalIn):
    """`POST /v1/completions`: the prompt is the question (one prompt per request); `system_prompt` as in
    /v1/query."""

    model_config = ConfigDict(extra="allow", strict=False)
    prompt: str | list[str]
    system_prompt: str | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy endpoint's bound: alternatives per token
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=20)


class EmbeddingsIn(BaseModel):
    """`POST /v1/embeddings`. `input`: a string, a list of strings, or token ids of OpenAI's cl100k_base
    encoding (a list of ints, or a list of such lists), which LangChain's OpenAIEmbeddings sends."""

    model_config = ConfigDict(extra="allow", strict=False)
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


OPENAI_BODY_MODELS: tuple[type[BaseModel], ...] = (ChatIn, CompletionIn, EmbeddingsIn)
