"""Files to text: PDF, DOCX, HTML, Markdown and plain text, each through a maintained parser, with where
its pages or sections start (chunk citations name them: rag/chunks.py).

The parsers were chosen by a small measurement (text found, speed, install size):
docs/results/parsers/README.md. pypdf reads PDFs (pure Python, no dependencies); python-docx reads DOCX;
html2text turns HTML into Markdown, which keeps its headings as sections and drops scripts and styles;
markdown-it-py finds Markdown's headings (not a `#` line inside a code block). A file that cannot be read
(corrupt, encrypted, no text) is the client's error, refused before anything is stored.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from kvfuse.service.errors import APIError
from kvfuse.service.rag.file_types import BY_SUFFIX, BY_TYPE, DOCX_TYPE

_GENERIC = ("", "application/octet-stream")  # a part type that says nothing: the file name decides


@dataclass
class ParsedFile:
    text: str
    content_type: str
    layout: dict[str, list[Any]] = field(default_factory=dict)  # page_starts, or section_starts and section_titles


def file_kind(filename: str, content_type: str | None) -> str:
    """pdf, docx, html, markdown or text: by the part's content type, else by the file name's suffix;
    415 for anything else."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    kind = BY_TYPE.get(ctype) if ctype not in _GENERIC else BY_SUFFIX.get(PurePath(filename).suffix.lower())
    if kind is None:
        raise APIError(415, f"unsupported file type {ctype or PurePath(filename).suffix or 'unknown'!r} "
                       f"({filename!r}): send PDF, DOCX, HTML, Markdown or plain text",
                       code="unsupported_media_type", param="file")
    return kind


def parse_file(data: bytes, filename: str, content_type: str | None) -> ParsedFile:
    """The file's text and layout. CPU-bound: call it in a thread."""
    kind = file_kind(filename, content_type)
    try:
        parsed = _PARSERS[kind](data)
    except APIError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever a parser raises on a broken file is the file's fault
        raise _unreadable(filename, f"{type(err).__name__}: {err}") from None
    if not parsed.text.strip():
        raise APIError(422, f"{filename!r} has no text to ingest (a scanned PDF needs OCR first)",
                       code="empty_document", param="file")
    return parsed


def _unreadable(filename: str, why: str) -> APIError:
    return APIError(422, f"{filename!r} cannot be parsed: {why}", code="unparsable_file", param="file")


def _pdf(data: bytes) -> ParsedFile:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted and not reader.decrypt(""):
        raise APIError(422, "the PDF is encrypted: send it decrypted", code="unparsable_file", param="file")
    pages = [(p.extract_text() or "").strip() for p in reader.pages]
    return _joined(pages, "application/pdf", "page_starts")


def _joined(parts: list[str], content_type: str, key: str, titles: list[str] | None = None) -> ParsedFile:
    text, starts = "", []
    for part in parts:
        if text:
            text += "\n\n"
        starts.append(len(text))
        text += part
    layout: dict[str, list[Any]] = {key: starts}
    if titles is not None:
        layout["section_titles"] = titles
    return ParsedFile(text, content_type, layout)


def _docx(data: bytes) -> ParsedFile:
    import docx
    from docx.table import Table

    document = docx.Document(io.BytesIO(data))
    sections: list[tuple[str, list[str]]] = [("", [])]
    for block in document.iter_inner_content():
        if isinstance(block, Table):
            sections[-1][1].extend(" | ".join(c.text.strip() for c in row.cells) for row in block.rows)
            continue
        text = block.text.strip()
        style = (block.style.name if block.style is not None else "") or ""
        if text and (style.startswith("Heading") or style == "Title"):
            sections.append((text, [text]))
        elif text:
            sections[-1][1].append(text)
    sections = [s for s in sections if s[1]]
    return _joined(["\n\n".join(lines) for _, lines in sections], DOCX_TYPE, "section_starts",
                   [title for title, _ in sections])


def _html(data: bytes) -> ParsedFile:
    import html2text

    converter = html2text.HTML2Text()
    converter.body_width = 0  # no hard line wraps: chunking cuts on paragraphs and sentences itself
    converter.ignore_links = converter.ignore_images = True
    markdown = converter.handle(_utf8(data))
    return ParsedFile(markdown.strip(), "text/html", _markdown_sections(markdown.strip()))


def _markdown(data: bytes) -> ParsedFile:
    text = _utf8(data)
    return ParsedFile(text, "text/markdown", _markdown_sections(text))


def _markdown_sections(text: str) -> dict[str, list[Any]]:
    """Where each heading's section starts (character offsets) and its title; text before the first heading
    is a section without a title."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(text)
    line_starts = [0]
    for line in text.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    starts, titles = [], []
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open" and tok.map:
            starts.append(line_starts[tok.map[0]])
            titles.append(tokens[i + 1].content.strip())
    if not starts:
        return {}
    if starts[0] > 0 and text[: starts[0]].strip():
        starts.insert(0, 0)
        titles.insert(0, "")
    return {"section_starts": starts, "section_titles": titles}


def _text(data: bytes) -> ParsedFile:
    return ParsedFile(_utf8(data), "text/plain")


def _utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise APIError(422, f"the file is not UTF-8 text (byte {err.start})", code="unparsable_file",
                       param="file") from None


_PARSERS = {"pdf": _pdf, "docx": _docx, "html": _html, "markdown": _markdown, "text": _text}
