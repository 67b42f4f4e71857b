"""Server-sent events framing. Data is one line of JSON (JSON never holds a raw newline), so an event is
always `event: name\\ndata: {...}\\n\\n`; the stream ends with `data: [DONE]` as OpenAI streams do."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
MEDIA_TYPE = "text/event-stream"


def event(data: Any, name: str | None = None) -> bytes:
    """One event; `data` is JSON-ready, or a response model sent as its JSON body would be."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    line = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {line}\n\n".encode()


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep="\n")


def stream(events: AsyncIterator[bytes], ping_s: float) -> EventSourceResponse:
    """The response streaming `events` (each already framed by `event`), with a keep-alive comment every
    `ping_s` seconds of quiet."""
    return EventSourceResponse(events, ping=ping_s, sep="\n", headers=HEADERS, ping_message_factory=_ping)
