"""Which maintained parser file ingestion uses per file type: text found, noise kept, structure kept, speed
and install size, on files written from known text (tests/file_fixtures.py) and on larger ones built from
an essay. Prints the markdown table of docs/results/parsers/README.md.

    PYTHONPATH=$PWD .venv/bin/python studies/parser_choice.py --essay ../shared/data/paul_graham_essays/todo.txt
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures the tests ingest
import file_fixtures as ff  # noqa: E402

WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9,']*")
NOISE = {"tracking", "index", "color", "red", "var"}  # words of the HTML fixture's script and style only


def words(text: str) -> list[str]:
    return [w.lower().strip(",") for w in WORD.findall(text)]


def pypdf_text(data: bytes) -> str:
    from pypdf import PdfReader

    return "\n\n".join(p.extract_text() or "" for p in PdfReader(io.BytesIO(data)).pages)


def pdfminer_text(data: bytes) -> str:
    from pdfminer.high_level import extract_text

    return extract_text(io.BytesIO(data))


def html2text_text(data: bytes) -> str:
    import html2text

    h = html2text.HTML2Text()
    h.body_width, h.ignore_links, h.ignore_images = 0, True, True
    return h.handle(data.decode())


def inscriptis_text(data: bytes) -> str:
    from inscriptis import get_text

    return get_text(data.decode())


def bs4_text(data: bytes) -> str:
    from bs4 import BeautifulSoup

    return BeautifulSoup(data.decode(), "html.parser").get_text("\n")


def docx_text(data: bytes) -> str:
    import docx

    return "\n\n".join(p.text for p in docx.Document(io.BytesIO(data)).paragraphs)


CANDIDATES = {
    "PDF": [("pypdf", "pypdf", pypdf_text), ("pdfminer.six", "pdfminer.six", pdfminer_text)],
    "HTML": [("html2text", "html2text", html2text_text), ("inscriptis", "inscriptis", inscriptis_text),
             ("BeautifulSoup get_text", "beautifulsoup4", bs4_text)],
    "DOCX": [("python-docx", "python-docx", docx_text)],
}
BASE = {"typing-extensions", "typing_extensions", "charset-normalizer", "charset_normalizer", "requests",
        "urllib3", "idna", "certifi"}  # already installed by the service's other dependencies


def install_mb(dist: str, seen: set[str] | None = None) -> float:
    """MB on disk of `dist` and the dependencies it pulls in that the service does not have already."""
    seen = set() if seen is None else seen
    if dist.lower() in seen or dist in BASE:
        return 0.0
    seen.add(dist.lower())
    try:
        d = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return 0.0
    size = sum((f.size or 0) for f in d.files or [])
    for req in d.requires or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]
        size += install_mb(name, seen) * 1e6
    return size / 1e6


def samples(essay: str) -> dict[str, tuple[bytes, list[str], bytes]]:
    """Per type: (the small fixture, its known texts, a larger file from the essay)."""
    paras = [p for p in essay.split("\n\n") if p.strip()]
    pages = [" ".join(paras[i:i + 3]) for i in range(0, min(len(paras), 60), 3)]
    sections = [(f"Part {i}", p) for i, p in enumerate(paras[:40])]
    known_html = [t for pair in ff.SECTIONS for t in pair] + ["Year", "Trees", "1921", "40"]
    return {
        "PDF": (ff.pdf_bytes(), ff.PAGES, ff.pdf_bytes([p.encode("latin-1", "replace").decode("latin-1")
                                                       for p in pages])),
        "HTML": (ff.html_text().encode(), known_html, ff.html_text(sections).encode()),
        "DOCX": (ff.docx_bytes(), [t for pair in ff.SECTIONS for t in pair], ff.docx_bytes(sections)),
    }


def timed_ms(fn, data: bytes, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--essay", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| type | parser | known words found (small / large) | script and style words kept | structure kept "
          "| ms per large file | install MB |")
    print("|---|---|---|---|---|---|---|")
    essay = args.essay.read_text(encoding="utf-8")
    for kind, (small, known, large) in samples(essay).items():
        large_known = _large_known(kind, essay)
        for label, dist, fn in CANDIDATES[kind]:
            text = fn(small)
            found, found_large = recall(text, known), recall(fn(large), large_known)
            noise = sum(1 for w in words(text) if w in NOISE) if kind == "HTML" else "-"
            if kind == "HTML":
                structure = "headings as `##`" if "## Harvest" in text else "none"
            elif kind == "PDF":
                structure = "pages"  # both read page by page
            else:
                structure = "heading styles"
            ms = timed_ms(fn, large, args.repeats)
            print(f"| {kind} | {label} | {found:.0%} / {found_large:.0%} | {noise} | {structure} | {ms:.1f} "
                  f"| {install_mb(dist):.1f} |")
    sizes = ", ".join(f"{k} {len(v[2]) // 1024} KiB" for k, v in samples(essay).items())
    print(f"\nlarge files ({args.essay.name}): {sizes}; median of {args.repeats} parses each")


def recall(text: str, known: list[str]) -> float:
    """The share of the known text's distinct words that the extracted text holds."""
    want, got = set(words(" ".join(known))), set(words(text))
    return len(want & got) / len(want)


def _large_known(kind: str, essay: str) -> list[str]:
    paras = [p for p in essay.split("\n\n") if p.strip()]
    if kind == "PDF":
        return [p.encode("latin-1", "replace").decode("latin-1") for p in paras[:60]]
    return paras[:40]


if __name__ == "__main__":
    main()
