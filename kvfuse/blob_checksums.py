"""How a KV blob's bytes are checked: CRC32 over the payload, over each block, and during a copy.

CRC32 guards against bit rot and truncation, not tampering; it is on the cold-read path of every blob,
so speed matters more than strength. A mismatch is a `CorruptBlobError`: the caller rebuilds the chunk's
KV from its stored text. The format that carries the checksums is `kvfuse.kvblob`.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch
from torch import Tensor

CHECKSUM_ALGO = "crc32"
_COPY_BLOCK = 1 << 18  # copy_payload checksums each 256 KB block while it is in cache from the copy


class CorruptBlobError(Exception):
    """The bytes are not a valid kvfuse KV blob (bad container, wrong format version, checksum mismatch).

    The caller rebuilds the chunk's KV from the stored text."""


def checksum(*parts: memoryview | bytes | bytearray) -> str:
    # CRC32 (zlib) rather than a cryptographic hash: several times faster, and only bit rot is guarded against.
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return f"{CHECKSUM_ALGO}:{crc:08x}"


def bytes_view(t: Tensor) -> memoryview:
    # uint8 view -> numpy works for bfloat16 too (numpy has no bfloat16); no copy.
    return memoryview(t.view(torch.uint8).reshape(-1).numpy().data)


def block_checksum(k: Any, v: Any, start: int, stop: int) -> str:
    """Checksum of tokens [start, stop) of k and v [L, Hkv, n, D]: k's then v's rows, layer by layer, head by
    head (the bytes `read_blocks` copies for that block). A quantized k or v (kvfuse.kv_formats.QTensor)
    contributes each of its tensors over those tokens in turn: codes, then scales (and zeros) of them."""
    views = []
    for x in (k, v):
        parts = x.tokens(start, stop).parts() if hasattr(x, "tokens") else [x[:, :, start:stop]]
        views += [bytes_view(p.contiguous()) for p in parts]
    return checksum(*views)


def check(stored: str, computed: str) -> None:
    if computed != stored:
        raise CorruptBlobError(f"blob checksum mismatch: stored {stored}, computed {computed}")


def copy_payload(src: memoryview, expected: str | None, into: np.ndarray | None = None) -> bytearray | memoryview:
    """Copy with plain memcpy (numpy's, single-threaded: a torch clone runs on the intra-op pool, which is
    slower on a busy host). With `expected` (a checksum), each block is checksummed right after it is
    copied, while still in cache, rather than in a second pass over the bytes. `into`: a writable buffer
    of src's size to copy into instead of a new bytearray.

    Both the copy (numpy) and the CRC (zlib, on buffers over a few KB) release the GIL, so blobs read on
    several threads (kvfuse.store.parallel_reads) copy and check in parallel."""
    dst = bytearray(src.nbytes) if into is None else into.data.cast("B")
    d, s = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    if expected is None:
        np.copyto(d, s)
        return dst
    out, crc = memoryview(dst), 0
    for off in range(0, src.nbytes, _COPY_BLOCK):
        np.copyto(d[off : off + _COPY_BLOCK], s[off : off + _COPY_BLOCK])
        crc = zlib.crc32(out[off : off + _COPY_BLOCK], crc)
    check(expected, f"{CHECKSUM_ALGO}:{crc:08x}")
    return dst
