"""A parse process: `python -m kvfuse.service.rag.parse_worker LIMITS_JSON MEMORY_MB`, started and fed by
the API process's `ParsePool` (parse_pool.py).

Why a process: a hostile file can cost whatever its parser lets it cost, and in a thread of the API process
that cost lands on the process that answers queries (its CPU, its memory, its default thread pool). Here
it runs with its own address space capped (RLIMIT_AS: a parser that asks for more gets MemoryError, the
API process nothing), at low CPU priority (the API process and the model worker come first), and can be
killed at its deadline without harm to anything else.

The protocol, on stdin and stdout (stdout is moved off fd 1 first, so a library that prints cannot
corrupt it): each message is a 4-byte big-endian length and that many bytes. The API process sends a
JSON header `{"kind", "filename", "size"}` and then `size` bytes of the file; the process answers a JSON
object: `{"ok": {content_type, layout}}` followed by a second message, the text as UTF-8, or
`{"error": {status, message, code, param}}`, with `"retire": true` when it should not be given another file
(after a MemoryError). It first sends `{"ready": true}` once its parsers are imported. The text crosses as
framed text, not inside the JSON, and both are bounded here: the text by the document limits
(server.max_document_chars and the decompressed limit, file_limits.check_text), the JSON by `HEADER_LIMIT`;
so the API process reads at most that much, and decodes no large JSON on its event loop. Nothing is
pickled: the API process unpickles nothing a process that read a hostile file wrote.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import IO, Any

_LENGTH = struct.Struct(">I")
HEADER_LIMIT = 1024 * 1024  # the JSON of an answer (a file's layout: its page or section starts, and titles)
LOW_PRIORITY = 10  # os.nice increment: parsing yields the CPU to queries and the model worker
MB = 1024 * 1024


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def _read_message(stream: IO[bytes]) -> bytes | None:
    head = _read_exact(stream, _LENGTH.size)
    return None if head is None else _read_exact(stream, _LENGTH.unpack(head)[0])


def _send(out: IO[bytes], message: dict[str, Any], text: bytes | None = None) -> None:
    out.write(frame(json.dumps(message).encode("ascii")))  # ASCII: lone surrogates in a title survive
    if text is not None:
        out.write(frame(text))
    out.flush()


def _answer(header: dict[str, Any], data: bytes, limits: Any, memory_mb: int) -> tuple[dict[str, Any], bytes | None]:
    """(the answer's JSON, the text that follows it when the file parsed)."""
    from kvfuse.service.errors import APIError
    from kvfuse.service.rag.file_limits import encoded
    from kvfuse.service.rag.files import parse_kind

    name = header["filename"]
    try:
        parsed = parse_kind(header["kind"], data, name, limits)  # its text within the limits, or refused
        ok = {"ok": {"content_type": parsed.content_type, "layout": parsed.layout}}
        if len(json.dumps(ok)) > HEADER_LIMIT:
            raise APIError(413, f"{name!r} has {_sections(parsed.layout)} page or section starts, more than "
                                f"the {HEADER_LIMIT // 1024} kB of layout a document carries",
                           code="too_many_sections", param="file")
        return ok, encoded(parsed.text)
    except APIError as err:
        return {"error": {"status": err.status, "message": err.message, "code": err.code, "param": err.param}}, None
    except MemoryError:
        pass  # answered below, once the exception has let go of what the parser held
    return {"retire": True, "error": {
        "status": 413, "code": "parse_memory_exceeded", "param": "file",
        "message": f"{name!r} needs more than {memory_mb} MB of memory to parse, the limit of "
                   "server.upload_parse_memory_mb"}}, None


def _sections(layout: dict[str, Any]) -> int:
    return max((len(v) for v in layout.values()), default=0)


def _cap_memory(memory_mb: int) -> None:
    import resource

    if memory_mb > 0:
        limit = memory_mb * MB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: list[str]) -> int:
    try:
        os.nice(LOW_PRIORITY)  # first: even importing the parsers yields to queries
    except OSError:
        pass  # a priority that may not be lowered further: parsing runs at the priority it has
    from kvfuse.service.rag.file_limits import ParseLimits

    limits = ParseLimits(**json.loads(argv[0]))
    memory_mb = int(argv[1])
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to the log, never into the protocol
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    # Imported before the memory cap, so the cap bounds parsing, not the parsers' own code.
    import docx  # noqa: F401
    import html2text  # noqa: F401
    import markdown_it  # noqa: F401
    import pypdf  # noqa: F401

    import kvfuse.service.rag.files  # noqa: F401

    _cap_memory(memory_mb)
    _send(out, {"ready": True})
    while (raw := _read_message(inp)) is not None:
        header = json.loads(raw)
        if header.get("ping"):  # the pool asks before it hands over a file: still here?
            _send(out, {"pong": True})
            continue
        data = _read_exact(inp, header["size"]) if header["size"] else b""
        if data is None:
            return 0
        reply, text = _answer(header, data, limits, memory_mb)
        del data
        _send(out, reply, text)
        if reply.get("retire"):
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
