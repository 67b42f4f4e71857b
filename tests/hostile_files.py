"""Hostile files, written by the tests (nothing binary in the repository), each small on the wire and
costly to parse naively: a DOCX whose zip member inflates far past its size, one whose member lies about
its size, one whose text is ten times a document's limit, one whose XML is small on disk but large in memory, a PDF whose shared page tree holds ten thousand pages in under 2 kB, a PDF whose pages share one
content stream of half a million text operators (seconds of pypdf per page), and HTML nested thousands of
lists deep (html2text's work grows with the square of the depth)."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import file_fixtures as ff

from kvfuse.bench.overload import amplifying_docx  # noqa: F401 - one home: the bench floods with it too

MB = 1024 * 1024
_BODY_HEAD = (b'<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="http://schemas.openxmlformats.org/'
              b'wordprocessingml/2006/main"><w:body>')
_BODY_TAIL = b"</w:body></w:document>"


def _docx_with_body(body_writer) -> bytes:
    """A valid DOCX (python-docx's own) whose word/document.xml is replaced by what `body_writer` writes
    into the open member."""
    source = zipfile.ZipFile(io.BytesIO(ff.docx_bytes([("Bomb", "A short paragraph.")])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for item in source.infolist():
            if item.filename == "word/document.xml":
                with z.open(item.filename, "w") as member:
                    body_writer(member)
            else:
                z.writestr(item, source.read(item.filename))
    return out.getvalue()


def zip_bomb_docx(inflated_mb: int = 256) -> bytes:
    """A DOCX whose document.xml is `inflated_mb` MB of spaces: about 1/1000 of that on the wire."""
    piece = b" " * MB

    def write(member) -> None:
        member.write(_BODY_HEAD)
        for _ in range(inflated_mb):
            member.write(piece)
        member.write(_BODY_TAIL)

    return _docx_with_body(write)


def paragraphs_docx(mb: int = 40) -> bytes:
    """A DOCX of `mb` MB of one-letter paragraphs: within a size limit of that much, but an XML tree of
    several times that in memory."""
    paragraph = b"<w:p><w:r><w:t>a</w:t></w:r></w:p>" * 1000

    def write(member) -> None:
        member.write(_BODY_HEAD)
        for _ in range(mb * MB // len(paragraph)):
            member.write(paragraph)
        member.write(_BODY_TAIL)

    return _docx_with_body(write)


def lying_zip_docx(inflated_mb: int = 64, declared: int = 1000) -> bytes:
    """A DOCX whose document.xml declares `declared` bytes but inflates to `inflated_mb` MB: the size in
    its local header and in the central directory is rewritten."""
    data = bytearray(_docx_with_body(lambda m: m.write(b" " * (inflated_mb * MB))))
    name = b"word/document.xml"
    # (signature, offset of the name, offset of the uncompressed size) of a local header, a central record
    for signature, name_at, size_at in ((b"PK\x03\x04", 30, 22), (b"PK\x01\x02", 46, 24)):
        at = data.index(signature)
        while data[at + name_at: at + name_at + len(name)] != name:
            at = data.index(signature, at + 4)
        struct.pack_into("<I", data, at + size_at, declared)
    return bytes(data)


def _pdf(objects: list[bytes]) -> bytes:
    """A PDF of these objects (numbered from 1, the first the catalog), with its cross-reference table."""
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.writelines(b"%010d 00000 n \n" % o for o in offsets)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


_FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def page_tree_pdf(fan: int = 100) -> bytes:
    """A PDF of fan x fan pages (10,000 by default) in under 2 kB: one inner node listed `fan` times under
    the root, listing one page `fan` times."""
    content = b"BT /F1 12 Tf 72 720 Td (The same page again.) Tj ET"
    return _pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + b" ".join([b"3 0 R"] * fan) + b"] /Count %d >>" % (fan * fan),
        b"<< /Type /Pages /Parent 2 0 R /Kids [" + b" ".join([b"4 0 R"] * fan) + b"] /Count %d >>" % fan,
        b"<< /Type /Page /Parent 3 0 R /MediaBox [0 0 612 792] /Contents 5 0 R /Resources << /Font << /F1 6 0 R "
        b">> >> >>",
        b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
        _FONT,
    ])


def slow_pdf(operators: int = 500_000, pages: int = 50) -> bytes:
    """A PDF of `pages` pages sharing one compressed content stream of `operators` text operators: about
    6 kB, within every size and page limit, and seconds of pypdf's text extraction per page."""
    stream = zlib.compress(b"BT /F1 12 Tf 72 720 Td " + b"(a) Tj " * operators + b"ET", 9)
    return _pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + b" ".join([b"3 0 R"] * pages) + b"] /Count %d >>" % pages,
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R "
        b">> >> >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream",
        _FONT,
    ])


def nested_html(depth: int = 10_000) -> bytes:
    """`depth` lists, each inside the last one's item: about 18 bytes a level."""
    return (b"<html><body>" + b"<ul><li>" * depth + b"deep" + b"</li></ul>" * depth + b"</body></html>")
