"""The parse processes of the API process: every uploaded file is parsed in one of them, never here.

Parsing in a thread (as before) put a hostile file's cost on the process that answers queries: a zip bomb
could take its memory, a slow PDF held one of the few threads of asyncio's default pool that query
preparation also uses, and nothing could stop a parse that ran on. So `ParsePool` keeps
`server.upload_parse_workers` processes (parse_worker.py: capped address space, low CPU priority) and talks
to each over its pipes with the event loop alone (no thread waits on a parse). A parse that passes
`server.upload_parse_timeout_s` is answered 422 and its process killed; a process that dies or runs out
of memory is replaced (each is pinged before it is handed a file, so one that died while idle costs no
upload a 422); a replacement starts in the background, so the next upload finds a warm one. What
a parser may produce is bounded inside the process (file_limits.py, with the document's own character
limit): what comes back is a small JSON answer and the text as framed UTF-8, each read within its bound,
so a file that expands is refused there and nothing larger than a document may be crosses into this
process or is decoded on its event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import struct
import sys
from typing import TYPE_CHECKING, Any

from kvfuse.service.errors import APIError
from kvfuse.service.rag.file_limits import ParseLimits, decoded, text_limit
from kvfuse.service.rag.files import ParsedFile
from kvfuse.service.rag.parse_worker import HEADER_LIMIT, frame

if TYPE_CHECKING:
    from kvfuse.config import ServerSettings
    from kvfuse.service.metrics import Metrics

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0  # a parse process imports its parsers (about a second, at low priority), then says so
_ANSWER_STATUSES = frozenset({413, 415, 422})  # all a parse process may answer with; anything else is 422


class _Process:
    """One parse process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, limits: ParseLimits, memory_mb: int) -> _Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvfuse.service.rag.parse_worker", json.dumps(limits.to_dict()), str(memory_mb),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        worker = cls(proc)
        try:
            ready = await asyncio.wait_for(worker.receive(1024), _START_TIMEOUT_S)
        except BaseException:
            await worker.kill()
            raise
        if ready.get("ready") is not True:
            await worker.kill()
            raise RuntimeError(f"a parse process started with {ready!r} instead of ready")
        return worker

    async def ask(self, header: dict[str, Any], data: bytes, text_limit: int = 0) -> dict[str, Any]:
        """The process's answer; a parsed file's text (the message after an `ok`, at most `text_limit`
        bytes) is put into it as `ok.text`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame(json.dumps({**header, "size": len(data)}).encode()))
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()
        reply = await self.receive(HEADER_LIMIT)
        if isinstance(reply.get("ok"), dict):
            reply["ok"]["text"] = decoded(await self._read(text_limit))
        return reply

    async def answers(self) -> bool:
        """Whether the process answers a ping (before it is handed a file): a process that died while idle
        fails here, not on the file. A process that does not answer within a start's time is killed."""
        if self.ended():
            return False
        try:
            reply = await asyncio.wait_for(self.ask({"ping": True}, b""), _START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            return False
        return reply.get("pong") is True

    async def receive(self, limit: int) -> dict[str, Any]:
        """One JSON message; raises IncompleteReadError when the process has ended, ValueError for a
        message that is not what a parse process sends."""
        message = json.loads(await self._read(limit))
        if not isinstance(message, dict):
            raise ValueError("a parse process answered something other than a JSON object")
        return message

    async def _read(self, limit: int) -> bytes:
        """One framed message of at most `limit` bytes (ValueError past it, before it is read)."""
        assert self.proc.stdout is not None
        (n,) = struct.unpack(">I", await self.proc.stdout.readexactly(4))
        if n > limit:
            raise ValueError(f"a parse process answered {n} bytes, over {limit}")
        return await self.proc.stdout.readexactly(n)

    def ended(self) -> bool:
        """Whether the process has exited, even before asyncio has reaped it and set its return code (a
        process killed while idle is a zombie until then, and its pipes are already closed)."""
        if self.proc.returncode is not None or (self.proc.stdout is not None and self.proc.stdout.at_eof()):
            return True
        try:  # WNOWAIT: look without reaping, so asyncio's child watcher still collects its status
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # already reaped
            return True

    def exit_text(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "ended" if self.ended() else "still running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def signal_kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    async def kill(self) -> None:
        self.signal_kill()
        await self.proc.wait()


class ParsePool:
    """`await pool.parse(data, filename, kind)`: a `ParsedFile`, or the APIError the file earned."""

    def __init__(self, server: ServerSettings, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self.limits = ParseLimits.of(server)
        self.size = server.upload_parse_workers
        self.timeout_s = server.upload_parse_timeout_s
        self.memory_mb = server.upload_parse_memory_mb
        self.retry_after_s = max(1, server.retry_after_s)
        self.max_waiters = server.upload_parse_waiters
        self._waiters = 0  # uploads waiting for an idle process, each holding its file
        self.text_limit = text_limit(self.limits)
        self._idle: asyncio.Queue[_Process] | None = None
        self._count = 0  # processes running or starting
        self._tasks: set[asyncio.Task] = set()
        self._busy: set[_Process] = set()
        self._closed = False

    def start(self) -> None:
        """Start the processes now (on the event loop), so the first upload finds them warm."""
        if self._idle is None:
            self._idle = asyncio.Queue()
        self._fill()

    async def parse(self, data: bytes, filename: str, kind: str) -> ParsedFile:
        try:
            return await self._parse(data, filename, kind)
        except APIError as err:
            if self.metrics is not None:
                self.metrics.uploads_refused.labels(err.code or "").inc()
            raise

    async def _parse(self, data: bytes, filename: str, kind: str) -> ParsedFile:
        worker = await self._acquire(filename)
        reply: dict[str, Any] | None = None
        self._busy.add(worker)
        try:
            reply = await asyncio.wait_for(worker.ask({"kind": kind, "filename": filename}, data, self.text_limit),
                                           self.timeout_s)
        except TimeoutError:
            raise APIError(422, f"parsing {filename!r} took longer than {self.timeout_s:g} s, the limit of "
                                "server.upload_parse_timeout_s", code="parse_timeout", param="file") from None
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as err:
            await worker.kill()
            log.warning("the parse process reading %r ended (%s): %s", filename, worker.exit_text(), err)
            raise APIError(422, f"{filename!r} cannot be parsed: the parser stopped on it ({worker.exit_text()}; "
                                f"it may have needed more than server.upload_parse_memory_mb = {self.memory_mb})",
                           code="unparsable_file", param="file") from None
        finally:
            self._busy.discard(worker)
            self._release(worker, keep=reply is not None and not reply.get("retire"))
        return self._parsed(reply)

    def check_room(self) -> None:
        """429 when no process is idle and `server.upload_parse_waiters` uploads already wait (asked also
        before an upload's body is read, api/uploads.py)."""
        self.start()
        assert self._idle is not None
        if self._idle.empty() and self._waiters >= self.max_waiters:
            raise APIError(429, f"every file parser is busy and {self._waiters} uploads wait for one "
                                "(server.upload_parse_waiters); retry later", code="parsers_busy",
                           param="file", headers={"Retry-After": str(self.retry_after_s)})

    async def _acquire(self, filename: str) -> _Process:
        """An idle process, starting any missing. With none idle, at most `server.upload_parse_waiters`
        uploads wait (one more is 429 at once: each waiter holds its file); 503 when none frees up within
        the parse timeout, and at least the time a process may take to start (every one is busy with
        files that take long, or none can start)."""
        self.check_room()
        assert self._idle is not None
        wait_s = max(self.timeout_s, _START_TIMEOUT_S)
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            self._waiters += 1
            try:
                worker = await asyncio.wait_for(self._idle.get(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise APIError(503, f"no file parser was free within {wait_s:g} s to read {filename!r}: try "
                                    "again later", code="parsers_busy",
                               headers={"Retry-After": str(self.retry_after_s)}) from None
            finally:
                self._waiters -= 1
            try:
                alive = await worker.answers()
            except BaseException:  # cancelled mid-ping (the upload's client left): its pong may still be
                self._release(worker, keep=False)  # on the way, so the process is not reused but replaced
                raise
            if alive:
                return worker
            log.warning("an idle parse process had ended (%s): replacing it", worker.exit_text())
            self._release(worker, keep=False)  # ended while idle (killed from outside): not this file's doing

    def _parsed(self, reply: dict[str, Any]) -> ParsedFile:
        if "ok" in reply:
            ok = reply["ok"]
            return ParsedFile(str(ok["text"]), str(ok["content_type"]), dict(ok.get("layout") or {}))
        err = reply.get("error") or {}
        status = err.get("status") if err.get("status") in _ANSWER_STATUSES else 422
        raise APIError(status, str(err.get("message", "the file cannot be parsed")),
                       code=str(err.get("code") or "unparsable_file"), param="file")

    def _release(self, worker: _Process, *, keep: bool) -> None:
        if keep and not self._closed and self._idle is not None:
            self._idle.put_nowait(worker)
            return
        self._count -= 1
        worker.signal_kill()  # a timed-out, crashed or retired process stops now, and is reaped in the background
        self._spawn_task(worker.kill())
        if not self._closed:
            self._fill()

    def _fill(self) -> None:
        while self._count < self.size and not self._closed:
            self._count += 1
            self._spawn_task(self._start_one())

    async def _start_one(self) -> None:
        try:
            worker = await _Process.start(self.limits, self.memory_mb)
        except Exception as err:  # noqa: BLE001 - the next upload tries again; this one may time out as busy
            self._count -= 1
            log.error("a parse process could not start: %s", err)
            return
        if self._closed or self._idle is None:
            await worker.kill()
            return
        self._idle.put_nowait(worker)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Kill every parse process (an upload still parsing gets 422) and wait for them."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        idle: list[_Process] = []
        while self._idle is not None and not self._idle.empty():
            idle.append(self._idle.get_nowait())
        await asyncio.gather(*(w.kill() for w in [*idle, *self._busy]), *self._tasks, return_exceptions=True)
