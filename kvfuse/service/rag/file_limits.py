"""The bounds a parse of one uploaded file stays within, checked where each kind of file can break them.

A file's size on the wire says little about what parsing it costs: a 100 kB DOCX can hold a zip member
that inflates to gigabytes, a 2 kB PDF can declare a page tree of ten thousand pages, and 200 kB of HTML
nested ten thousand lists deep takes html2text minutes (its work grows with the square of the depth). So
each parser gets the checks its format needs before the expensive step: a DOCX's zip members are sized
(declared, then actually inflated) before python-docx reads them; pypdf runs with its stream and page
tree limits set from ours and the page count is checked before any text is extracted; HTML's nesting is
tracked as html2text reads it. What no check foresees is bounded by the parse process itself (wall time
and address space: rag/parse_pool.py). Every refusal names the setting it broke (docs/usage.md, errors).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvfuse.service.errors import APIError

if TYPE_CHECKING:
    from kvfuse.config import ServerSettings

MB = 1024 * 1024
_READ_PIECE = 1 << 20  # zip members are inflated this much at a time while their actual size is counted


@dataclass(frozen=True)
class ParseLimits:
    """What parsing one file may produce (plain data: it travels to the parse process as JSON)."""

    max_decompressed_bytes: int = 100 * MB
    max_pages: int = 2000
    max_nesting: int = 256
    max_chars: int = 2_000_000  # a document's text, as the route bounds any document's (server.max_document_chars)

    @classmethod
    def of(cls, server: ServerSettings) -> ParseLimits:
        return cls(server.upload_max_decompressed_mb * MB, server.upload_max_pages, server.upload_max_nesting,
                   server.max_document_chars)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def decompressed_mb(self) -> float:
        return self.max_decompressed_bytes / MB


def too_large(filename: str, what: str, limits: ParseLimits) -> APIError:
    """413 for a file that `what` (a phrase: "has zip members that declare 64 MB") past the limit."""
    return APIError(413, f"{filename!r} {what}; the limit is {limits.decompressed_mb:g} MB "
                         "(server.upload_max_decompressed_mb)", code="upload_too_large", param="file")


def too_many_pages(filename: str, pages: int | None, limits: ParseLimits, declared: object = None) -> APIError:
    """`pages` None: the page tree walk stopped past the limit; `declared` is the tree's own /Count then."""
    count = f"{pages} pages" if pages is not None else f"more than {limits.max_pages} pages"
    said = f" (its page tree declares {declared})" if isinstance(declared, int) else ""
    return APIError(413, f"{filename!r} has {count}{said}; the limit is {limits.max_pages} pages, "
                         "server.upload_max_pages", code="too_many_pages", param="file")


def too_many_chars(filename: str, chars: int, limits: ParseLimits, *, more: bool = False) -> APIError:
    """413 for a file whose text passes the document limit (`more`: counting stopped once it did)."""
    count = f"more than {limits.max_chars}" if more else str(chars)
    return APIError(413, f"{filename!r} gives {count} characters of text, over the limit of {limits.max_chars} "
                         "(server.max_document_chars)", code="document_too_large", param="file")


def check_chars(filename: str, chars: int, limits: ParseLimits) -> None:
    """Called as a parser's text grows, so that a file whose text passes the limit stops there."""
    if chars > limits.max_chars:
        raise too_many_chars(filename, chars, limits, more=True)


def check_text(filename: str, text: str, limits: ParseLimits) -> None:
    """The text a parser found is bounded too, in characters and as the UTF-8 that crosses back to the API
    process (`encoded`)."""
    if len(text) > limits.max_decompressed_bytes:  # before encoding it: at least this many bytes
        raise too_large(filename, f"gives {len(text) / MB:.1f} MB of text", limits)
    if (n := len(encoded(text))) > limits.max_decompressed_bytes:
        raise too_large(filename, f"gives {n / MB:.1f} MB of text", limits)
    if len(text) > limits.max_chars:
        raise too_many_chars(filename, len(text), limits)


