"""`kvfuse ingest` for files the server parses (PDF, DOCX, HTML, Markdown): each is sent as the server
takes a file, multipart/form-data with its `file` field (api/uploads.py), one request per file. Plain text
files still travel as JSON batches (fewer requests; nothing to parse)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JSON_SUFFIXES = frozenset({".txt", ".text", ".rst"})  # sent as JSON text, in batches


def upload(http: Any, path: Path, doc_id: str, *, on_conflict: str, collection: str | None) -> Any:
    """POST one file as multipart/form-data; returns the response (a JobOut or Submitted body on success)."""
    form = {"id": doc_id, "on_conflict": on_conflict, "metadata": json.dumps({"source": str(path)})}
    if collection:
        form["collection"] = collection
    with path.open("rb") as f:
        return http.post("/v1/documents", files={"file": (path.name, f)}, data=form)
