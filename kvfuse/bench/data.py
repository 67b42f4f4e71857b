"""Where the evaluation data lives and how it is read.

The data is not part of the package: the setting `bench.data_dir` names it (env KVFUSE_BENCH__DATA_DIR;
by default `../shared/data` from the working directory, i.e. beside the repository when run from its
root), and every bench command's `--data-dir` overrides it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvfuse.config import ConfigError, Settings

ESSAYS_DIR = "paul_graham_essays"
MUSIQUE_FILE = "musique/musique_s.json"
DATA_DIR_HELP = "evaluation data (default: the setting bench.data_dir, env KVFUSE_BENCH__DATA_DIR)"


class DataError(ConfigError):
    """The evaluation data is missing; the message says where it was looked for and how to set it.

    A ConfigError, so `kvfuse bench ...` prints it and exits 2 like any other bad setting."""


def resolve_data_dir(data_dir: str | Path | None = None, settings: Settings | None = None) -> Path:
    """`data_dir` (a `--data-dir` flag) if given, else the setting `bench.data_dir`; checked to hold the
    essays. `settings` defaults to the process-wide ones."""
    if data_dir:
        path, source = Path(data_dir), "--data-dir"
    else:
        if settings is None:
            from kvfuse.config import get_settings

            settings = get_settings()
        path, source = settings.bench.data_dir, "the setting bench.data_dir"
    if not (path / ESSAYS_DIR).is_dir():
        raise DataError(
            f"evaluation data not found: {path / ESSAYS_DIR} does not exist ({path} comes from {source}); "
            "set bench.data_dir in config.yaml or KVFUSE_BENCH__DATA_DIR, or pass --data-dir"
        )
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
        raise DataError(f"MuSiQue sample not found: {path} (set bench.data_dir or --data-dir)")
    items = []
    for raw in json.loads(path.read_text(encoding="utf-8")):
        passages = tuple(
            (f"{c['title']}\n{c['text']}" if c.get("title") else c["text"]).strip() for c in raw["ctxs"]
        )
        items.append(MusiqueItem(raw["question"].strip(), tuple(raw["answers"]), passages))
    return tuple(items)
