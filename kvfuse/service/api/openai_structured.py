"""OpenAI's `response_format` for chat: `text` (the default), `json_object` (any JSON object) and
`json_schema` (JSON valid against the request's schema), answered by constrained decoding.

The schema is compiled here into the grammar the worker's sampler follows (kvfuse/fusion/engine/grammar.py;
no tokenizer is needed to check it), so a schema that cannot be compiled is a 400 naming the problem before
anything is queued; the grammar travels in the job's generation options and the worker builds its matcher
with its tokenizer. `strict` is accepted either way: the answer always follows the schema. An answer cut
by `max_tokens` (finish_reason "length") is unfinished JSON, as with OpenAI. docs/usage.md, "Structured answers".
"""

from __future__ import annotations

import re
from typing import Any

from kvfuse.service.errors import APIError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
TYPES = ("text", "json_object", "json_schema")


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def response_grammar(fmt: Any) -> str | None:
    """The grammar `response_format` asks for (None: plain text), or a 400 naming the field at fault."""
    from kvfuse.fusion.engine.grammar import GrammarError, json_grammar

    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in TYPES:
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise _bad(f"response_format.type must be one of {', '.join(map(repr, TYPES))}; got {kind!r}",
                   "response_format.type")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return json_grammar(None)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format of type json_schema needs a json_schema object ({name, schema, strict})",
                   "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'; got {name!r}",
                   "response_format.json_schema.name")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON schema object",
                   "response_format.json_schema.schema")
    try:
        return json_grammar(schema)
    except GrammarError as err:
        raise _bad(f"response_format.json_schema.schema cannot be used: {err}", "response_format.json_schema.schema",
                   code="invalid_json_schema") from None
