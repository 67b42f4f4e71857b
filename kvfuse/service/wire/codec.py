"""The wire form of the protocol messages when they cross Redis instead of a pipe.

The local worker's pipe pickles `protocol.py`'s dataclasses; a Redis stream entry holds flat string
fields, and a remote worker must never be able to make the API unpickle something. So each message is
written as `{"t": <class name>, "d": <JSON of its fields>}` and read back into the same dataclass: one
codec, the same message types on both transports (docs/DESIGN.md, "Scale-out").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvfuse.service.wire import protocol as P

_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    P.QueryJob, P.PrecomputeJob, P.Cancel, P.Shutdown, P.Ready, P.Fatal, P.Plan, P.Delta, P.Result, P.Done,
    P.Error, P.Step, P.ShadowResult, P.ShadowDropped,
)}


class CodecError(ValueError):
    """An entry that is not a protocol message."""


def encode(msg: Any, **extra: str) -> dict[str, str]:
    """A message as stream fields; `extra` adds routing fields (reply stream, job uid, worker)."""
    name = type(msg).__name__
    if name not in _TYPES:
        raise CodecError(f"not a protocol message: {name}")
    return {"t": name, "d": json.dumps(dataclasses.asdict(msg), separators=(",", ":")), **extra}


def decode(fields: dict[str, str]) -> Any:
    """The dataclass of stream fields written by `encode`."""
    cls = _TYPES.get(fields.get("t", ""))
    if cls is None:
        raise CodecError(f"unknown message type {fields.get('t')!r}")
    try:
        data = json.loads(fields["d"])
        if cls is P.QueryJob:
            data["chunks"] = [P.ChunkRef(**c) for c in data["chunks"]]
        return cls(**data)
    except (KeyError, TypeError, ValueError) as err:
        raise CodecError(f"malformed {cls.__name__}: {err}") from None
