"""Small files of every kind file ingestion reads, written here from known text (no binary blobs in the
repository): a PDF by fpdf2 (pure Python), a DOCX by python-docx, HTML and Markdown as text. Each comes
with the text a parser should find, page by page or section by section, so tests and the parser study
(studies/parser_choice.py) can score what a parser extracts."""

from __future__ import annotations

import io

# Each page and section is longer than a 64-token chunk, its telling fact last: the chunk holding the fact
# starts on that page or in that section whatever the chunking.
PAGES = [
    "Harbour records. The lighthouse stands on a rock at the mouth of the bay, painted white with one red band. The lighthouse keeper of Port Ellery kept a daily log of the weather for forty years. "
    "He wrote down the wind, the swell and the colour of the sky each morning and each evening. The fishermen "
    "read his log before they went out. In 1887 the lighthouse keeper logged 212 storms.",
    "Trade ledger. Copper came down from the hill mines on carts pulled by oxen, two days on a muddy road. The copper merchants of Port Ellery kept their accounts in a green leather ledger. Each "
    "crate was sealed with red wax and numbered by hand before it was loaded onto the ships in the outer "
    "basin. In their best year the copper merchants shipped 4,380 crates to Lisbon.",
    "Closing note. The port office was a narrow stone house beside the fish market, with a clock above its door. The harbour master kept the keys of the archive and the seal of the port office. When the "
    "new breakwater was finished the port office moved to the station square. The harbour master retired in "
    "1903 and the logbooks went to the town archive.",
]
SECTIONS = [
    ("Origins", "Old maps show only heath and a shepherd hut on the ridge before the first war. The Veldmark orchard lies on a sandy ridge east of the river, sheltered by a row of poplars. "
                "The soil drains quickly and warms early in spring. The orchard was planted in 1921 by the "
                "Aalders family, and its first trees were pears."),
    ("Harvest", "The harvest is the busiest time of the year, and students from the town come to help. Picking starts with the early apples at the end of August and ends with the late pears. "
                "Pickers work from ladders in the morning and sort the fruit in the barn after lunch. Every "
                "October the orchard picks about 9,000 kilograms of fruit."),
    ("Visitors", "A small shop in the old barn sells juice, jam and cider to visitors who come by bicycle. The orchard opens its gates to walkers on Sundays, and the path along the ridge is marked "
                 "with wooden posts. School classes visit in May, when the blossoms open, and each class "
                 "plants one tree."),
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