def encoded(text: str) -> bytes:
    """A parsed text as it crosses the pipe: UTF-8, lone surrogates (a PDF's text may hold them) kept."""
    return text.encode("utf-8", "surrogatepass")


def decoded(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


def text_limit(limits: ParseLimits) -> int:
    """The most bytes a parsed text that passed `check_text` takes on the pipe (4 a character at most)."""
    return min(limits.max_decompressed_bytes, 4 * limits.max_chars)


# -- DOCX ----------------------------------------------------------------------------------------------------

def check_zip(data: bytes, filename: str, limits: ParseLimits) -> None:
    """Refuse a zip whose members would inflate past the limit, before python-docx reads any of them
    whole: first by the sizes the zip declares (free), then by inflating each member a piece at a time
    and counting (zipfile stops a member at its declared size and fails its CRC, so a member that lies
    about its size is caught here too, as unreadable)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as err:
        raise APIError(422, f"{filename!r} cannot be parsed: not a DOCX (zip): {err}", code="unparsable_file",
                       param="file") from None
    with archive:
        members = archive.infolist()
        declared = sum(m.file_size for m in members)
        if declared > limits.max_decompressed_bytes:
            raise too_large(filename, f"has zip members that declare {declared / MB:.1f} MB inflated", limits)
        inflated = 0
        for member in members:
            try:
                with archive.open(member) as stream:
                    while piece := stream.read(_READ_PIECE):
                        inflated += len(piece)
                        if inflated > limits.max_decompressed_bytes:
                            raise too_large(filename, f"has zip members that inflate past "
                                                      f"{limits.decompressed_mb:g} MB", limits)
            except (zipfile.BadZipFile, RuntimeError, NotImplementedError, EOFError, OSError) as err:
                raise APIError(422, f"{filename!r} cannot be parsed: zip member {member.filename!r}: {err}",
                               code="unparsable_file", param="file") from None


# -- PDF -----------------------------------------------------------------------------------------------------

def pdf_configuration(limits: ParseLimits) -> dict[str, int]:
    """pypdf's own resource limits, set from ours: no stream inflates past the decompressed limit, and the
    page tree walk stops soon after the page limit (a tree's inner nodes are fewer than its pages, so
    twice the page limit in entries is never reached by a document within it)."""
    n = limits.max_decompressed_bytes
    return {"maximum_declared_stream_length": n, "array_based_stream_maximum_output_length": n,
            "zlib_maximum_output_length": n, "lzw_maximum_output_length": n,
            "run_length_maximum_output_length": n, "brotli_maximum_output_length": n,
            "jbig2_maximum_output_length": n, "image_maximum_buffer_size": n,
            "page_tree_maximum_entries": 2 * limits.max_pages + 2}


# -- HTML ----------------------------------------------------------------------------------------------------

_VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# Elements whose end tag HTML lets a page leave out (WHATWG, "optional tags"): a page of unclosed <li> or
# <p> is not deep, so these are not counted; every other element must be closed to end its depth.
_END_OPTIONAL = frozenset("html head body li dt dd p rt rp optgroup option colgroup caption thead tbody tfoot "
                          "tr td th".split())


class NestingGuard:
    """Tracks how deep a page's elements are open (void elements and those whose end tag may be left out
    are not counted; an end tag closes what was left open inside it) and refuses the page past the limit,
    before the work that depth costs."""

    def __init__(self, filename: str, limits: ParseLimits) -> None:
        self.filename = filename
        self.limits = limits
        self.open_tags: list[str] = []

    def start(self, tag: str) -> None:
        if tag in _VOID or tag in _END_OPTIONAL:
            return
        self.open_tags.append(tag)
        if len(self.open_tags) > self.limits.max_nesting:
            raise APIError(422, f"{self.filename!r} nests elements more than {self.limits.max_nesting} deep "
                                "(server.upload_max_nesting)", code="too_deeply_nested", param="file")

    def end(self, tag: str) -> None:
        for i in range(len(self.open_tags) - 1, -1, -1):
            if self.open_tags[i] == tag:
                del self.open_tags[i:]
                return
