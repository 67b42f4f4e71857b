"""Files to text: PDF, DOCX, HTML, Markdown and plain text, each through a maintained parser, with where
its pages or sections start (chunk citations name them: rag/chunks.py).

The parsers were chosen by a small measurement (text found, speed, install size):
docs/results/parsers/README.md. pypdf reads PDFs (pure Python, no dependencies); python-docx reads DOCX;
html2text turns HTML into Markdown, which keeps its headings as sections and drops scripts and styles;
markdown-it-py finds Markdown's headings (not a `#` line inside a code block). A file that cannot be read
(corrupt, encrypted, no text) is the client's error, refused before anything is stored.

Parsing trusts nothing in the file: each parser runs within `ParseLimits` (rag/file_limits.py), and the
service calls `parse_kind` only inside a parse process (rag/parse_pool.py) that bounds its time and memory.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from kvfuse.service.errors import APIError
from kvfuse.service.rag.file_limits import (
    NestingGuard,
    ParseLimits,
    check_chars,
    check_text,
    check_zip,
    pdf_configuration,
    too_large,
    too_many_pages,
)
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


def parse_file(data: bytes, filename: str, content_type: str | None,
               limits: ParseLimits | None = None) -> ParsedFile:
    """The file's text and layout, in this process: for files this process trusts (studies, tests)."""
    return parse_kind(file_kind(filename, content_type), data, filename, limits or ParseLimits())


def parse_kind(kind: str, data: bytes, filename: str, limits: ParseLimits) -> ParsedFile:
    """A file of a known kind (`file_kind`) to its text and layout, within `limits`. CPU-bound, and a
    hostile file can still cost what no check foresees: the service runs it in a parse process."""
    try:
        parsed = _PARSERS[kind](data, filename, limits)
    except (APIError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - whatever a parser raises on a broken file is the file's fault
        if _out_of_memory(err):
            raise MemoryError(str(err)) from None
        raise _unreadable(filename, f"{type(err).__name__}: {err}") from None
    check_text(filename, parsed.text, limits)
    if not parsed.text.strip():
        raise APIError(422, f"{filename!r} has no text to ingest (a scanned PDF needs OCR first)",
                       code="empty_document", param="file")
    return parsed


def _out_of_memory(err: Exception) -> bool:
    """libxml2 (python-docx's XML, through lxml) reports a failed allocation as a syntax error whose log
    says ERR_NO_MEMORY: under the parse process's memory cap that is the cap, not the file's syntax."""
    log = getattr(err, "error_log", None)
    return log is not None and any(getattr(e, "type_name", "") == "ERR_NO_MEMORY" for e in log)


def _unreadable(filename: str, why: str) -> APIError:
    return APIError(422, f"{filename!r} cannot be parsed: {why}", code="unparsable_file", param="file")


def _pdf(data: bytes, filename: str, limits: ParseLimits) -> ParsedFile:
    from pypdf import PdfReader, apply_configuration
    from pypdf.errors import LimitReachedError

    reader = None
    with apply_configuration(**pdf_configuration(limits)):
        try:
            reader = PdfReader(io.BytesIO(data))
            if reader.is_encrypted and not reader.decrypt(""):
                raise APIError(422, "the PDF is encrypted: send it decrypted", code="unparsable_file", param="file")
            count = len(reader.pages)  # walks the page tree, within pypdf's page tree limits set above
        except LimitReachedError as err:
            if "page tree" in str(err):
                raise too_many_pages(filename, None, limits, _declared_pages(reader)) from None
            raise too_large(filename, f"holds more than pypdf reads within the limit ({err})", limits) from None
        if count > limits.max_pages:
            raise too_many_pages(filename, count, limits)
        pages, found = [], 0
        for page in reader.pages:
            try:
                pages.append((page.extract_text() or "").strip())
            except LimitReachedError as err:
                raise too_large(filename, f"holds more on page {len(pages) + 1} than pypdf reads within the limit "
                                          f"({err})", limits) from None
            found += len(pages[-1])
            if found > limits.max_decompressed_bytes:
                raise too_large(filename, f"gives more than {limits.decompressed_mb:g} MB of text", limits)
            check_chars(filename, found, limits)
    return _joined(pages, "application/pdf", "page_starts")


def _declared_pages(reader: Any) -> object:
    """The page count the PDF's page tree claims (for the refusal's message only; it may lie)."""
    try:
        return int(reader.root_object["/Pages"]["/Count"])
    except Exception:  # noqa: BLE001 - a tree too broken to say: the message goes without it
        return None


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


def _docx(data: bytes, filename: str, limits: ParseLimits) -> ParsedFile:
    import docx
    from docx.table import Table

    check_zip(data, filename, limits)  # python-docx reads every member whole
    document = docx.Document(io.BytesIO(data))
    sections: list[tuple[str, list[str]]] = [("", [])]
    found = 0
    for block in document.iter_inner_content():
        check_chars(filename, found, limits)  # a document whose text passes the limit stops here
        if isinstance(block, Table):
            rows = [" | ".join(c.text.strip() for c in row.cells) for row in block.rows]
            found += sum(len(r) + 2 for r in rows)
            sections[-1][1].extend(rows)
            continue
        text = block.text.strip()
        found += len(text) + 2
        style = (block.style.name if block.style is not None else "") or ""
        if text and (style.startswith("Heading") or style == "Title"):
            sections.append((text, [text]))
        elif text:
            sections[-1][1].append(text)
    sections = [s for s in sections if s[1]]
    return _joined(["\n\n".join(lines) for _, lines in sections], DOCX_TYPE, "section_starts",
                   [title for title, _ in sections])


def _html(data: bytes, filename: str, limits: ParseLimits) -> ParsedFile:
    converter = _bounded_html2text(NestingGuard(filename, limits))
    converter.body_width = 0  # no hard line wraps: chunking cuts on paragraphs and sentences itself
    converter.ignore_links = converter.ignore_images = True
    markdown = converter.handle(_utf8(data))
    return ParsedFile(markdown.strip(), "text/html", _markdown_sections(markdown.strip()))


def _bounded_html2text(guard: NestingGuard) -> Any:
    """html2text's converter (an HTMLParser) with the guard told of every tag as it is read: a page nested
    too deep is refused at the first element past the limit, not after html2text's quadratic work."""
    import html2text

    class Bounded(html2text.HTML2Text):
        def handle_starttag(self, tag: str, attrs: Any) -> None:
            guard.start(tag)
            super().handle_starttag(tag, attrs)

        def handle_endtag(self, tag: str) -> None:
            guard.end(tag)
            super().handle_endtag(tag)

    return Bounded()


def _markdown(data: bytes, filename: str, limits: ParseLimits) -> ParsedFile:
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


def _text(data: bytes, filename: str, limits: ParseLimits) -> ParsedFile:
    return ParsedFile(_utf8(data), "text/plain")


def _utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise APIError(422, f"the file is not UTF-8 text (byte {err.start})", code="unparsable_file",
                       param="file") from None


_PARSERS = {"pdf": _pdf, "docx": _docx, "html": _html, "markdown": _markdown, "text": _text}
