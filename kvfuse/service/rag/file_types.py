"""The file types ingestion reads, by content type and by file name suffix: what `rag/files.py` parses and
what `kvfuse ingest` picks up in folders (no imports, so the CLI's `--help` stays instant)."""

DOCX_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
KIND_TYPES = {"pdf": "application/pdf", "docx": DOCX_TYPE, "html": "text/html", "markdown": "text/markdown",
              "text": "text/plain"}
BY_TYPE = {**{t: k for k, t in KIND_TYPES.items()}, "application/xhtml+xml": "html", "text/x-markdown": "markdown"}
BY_SUFFIX = {".pdf": "pdf", ".docx": "docx", ".html": "html", ".htm": "html", ".md": "markdown",
             ".markdown": "markdown", ".txt": "text", ".text": "text", ".rst": "text"}
FILE_SUFFIXES = frozenset(BY_SUFFIX)
