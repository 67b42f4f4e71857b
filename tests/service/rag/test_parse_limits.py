"""Parsing uploaded files within bounds (kvfuse/service/rag/file_limits.py, parse_pool.py): hostile files
written here (tests/hostile_files.py) are refused by the check their format needs, with the setting they
broke named; in the parse processes a file past the time or memory limit is refused, its process killed
and replaced, and the next file parses as before. Real parse processes, no server."""

from __future__ import annotations

import asyncio
import os
import time

import file_fixtures as ff
import hostile_files as hf
import psutil
import pytest

from kvfuse.config import ServerSettings
from kvfuse.service.errors import APIError
from kvfuse.service.rag.file_limits import MB, ParseLimits
from kvfuse.service.rag.files import parse_file
from kvfuse.service.rag.parse_pool import ParsePool
from kvfuse.service.rag.parse_worker import LOW_PRIORITY

LIMITS = ParseLimits(max_decompressed_bytes=16 * MB, max_pages=2000, max_nesting=256)


def _refusal(data: bytes, name: str, limits: ParseLimits = LIMITS) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_file(data, name, None, limits)
    return caught.value


@pytest.mark.parametrize(("name", "make", "status", "code", "setting"), [
    ("bomb.docx", lambda: hf.zip_bomb_docx(64), 413, "upload_too_large", "server.upload_max_decompressed_mb"),
    ("pages.pdf", hf.page_tree_pdf, 413, "too_many_pages", "server.upload_max_pages"),
    ("deep.html", hf.nested_html, 422, "too_deeply_nested", "server.upload_max_nesting"),
])
def test_each_hostile_file_is_refused_at_once_naming_its_limit(name, make, status, code, setting) -> None:
    data = make()
    assert len(data) < 200_000  # small on the wire
    started = time.monotonic()
    err = _refusal(data, name)
    assert (err.status, err.code, err.param) == (status, code, "file")
    assert setting in err.message and name in err.message
    assert time.monotonic() - started < 5  # refused by its check, not after the work it would cost


def test_the_zip_check_trusts_neither_the_declared_nor_the_inflated_size_alone() -> None:
    declared = _refusal(hf.zip_bomb_docx(64), "bomb.docx")
    assert "declare" in declared.message
    # Declares 1 kB, inflates to 64 MB: inflating it is counted and stops at the size declared, where
    # its checksum fails, before python-docx reads any of it.
    started = time.monotonic()
    lying = _refusal(hf.lying_zip_docx(64, declared=1000), "lying.docx")
    assert (lying.status, lying.code) == (422, "unparsable_file") and "CRC" in lying.message
    assert time.monotonic() - started < 2


def test_the_page_count_and_nesting_limits_are_the_settings() -> None:
    small = ParseLimits(max_pages=2)
    err = _refusal(ff.pdf_bytes(), "three.pdf", small)
    assert (err.code, err.status) == ("too_many_pages", 413) and "has 3 pages" in err.message
    assert len(parse_file(ff.pdf_bytes(), "three.pdf", None, ParseLimits(max_pages=3)).layout["page_starts"]) == 3
    assert "deep" in parse_file(hf.nested_html(250), "ok.html", None, LIMITS).text  # 250 lists deep
    flat = b"<ul>" + b"<li><p>item" * 5000 + b"</ul>"  # end tags HTML lets a page leave out: not deep
    assert parse_file(flat, "flat.html", None, LIMITS).text.count("item") == 5000


