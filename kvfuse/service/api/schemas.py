"""Request bodies of the HTTP API (strict: wrong JSON types and unknown fields are refused with 422).

Limits that come from settings (document size, top_k, max_tokens) are checked by the handlers, which
know the settings; the models here hold only what is fixed by the contract.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
    WrapValidator,
    create_model,
)
from pydantic import Strict as StrictMode
from pydantic.json_schema import models_json_schema

from kvfuse.config import FusionRequestSettings, RetrievalRequestSettings
from kvfuse.service.errors import APIError

# Document ids travel in URL paths: no slashes, no spaces.
DOC_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,255}$"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number (NaN and Infinity are not JSON numbers)")
    return value


# Python's json accepts bare NaN and Infinity, which no JSON consumer can read back: refused with the
# field's name (the float member admits them only so that this one check, not four union branches, speaks).
MetaValue = Annotated[StrictStr | StrictInt | Annotated[float, StrictMode(), AllowInfNan(True)] | StrictBool | None,
                      AfterValidator(_finite)]
# Collection names travel in query strings and default document ids: no ':' (it separates them there).
COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
CollectionName = Annotated[str, StringConstraints(pattern=COLLECTION_PATTERN)]
OnConflict = Literal["skip", "overwrite", "fail"]
PrecomputeAt = Literal["ingest", "first_use"]  # store.precompute_at, per request
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class Strict(BaseModel):
    # allow_inf_nan: a bare NaN or Infinity (which Python's json accepts) is refused in every float field.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class DocumentIn(Strict):
    id: str | None = Field(None, pattern=DOC_ID_PATTERN)
    text: str
    metadata: dict[str, MetaValue] = {}
    collection: CollectionName | None = None
    on_conflict: OnConflict | None = None
    precompute_at: PrecomputeAt | None = None  # None: the batch's, else ?precompute_at=, else store.precompute_at


class DocumentBatchIn(Strict):
    documents: list[DocumentIn] = Field(min_length=1)
    collection: CollectionName | None = None  # of every document that names none
    on_conflict: OnConflict | None = None
    precompute_at: PrecomputeAt | None = None  # of every document that names none


def _all_optional(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s fields, each optional (None: the configured default) with the same type and bounds."""
    return {name: (f.rebuild_annotation() | None, None) for name, f in model.model_fields.items()}


# The per-request fusion knobs are declared once, in config (FusionRequestSettings): same names, bounds.
# recompute_ratio may also be "auto": the ratio held for fidelity.target_agreement (rag/fidelity.py).
def _auto_or(value: Any, handler: Any) -> Any:
    """"auto" as it is; anything else validated as the field's number (errors name the field alone)."""
    return value if value == "auto" else handler(value)


_fusion_fields = _all_optional(FusionRequestSettings)
_ratio_type = _fusion_fields["recompute_ratio"][0]
_fusion_fields["recompute_ratio"] = (Annotated[_ratio_type, WrapValidator(_auto_or)],
                                     Field(None, json_schema_extra={"description": 'a number in [0, 1], or "auto"'}))
FusionIn = create_model("FusionIn", __base__=Strict, **_fusion_fields)
# Likewise the retrieval knobs (RetrievalRequestSettings), plus the collections searched (default: the
# default collection).
RetrievalOptionsIn = create_model("RetrievalOptionsIn", __base__=Strict,
                                  collections=(list[CollectionName] | None, Field(None, min_length=1)),
                                  **_all_optional(RetrievalRequestSettings))


class GenerationIn(Strict):
    """Sampling knobs shared by /v1/query and the OpenAI endpoints (openai_schemas.py narrows some)."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    # The sampler's generator takes a 64-bit seed: a larger one would fail in the worker, not here.
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)


class SearchIn(Strict):
    """`POST /v1/search`: retrieval alone, with the same knobs as /v1/query."""

    query: str = Field(min_length=1)
    top_k: int | None = Field(None, ge=1)
    # Chroma's / MongoDB's operators ($eq $ne $in $nin $gt $gte $lt $lte, $and $or): checked by
    # retriever/filters.py, which names the place of a malformed one (422 invalid_filter).
    filters: dict[str, Any] | None = None
    retrieval: RetrievalOptionsIn | None = None


class DeleteByFilterIn(Strict):
    """`POST /v1/documents/delete`: the documents to delete, by metadata filter (as SearchIn's)."""

    filters: dict[str, Any] = Field(min_length=1)  # required and not empty: no call deletes everything
    collections: list[CollectionName] | None = Field(None, min_length=1)  # None: every collection
    dry_run: bool = True  # list what would go; delete only when false


class RetrievalIn(Strict):
    top_k: int | None = Field(None, ge=1)
    document_ids: list[str] | None = Field(None, min_length=1)
    filters: dict[str, Any] | None = None  # as SearchIn's
    retrieval: RetrievalOptionsIn | None = None
    fusion: FusionIn | None = None


class QueryIn(GenerationIn, RetrievalIn):
    query: str = Field(min_length=1)
    stream: bool = False
    system_prompt: str | None = None


# Bodies read by hand (see `documented_body`), listed in /openapi.json all the same.
# The OpenAI-compatible endpoints' bodies are in openai_schemas.py (OPENAI_BODY_MODELS).
BODY_MODELS: tuple[type[BaseModel], ...] = (DocumentIn, DocumentBatchIn, QueryIn, SearchIn, DeleteByFilterIn)


_UPLOAD_SCHEMA = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary", "description": "PDF, DOCX, HTML, Markdown or text"},
    "id": {"type": "string"}, "collection": {"type": "string"}, "on_conflict": {"type": "string"},
    "metadata": {"type": "string", "description": "a JSON object"}}}


def documented_body(*models: type[BaseModel], text: bool = False, upload: bool = False) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body by hand (so that bad JSON, bad UTF-8 and wrong
    types get this service's error codes, see `parse_json`/`validate`): the body's schema still appears
    in /openapi.json. The components it refers to are added by `add_body_schemas`."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    content: dict[str, Any] = {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}
    if text:
        content["text/plain"] = {"schema": {"type": "string"}}
    if upload:  # a file, read by api/uploads.py
        content["multipart/form-data"] = {"schema": _UPLOAD_SCHEMA}
    return {"requestBody": {"required": True, "content": content}}


def add_body_schemas(openapi: dict[str, Any], models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    """`openapi` with the JSON schemas of `models` (every hand-read request body) among its components."""
    _, top = models_json_schema([(m, "validation") for m in models],
                                ref_template="#/components/schemas/{model}")
    openapi.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
    return openapi


M = TypeVar("M", bound=BaseModel)


def decode_utf8(raw: bytes, what: str = "request body") -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"{what} is not valid UTF-8 (byte {err.start})", code="invalid_encoding") from None


def parse_json(raw: bytes) -> Any:
    text = decode_utf8(raw)
    if not text.strip():
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        # The decoder recurses per nesting level: a body nested deeper than the interpreter's recursion
        # limit is refused here, as the client's error, before anything else walks it.
        raise APIError(400, "request body is nested too deeply to be parsed (no request needs more than a "
                       "few levels)", code="invalid_json") from None


def validate(model: type[M], payload: Any) -> M:
    if not isinstance(payload, dict):
        raise APIError(422, f"request body must be a JSON object, got {type(payload).__name__}", code="invalid_type")
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        errors = err.errors()
        param = ".".join(str(p) for p in errors[0]["loc"]) or None
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
        raise APIError(422, msg, code="invalid_value", param=param) from None
