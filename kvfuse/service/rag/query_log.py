"""The query log (`fidelity.query_log`, off by default): the recent answered queries, so that `kvfuse
calibrate --from-log` measures the ratio on the questions users ask rather than on a file someone wrote.

One JSON line per answered query in `data_dir/query-log.jsonl`, beside the fidelity state: the question,
the collections searched, the named documents, the filters, a system prompt other than the configured
one, the method and ratio used, the prompt-size bucket and when (UTC). Never the answer, never the key.
It does hold users' text: `DELETE /v1/query-log` empties it (docs/usage.md, "The quality contract").

Writes go to one thread of their own, in order, so a request never waits for the disk. The file is
appended to and, once it holds a quarter more than `fidelity.query_log_size` lines, rewritten with the
last `query_log_size`; readers take the last `query_log_size`. Appends and rewrites take an exclusive
lock on a file beside it (`query-log.jsonl.lock`), so several API processes sharing a data_dir on one
host interleave whole lines and never lose a rewrite; each counts only its own appends, so between
rewrites the file may hold up to that many lines per process.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfuse.service.rag.fidelity_control import size_bucket

if TYPE_CHECKING:
    from kvfuse.config import Settings

log = logging.getLogger(__name__)

LOG_FILE = "query-log.jsonl"


def log_path(settings: Settings) -> Path:
    return settings.data_dir / LOG_FILE


def entry_of(settings: Settings, run: Any) -> dict[str, Any]:
    """What the log keeps of an answered query (a rag.query.QueryRun, read by duck type so the log does
    not import the query path that calls it): what chose its chunks and its prompt, and what it was
    answered with (method, ratio, prompt-size bucket of the chunks that went in)."""
    plan = run.plan
    named = list(dict.fromkeys(c.document_id for c in plan.chunks)) if plan.explicit else None
    system = plan.system_prompt if plan.system_prompt != settings.model.system_prompt else None
    context = sum(len(c.token_ids) for c in run.sources)
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "question": plan.question,
            "collections": None if named is not None else plan.retrieval.searched, "document_ids": named,
            "filters": plan.filters or None, "top_k": None if named is not None else plan.top_k,
            "retrieval_mode": None if named is not None else plan.retrieval.mode, "system_prompt": system,
            "method": plan.fusion["method"], "recompute_ratio": plan.fusion["recompute_ratio"],
            "size_bucket": size_bucket(context, settings.fidelity.size_buckets)}


def read_log(path: Path, size: int) -> list[dict[str, Any]]:
    """The last `size` entries, oldest first ([] when there is no log); a torn or foreign line is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("question"), str):
            out.append(row)
    return out[-size:]


class QueryLog:
    """The API process's writer: `record` (on the event loop) hands the line to the writer thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.enabled = settings.fidelity.query_log
        self.size = settings.fidelity.query_log_size
        self.path = log_path(settings)
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._lines: int | None = None  # lines in the file as this process knows them; counted at first use
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvfuse-query-log")

    def record(self, run: Any) -> None:
        """Log an answered query, if the log is on; the disk is touched on the writer thread."""
        if self.enabled:
            self._writer.submit(self._append_logged, entry_of(self.settings, run))

    def clear(self) -> concurrent.futures.Future[int]:
        """Empty the log after the lines already handed to the writer; the future gives the entries dropped."""
        return self._writer.submit(self._clear)

    def close(self) -> None:
        """Finish the pending writes."""
        self._writer.shutdown(wait=True)

    # -- the writer thread ----------------------------------------------------------------------------------
    def _locked(self) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self._lock_path, "a")  # noqa: SIM115 - closed by the caller's `with`
        fcntl.flock(f, fcntl.LOCK_EX)  # released when closed
        return f

    def _append_logged(self, entry: dict[str, Any]) -> None:
        try:
            self.append(entry)
        except OSError as err:
            log.warning("query log not written: %s", err)

    def append(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        with self._locked():
            if self._lines is None:
                self._lines = self._count()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            self._lines += 1
            if self._lines >= self.size + max(1, self.size // 4):
                self._lines = self._trim()

    def _count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def _trim(self) -> int:
        """Rewrite the file with its last `size` lines (under the lock); the lines kept."""
        from kvfuse.retriever.files import atomic_write

        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)[-self.size:]
        atomic_write(self.path, "".join(lines).encode())
        return len(lines)

    def _clear(self) -> int:
        with self._locked():
            dropped = len(read_log(self.path, self.size))
            self.path.unlink(missing_ok=True)
            self._lines = 0
            return dropped
