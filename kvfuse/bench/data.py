"""Where the evaluation data lives and how it is read.

The data is not part of the project tree: it sits in `../shared/data` beside the repository root
(`--data-dir` overrides)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
ESSAYS_DIR = "paul_graham_essays"
MUSIQUE_FILE = "musique/musique_s.json"


class DataError(FileNotFoundError):
    """The evaluation data is missing; the message says where it was looked for."""


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    path = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    if not (path / ESSAYS_DIR).is_dir():
        raise DataError(f"evaluation data not found: {path / ESSAYS_DIR} (set --data-dir)")
    return path


@lru_cache(maxsize=4)
def load_essays(data_dir: Path) -> tuple[tuple[str, str], ...]:
    """(name, text) of every essay, sorted by name: a stable haystack order for a given seed."""
    folder = Path(data_dir) / ESSAYS_DIR
    return tuple((p.stem, p.read_text(encoding="utf-8")) for p in sorted(folder.iterdir()) if p.is_file())


@dataclass(frozen=True)
class MusiqueItem:
    question: str
    answers: tuple[str, ...]
    passages: tuple[str, ...]  # "title\ntext" (titles are often empty in this sample)


@lru_cache(maxsize=4)
def load_musique(data_dir: Path) -> tuple[MusiqueItem, ...]:
    path = Path(data_dir) / MUSIQUE_FILE
    if not path.is_file():
        raise DataError(f"MuSiQue sample not found: {path}")
    items = []
    for raw in json.loads(path.read_text(encoding="utf-8")):
        passages = tuple(
            (f"{c['title']}\n{c['text']}" if c.get("title") else c["text"]).strip() for c in raw["ctxs"]
        )
        items.append(MusiqueItem(raw["question"].strip(), tuple(raw["answers"]), passages))
    return tuple(items)