def test_the_text_found_is_bounded_too() -> None:
    err = _refusal(b"word " * (2 * MB // 5 + 1), "long.txt", ParseLimits(max_decompressed_bytes=2 * MB))
    assert (err.status, err.code) == (413, "upload_too_large")


# -- the parse processes ---------------------------------------------------------------------------------

def _pool(**server: object) -> ParsePool:
    return ParsePool(ServerSettings(**{"upload_max_decompressed_mb": 16, **server}))


def _parse_processes() -> list[psutil.Process]:
    """This process's live parse processes (not the killed ones not yet reaped)."""
    found = []
    for p in psutil.Process().children():
        try:
            if "kvfuse.service.rag.parse_worker" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _exited(p: psutil.Process) -> bool:
    """Whether a process has really exited (a zombie, or reaped). Not "its command line is unreadable":
    that happens as soon as a killed process drops its memory, before it closes its pipes."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _until(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)
    return value


def _niced(p: psutil.Process) -> bool:
    try:
        return p.nice() == min(19, os.nice(0) + LOW_PRIORITY)
    except psutil.NoSuchProcess:
        return False


def test_files_parse_in_low_priority_processes_as_they_do_in_process() -> None:
    async def run() -> None:
        pool = _pool(upload_parse_workers=2)
        try:
            pool.start()
            await _until(lambda: len(ps := _parse_processes()) == 2 and all(map(_niced, ps)),
                         "two parse processes at low priority")
            for name, data in (("harbour.pdf", ff.pdf_bytes()), ("orchard.docx", ff.docx_bytes()),
                               ("orchard.html", ff.html_text().encode()), ("orchard.md", ff.markdown_text().encode())):
                kind = {"pdf": "pdf", "docx": "docx", "html": "html", "md": "markdown"}[name.rsplit(".", 1)[1]]
                assert await pool.parse(data, name, kind) == parse_file(data, name, None)
            with pytest.raises(APIError) as caught:
                await pool.parse(hf.page_tree_pdf(), "pages.pdf", "pdf")
            assert caught.value.code == "too_many_pages"
        finally:
            await pool.close()
        assert _parse_processes() == []

    asyncio.run(run())


def test_a_parse_past_the_timeout_is_killed_and_its_process_replaced() -> None:
    async def run() -> None:
        pool = _pool(upload_parse_workers=1, upload_parse_timeout_s=1.5)
        try:
            pool.start()
            (first,) = await _until(lambda: len(ps := _parse_processes()) == 1 and ps, "one parse process")
            started = time.monotonic()
            with pytest.raises(APIError) as caught:
                await pool.parse(hf.slow_pdf(), "slow.pdf", "pdf")  # minutes of extraction
            assert time.monotonic() - started < 5
            err = caught.value
            assert (err.status, err.code) == (422, "parse_timeout") and "server.upload_parse_timeout_s" in err.message
            await _until(lambda: first not in _parse_processes(), "the parse process killed at its deadline", 5)
            await _until(lambda: len(ps := _parse_processes()) == 1 and ps[0].pid != first.pid,
                         "the killed parse process replaced")
            assert (await pool.parse(b"# Notes\n\nStill parsing.", "notes.md", "markdown")).text.endswith("parsing.")
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_file_past_the_memory_cap_is_refused_and_the_process_replaced() -> None:
    async def run() -> None:
        pool = _pool(upload_parse_workers=1, upload_parse_memory_mb=256, upload_max_decompressed_mb=100)
        try:
            with pytest.raises(APIError) as caught:
                # 40 MB of one-letter paragraphs: far more than 256 MB as python-docx's XML tree
                await pool.parse(hf.paragraphs_docx(40), "tree.docx", "docx")
            err = caught.value
            assert (err.status, err.code) == (413, "parse_memory_exceeded")
            assert "server.upload_parse_memory_mb" in err.message
            assert (await pool.parse(ff.docx_bytes(), "orchard.docx", "docx")).layout["section_titles"] == [
                t for t, _ in ff.SECTIONS]
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_parse_process_killed_while_idle_is_replaced_and_no_file_blamed() -> None:
    async def run() -> None:
        pool = _pool(upload_parse_workers=1)
        try:
            assert (await pool.parse(b"# One\n\nfirst", "one.md", "markdown")).text.endswith("first")
            (first,) = _parse_processes()
            first.kill()  # the kernel's OOM killer, an operator: anything but this pool
            await _until(lambda: _exited(first), "the idle parse process gone", 5)
            assert (await pool.parse(b"# Two\n\nsecond", "two.md", "markdown")).text.endswith("second")
        finally:
            await pool.close()

    asyncio.run(run())


def test_an_upload_cancelled_during_the_ping_gives_its_parse_process_back() -> None:
    """The client leaves while its upload waits for the ping's answer: the process (stopped here with
    SIGSTOP, so the ping is in flight when the cancellation comes) is killed and replaced, not leaked, and
    the next upload parses."""
    async def run() -> None:
        pool = _pool(upload_parse_workers=1)
        try:
            pool.start()
            (first,) = await _until(lambda: len(ps := _parse_processes()) == 1 and ps, "one parse process")
            await _until(lambda: pool._idle.qsize() == 1, "the parse process idle")
            first.suspend()
            task = asyncio.create_task(pool.parse(b"# One\n\nfirst", "one.md", "markdown"))
            await _until(lambda: pool._idle.qsize() == 0, "the upload took the process and pinged it", 5)
            await asyncio.sleep(0.2)
            assert not task.done()  # waiting for the pong of a stopped process
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _until(lambda: _exited(first), "the process of the cancelled upload killed", 5)
            assert (await asyncio.wait_for(pool.parse(b"# Two\n\nsecond", "two.md", "markdown"), 30)
                    ).text.endswith("second")
            assert pool._count == 1 and len(_parse_processes()) == 1
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_file_whose_text_passes_the_document_limit_is_refused_in_the_parse_process() -> None:
    """server.max_document_chars holds in the parse process: a small DOCX that expands to more text, and
    plain text past it, are refused there (413 naming the setting); text within it, not ASCII, crosses the
    pipe as framed UTF-8 unchanged."""
    async def run() -> None:
        pool = _pool(upload_parse_workers=1, max_document_chars=1_000_000, upload_max_decompressed_mb=100)
        try:
            data = hf.amplifying_docx(3_000_000)
            assert len(data) < 100_000
            for name, body, kind in (("wide.docx", data, "docx"),
                                     ("wide.txt", ("\u4e2d" * 1_000_001).encode(), "text")):
                with pytest.raises(APIError) as caught:
                    await pool.parse(body, name, kind)
                err = caught.value
                assert (err.status, err.code, err.param) == (413, "document_too_large", "file"), err.message
                assert "server.max_document_chars" in err.message and name in err.message
            text = "Caf\u00e9 \u4e2d\u6587 \U0001f600 " * 60_000  # 4-byte characters too, at the limit's edge
            assert len(text) <= 1_000_000
            assert (await pool.parse(text.encode(), "wide.md", "markdown")).text == text
        finally:
            await pool.close()

    asyncio.run(run())


def test_uploads_past_the_waiters_bound_are_429_at_once() -> None:
    """One parse process busy with a slow PDF, one upload waiting for it: the next is refused at once
    (429 naming server.upload_parse_waiters, with Retry-After), and the waiting one parses once the slow
    one is stopped at its deadline."""
    async def run() -> None:
        pool = _pool(upload_parse_workers=1, upload_parse_waiters=1, upload_parse_timeout_s=2)
        try:
            pool.start()
            await _until(lambda: pool._idle.qsize() == 1, "the parse process idle")
            slow = asyncio.create_task(pool.parse(hf.slow_pdf(), "slow.pdf", "pdf"))
            await _until(lambda: pool._idle.qsize() == 0, "the slow PDF parsing", 5)
            waiting = asyncio.create_task(pool.parse(b"# Two\n\nsecond", "two.md", "markdown"))
            await _until(lambda: pool._waiters == 1, "one upload waiting", 5)
            started = time.monotonic()
            with pytest.raises(APIError) as caught:
                await pool.parse(b"# Three\n\nthird", "three.md", "markdown")
            assert time.monotonic() - started < 0.5
            err = caught.value
            assert (err.status, err.code, err.headers["Retry-After"]) == (429, "parsers_busy", "1")
            assert "server.upload_parse_waiters" in err.message
            with pytest.raises(APIError):
                await slow
            assert (await asyncio.wait_for(waiting, 60)).text.endswith("second")
        finally:
            await pool.close()

    asyncio.run(run())
