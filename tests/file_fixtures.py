"""Small files of every kind file ingestion reads, written here from known text (no binary blobs in the
repository): a PDF by fpdf2 (pure Python), a DOCX by python-docx, HTML and Markdown as text. Each comes
with the text a parser should find, page by page or section by section, so tests and the parser study
(studies/parser_choice.py) can score what a parser extracts."""

from __future__ import annotations

import io

PAGES = [
    "Harbour records. The lighthouse keeper of Port Ellery logged 212 storms in 1887. "
    "Ships waited in the outer basin until the tide turned.",
    "Trade ledger. The copper merchants of Port Ellery shipped 4,380 crates to Lisbon. "
    "Each crate was sealed with red wax and numbered by hand.",
    "Closing note. The harbour master retired in 1903 and the logbooks went to the town archive.",
]
SECTIONS = [
    ("Origins", "The Veldmark orchard was planted in 1921 by the Aalders family. Its first trees were pears."),
    ("Harvest", "Every October the orchard picks about 9,000 kilograms of fruit. The cider press runs for "
                "three weeks."),
    ("Visitors", "School classes visit in May, when the blossoms open, and plant one tree each year."),
]


def pdf_bytes(pages: list[str] = PAGES, *, password: str | None = None) -> bytes:
    """A PDF with one page per text (fpdf2); encrypted with `password` if given."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    if password:
        pdf.set_encryption(owner_password=password, user_password=password)
    return bytes(pdf.output())


def docx_bytes(sections: list[tuple[str, str]] = SECTIONS) -> bytes:
    """A DOCX with a Heading 1 per section and its paragraph (python-docx)."""
    import docx

    d = docx.Document()
    for title, body in sections:
        d.add_heading(title, level=1)
        d.add_paragraph(body)
    buf = io.BytesIO()
    d.save(buf)
    return buf.getvalue()


def html_text(sections: list[tuple[str, str]] = SECTIONS) -> str:
    """An HTML page with a navigation bar, a script and a style (none of it text to keep), an <h2> per
    section and its paragraph, and a table."""
    body = "".join(f"<h2>{t}</h2>\n<p>{b}</p>\n" for t, b in sections)
    return ("<!DOCTYPE html><html><head><title>Veldmark</title><style>p { color: red; }</style>"
            "<script>var tracking = 'do not index me';</script></head><body>"
            "<nav><a href='/'>Home</a> | <a href='/about'>About</a></nav>\n"
            f"<main>{body}<table><tr><th>Year</th><th>Trees</th></tr><tr><td>1921</td><td>40</td></tr></table>"
            "</main></body></html>")


def markdown_text(sections: list[tuple[str, str]] = SECTIONS) -> str:
    """Markdown with a `#` heading per section, and a fenced code block whose `#` line is no heading."""
    parts = [f"# {t}\n\n{b}\n" for t, b in sections]
    parts.insert(1, "```sh\n# not a heading\necho hi\n```\n")
    return "\n".join(parts)
