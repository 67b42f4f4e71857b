"""A file sent to POST /v1/documents as multipart/form-data: the `file` field, and `id`, `collection`,
`on_conflict` and `metadata` (a JSON object) as form fields (the id and collection may also come from the
query string, as for text/plain). The file becomes one document whose text the parser found
(rag/files.py) and whose metadata adds `filename`, `content_type` and the layout its chunks cite pages or
sections by. Everything is checked before anything is stored: a refused file writes nothing. The file is
parsed in a parse process, within the upload limits (rag/parse_pool.py), never in this one.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, get_args

from fastapi import Request
from starlette.datastructures import UploadFile

from kvfuse.service.api.schemas import DocumentIn, OnConflict, validate
from kvfuse.service.errors import APIError
from kvfuse.service.rag.files import file_kind

if TYPE_CHECKING:
    from kvfuse.service.rag.parse_pool import ParsePool

_FIELDS = ("file", "id", "collection", "on_conflict", "metadata")


async def read_upload(request: Request, doc_id: str | None, parsers: ParsePool) -> tuple[DocumentIn, str | None]:
    """The document a multipart upload carries, and the on_conflict its form names (None: not named)."""
    parsers.check_room()  # every parser busy and the waiters' places taken: 429 before the body is read
    try:
        form = await request.form(max_files=1, max_fields=len(_FIELDS))
    except Exception as err:  # noqa: BLE001 - python-multipart's errors on a malformed body
        raise APIError(400, f"the multipart body cannot be read: {err}", code="invalid_multipart") from None
    unknown = sorted(set(form.keys()) - set(_FIELDS))
    if unknown:
        raise APIError(422, f"unknown form field(s) {', '.join(unknown)}; the fields are {', '.join(_FIELDS)}",
                       code="invalid_value", param=unknown[0])
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise APIError(422, "a multipart upload needs a `file` field holding the file", code="invalid_value",
                       param="file")
    fields = {k: form.get(k) for k in ("id", "collection", "on_conflict") if isinstance(form.get(k), str)}
    if fields.get("on_conflict") not in (None, *get_args(OnConflict)):
        raise APIError(422, f"on_conflict must be one of {', '.join(get_args(OnConflict))}", code="invalid_value",
                       param="on_conflict")
    metadata = _metadata(form.get("metadata"))
    data = await upload.read()
    name = upload.filename or "upload"
    kind = file_kind(name, upload.content_type)  # 415 here, before a parse process is asked
    parsed = await parsers.parse(data, name, kind)
    given = {"id": fields.get("id") or doc_id, "text": parsed.text, "metadata": metadata,
             "collection": fields.get("collection")}
    doc = validate(DocumentIn, {k: v for k, v in given.items() if v is not None})
    # Added after validation: the layout lists are the service's own, not metadata a client could send.
    doc.metadata = {"filename": name, "content_type": parsed.content_type, **doc.metadata, **parsed.layout}
    return doc, fields.get("on_conflict")


def _metadata(raw: object) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise APIError(422, "the metadata field must be a JSON object as text", code="invalid_value", param="metadata")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise APIError(422, f"the metadata field is not valid JSON: {err}", code="invalid_value",
                       param="metadata") from None
    if not isinstance(value, dict):
        raise APIError(422, "the metadata field must be a JSON object", code="invalid_value", param="metadata")
    return value
