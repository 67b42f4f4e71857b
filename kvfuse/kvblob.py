"""The one on-disk format of a chunk's KV cache, shared by `fusion` and `store`.

A blob is a standard safetensors container: tensors `k` and `v`, both `[num_layers, num_kv_heads,
num_tokens, head_dim]`, and string metadata (format version, model fingerprint, KV format, shapes, token
hash, position convention, payload checksum). Any safetensors reader can open it; `decode` parses the
header itself so the tensors can be views of the caller's buffer (an LMDB memory map, a bytes object)
with no copy.

The KV format (`dtype` in the metadata, `store.kv_dtype`) is a float dtype or a quantized format
(kvfuse/kv_formats.py): then `k` and `v` hold codes and `k.scale`, `v.scale` (and `k.zero`, `v.zero`)
follow them, all inside the checksummed payload; decoding gives a `kv_formats.QTensor` for each.

Keys are post-RoPE at positions 0..n-1 ("rope0"); values carry no position.

Version 2 (docs/methods/samkv.md, "Sparse loading"): the same `k` and `v` at the same offsets, plus
- a checksum per block of `block_tokens` tokens (k then v of the block, layer by layer, head by
  head), so `read_blocks` can copy and verify a few blocks without reading the rest of the blob;
- optional per-chunk artifacts after `v` (tensors named `a.<name>`, with their own checksum), e.g.
  the sparse-attention analysis of `kvfuse.fusion.methods.sparse`.
Version 1 blobs still decode (no block checksums, no artifacts). The content key does not carry the
format version (KEY_VERSION stays 1): a chunk's KV is the same in both versions, so an old blob keeps
serving under its key.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvfuse import kv_formats
from kvfuse.blob_artifacts import (  # noqa: F401 - part of this module's interface
    ARTIFACT_CODES,
    ARTIFACT_DTYPES,
    ARTIFACT_PREFIX,
    artifact_bytes,
    artifact_order,
    prepare_artifacts,
)
from kvfuse.blob_checksums import CorruptBlobError, block_checksum, bytes_view, check, checksum, copy_payload
from kvfuse.chunk_keys import (  # noqa: F401 - the keys are part of this module's interface
    FORMAT_NAME,
    FORMATS,
    KEY_VERSION,
    check_format,
    chunk_key,
    chunk_key_from_hash,
    context_hash,
    token_hash,
    torch_dtype,
)
from kvfuse.kv_formats import DTYPES, QTensor  # noqa: F401 - DTYPES: part of the interface

__all__ = [  # this module's interface, its re-exports from the modules it is built of included
    "ARTIFACT_CODES", "ARTIFACT_DTYPES", "ARTIFACT_PREFIX", "BLOCK_TOKENS", "ChunkEntry",
    "CorruptBlobError", "DTYPES", "FORMATS", "FORMAT_NAME", "FORMAT_VERSION", "KEY_VERSION", "KV",
    "KVHeader", "POSITION_ROPE0", "QTensor", "READABLE_VERSIONS", "artifact_bytes", "artifact_order",
    "check_format", "chunk_key", "chunk_key_from_hash", "context_hash", "decode", "encode", "pack",
    "prepare_artifacts", "read_artifacts", "read_blocks", "read_header", "reencode", "token_hash",
    "torch_dtype", "verify_blob",
]

KV = Tensor | QTensor  # a chunk's k or v as decoded: a float tensor, or codes and scales

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
BLOCK_TOKENS = 64  # tokens per checksummed block in version 2 (the SamKV paper's block size)
POSITION_ROPE0 = "rope0"

_MAX_HEADER_BYTES = 1 << 20  # a real header is < 1 KB; anything larger is garbage, not a blob

if sys.byteorder != "little":  # safetensors is little-endian and decode maps bytes straight into tensors
    raise ImportError("kvfuse.kvblob needs a little-endian host")

# torch.frombuffer warns once per process when the buffer is read-only, as an LMDB memory map or `bytes`
# is. The views are read-only by contract (see `decode`), so that one warning is triggered here, on a
# throwaway buffer, with warnings silenced: later calls stay quiet, with no per-call catch_warnings
# (which is not thread-safe).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


@dataclass(frozen=True)
class KVHeader:
    format_version: int
    model_fingerprint: str
    dtype: str  # the KV format: "float16" | "bfloat16" | "float32" | "fp8" | "int8" | "int4"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    token_hash: str
    position: str
    checksum: str  # "<algo>:<hex>" of the payload bytes (k then v)
    block_tokens: int = 0  # version 2: tokens per checksummed block (0: no block checksums)
    block_checksums: tuple[str, ...] = ()  # version 2: one per block, see `block_checksum`
    artifacts_checksum: str = ""  # version 2 with artifacts: checksum of their bytes, in name order
    # token_hash of the context the chunk was computed after ("" = alone; kvfuse/fusion/chunk_context.py)
    context_hash: str = ""
    # Artifact tensors (name -> tensor, CPU, contiguous); not part of the header's identity.
    artifacts: dict[str, Tensor] | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        """k and v at rest, a quantized format's scales and zeros included."""
        return kv_formats.payload_bytes(self.dtype, self.shape)

    @property
    def quantized(self) -> bool:
        return kv_formats.is_quantized(self.dtype)

    @property
    def key(self) -> str:
        """The content key this blob must be stored under."""
        return chunk_key_from_hash(self.model_fingerprint, self.dtype, self.token_hash, self.context_hash)


class ChunkEntry(NamedTuple):
    """A decoded chunk: what `decode` and `read_blocks` give and what every store tier hands out
    (kvfuse/store/chunk_store.py). A named tuple, so `k, v, header = entry` still reads it whole."""

    k: KV
    v: KV
    header: KVHeader


def encode(k: Tensor, v: Tensor, *, model_fingerprint: str, token_ids: Sequence[int], dtype: str,
           artifacts: dict[str, Tensor] | None = None, context_ids: Sequence[int] = ()) -> bytes:
    """Serialize one chunk's floating KV in the KV format `dtype` (cast, or quantized) as a version-2
    safetensors blob, with per-block checksums and the optional `artifacts` (name -> tensor, stored as
    they are); `context_ids`: what it was computed after (recorded as its hash, part of the key)."""
    if k.dim() == 4 and int(k.shape[2]) != len(token_ids):
        raise ValueError(f"KV has {int(k.shape[2])} tokens but {len(token_ids)} token ids were given")
    return _encode(k, v, dtype, model_fingerprint, token_hash(token_ids), context_hash(context_ids), artifacts)


def reencode(k: Tensor, v: Tensor, header: KVHeader, dtype: str) -> bytes:
    """The blob of a chunk already stored (`header`: its model, tokens, context and artifacts) with its
    floating KV `k`, `v` in another KV format (`kvfuse store convert`)."""
    return _encode(k, v, dtype, header.model_fingerprint, header.token_hash, header.context_hash, header.artifacts)


def _encode(k: Tensor, v: Tensor, dtype: str, model_fingerprint: str, token_hash_hex: str, context_hash_hex: str,
            artifacts: dict[str, Tensor] | None) -> bytes:
    check_format(dtype)
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [L, Hkv, n, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
    num_layers, num_kv_heads, num_tokens, head_dim = (int(x) for x in k.shape)
    if num_tokens == 0:
        raise ValueError("a chunk's KV needs at least one token")
    kq, vq = kv_formats.encode_kv(k, v, dtype)
    arts = prepare_artifacts(artifacts)
    header = KVHeader(
        format_version=FORMAT_VERSION,
        model_fingerprint=model_fingerprint,
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_tokens=num_tokens,
        token_hash=token_hash_hex,
        position=POSITION_ROPE0,
        checksum=checksum(*_payload_views(kq, vq)),
        block_tokens=BLOCK_TOKENS,
        block_checksums=tuple(block_checksum(kq, vq, a, min(a + BLOCK_TOKENS, num_tokens))
                              for a in range(0, num_tokens, BLOCK_TOKENS)),
        artifacts_checksum=checksum(*artifact_bytes(arts)) if arts else "",
        artifacts=arts,
        context_hash=context_hash_hex,
    )
    return pack(kq, vq, header)


def _payload_views(k: KV, v: KV) -> list[memoryview]:
    """The payload's bytes in the blob's order (kv_formats.payload_specs): k, v, then scales and zeros."""
    parts = kv_formats.named_parts(k, v)
    return [bytes_view(parts[name].contiguous()) for name in sorted(parts, key=_PART_ORDER.index)]


_PART_ORDER = ["k", "v", "k.scale", "k.zero", "v.scale", "v.zero"]


def pack(k: KV, v: KV, header: KVHeader) -> bytes:
    """The blob of an already decoded chunk, byte for byte what `encode` wrote: a tier that stores bytes
    keeps what another tier decoded without recomputing the header (its checksum included)."""
    specs = kv_formats.payload_specs(header.dtype, header.shape)
    parts = kv_formats.named_parts(k, v)
    if set(parts) != {name for name, _, _ in specs} or any(
            parts[name].dtype != kv_formats.torch_code(code) or tuple(parts[name].shape) != shape
            for name, code, shape in specs):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} ({sorted(parts)}) disagree with {header}")
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(header.format_version),
        "model_fingerprint": header.model_fingerprint,
        "dtype": header.dtype,
        "num_layers": str(header.num_layers),
        "num_kv_heads": str(header.num_kv_heads),
        "head_dim": str(header.head_dim),
        "num_tokens": str(header.num_tokens),
        "token_hash": header.token_hash,
        "position": header.position,
        "checksum": header.checksum,
    }
    if header.format_version >= 2:
        meta["block_tokens"] = str(header.block_tokens)
        meta["block_checksums"] = ",".join(header.block_checksums)
        meta["artifacts_checksum"] = header.artifacts_checksum
    if header.context_hash:  # absent for a chunk computed alone: those blobs are byte for byte as before
        meta["context_hash"] = header.context_hash
    table: dict[str, Any] = {"__metadata__": meta}
    views: list[memoryview] = []
    off = 0
    for name, code, shape in specs:
        mv = bytes_view(parts[name].contiguous())
        table[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + mv.nbytes]}
        views.append(mv)
        off += mv.nbytes
    arts = (header.artifacts or {}) if header.format_version >= 2 else {}
    for name in artifact_order(arts):
        mv = bytes_view(arts[name])
        table[ARTIFACT_PREFIX + name] = {"dtype": ARTIFACT_DTYPES[arts[name].dtype], "shape": list(arts[name].shape),
                                         "data_offsets": [off, off + mv.nbytes]}
        views.append(mv)
        off += mv.nbytes
    hjson = json.dumps(table, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # pad so the payload (and every tensor) starts 8-byte aligned
    return b"".join((len(hjson).to_bytes(8, "little"), hjson, *views))


_ArtSpec = tuple[str, torch.dtype, list[int], int, int]  # name, dtype, shape, start, stop (payload offsets)


def _parse(mv: memoryview) -> tuple[KVHeader, int, list[_ArtSpec]]:
    """Header, payload start offset and the artifact tensors' specs; raises CorruptBlobError on anything
    malformed."""
    if mv.nbytes < 8:
        raise CorruptBlobError(f"blob of {mv.nbytes} bytes is too short for a safetensors header")
    n = int.from_bytes(mv[:8], "little")
    if n > min(_MAX_HEADER_BYTES, mv.nbytes - 8):
        raise CorruptBlobError(f"safetensors header length {n} is out of range (blob is {mv.nbytes} bytes)")
    try:
        header = json.loads(bytes(mv[8 : 8 + n]))
        meta = header["__metadata__"]
        if meta.get("format") != FORMAT_NAME:
            raise CorruptBlobError(f"not a {FORMAT_NAME} blob (format {meta.get('format')!r})")
        if meta["format_version"] not in {str(x) for x in READABLE_VERSIONS}:
            raise CorruptBlobError(f"blob format version {meta['format_version']} is not one of {READABLE_VERSIONS}")
        version = int(meta["format_version"])
        extra = {}
        if version >= 2:
            sums = meta["block_checksums"]
            extra = {"block_tokens": int(meta["block_tokens"]), "block_checksums": tuple(sums.split(",")) if sums else (),
                     "artifacts_checksum": meta["artifacts_checksum"]}
        h = KVHeader(
            format_version=int(meta["format_version"]),
            model_fingerprint=meta["model_fingerprint"],
            dtype=meta["dtype"],
            num_layers=int(meta["num_layers"]),
            num_kv_heads=int(meta["num_kv_heads"]),
            head_dim=int(meta["head_dim"]),
            num_tokens=int(meta["num_tokens"]),
            token_hash=meta["token_hash"],
            position=meta["position"],
            checksum=meta["checksum"],
            **extra,
            context_hash=meta.get("context_hash", ""),
        )
        specs: list[_ArtSpec] = []
        for name, entry in header.items():
            if name.startswith(ARTIFACT_PREFIX) and version >= 2:
                start, stop = (int(x) for x in entry["data_offsets"])
                specs.append((name[len(ARTIFACT_PREFIX):], ARTIFACT_CODES[entry["dtype"]],
                              [int(x) for x in entry["shape"]], start, stop))
    except CorruptBlobError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CorruptBlobError(f"bad blob header: {err!r}") from None
    if h.dtype not in FORMATS:
        raise CorruptBlobError(f"blob KV format {h.dtype!r} is not supported")
    want, off = {}, 0
    for name, code, shape in kv_formats.payload_specs(h.dtype, h.shape):
        size = kv_formats.spec_bytes(code, shape)
        want[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + size]}
        off += size
    got = {name: entry for name, entry in header.items() if name in want}
    if got != want or set(header) != {"__metadata__", *want} | {ARTIFACT_PREFIX + s[0] for s in specs}:
        raise CorruptBlobError(f"blob tensors {sorted(set(header) - {'__metadata__'})} disagree with its metadata {h}")
    nblocks = -(-h.num_tokens // h.block_tokens) if h.block_tokens else 0
    if len(h.block_checksums) != nblocks:
        raise CorruptBlobError(f"blob has {len(h.block_checksums)} block checksums for {nblocks} blocks")
    end = h.payload_bytes
    for name, dt, art_shape, start, stop in sorted(specs, key=lambda x: x[3]):
        size = torch.empty((), dtype=dt).element_size() * (int(torch.tensor(art_shape).prod()) if art_shape else 1)
        if start != end or stop - start != size or (start - h.payload_bytes) % torch.empty((), dtype=dt).element_size():
            raise CorruptBlobError(f"artifact {name!r} at {start}..{stop} does not follow the payload at {end}")
        end = stop
    if mv.nbytes - 8 - n != end:
        raise CorruptBlobError(f"blob payload is {mv.nbytes - 8 - n} bytes, header says {end}")
    return h, 8 + n, specs


def _byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def read_header(buf: bytes | bytearray | memoryview) -> KVHeader:
    """The header alone (no checksum verification, no tensors)."""
    return _parse(_byte_view(buf))[0]


def verify_blob(buf: bytes | bytearray | memoryview) -> KVHeader:
    """Parse and check the payload checksum; raises CorruptBlobError."""
    mv = _byte_view(buf)
    h, start, specs = _parse(mv)
    check(h.checksum, checksum(mv[start : start + h.payload_bytes]))
    if specs:
        check(h.artifacts_checksum, checksum(mv[start + h.payload_bytes :]))
    return h


def _kv_views(h: KVHeader, base: memoryview | Tensor, start: int) -> tuple[KV, KV]:
    """k and v as views of the payload at `start` of `base` (a buffer, or a uint8 tensor that owns it)."""
    parts, off = {}, start
    for name, code, shape in kv_formats.payload_specs(h.dtype, h.shape):
        dt, size = kv_formats.torch_code(code), kv_formats.spec_bytes(code, shape)
        if isinstance(base, Tensor):
            parts[name] = base[off : off + size].view(dt).view(shape)
        else:
            parts[name] = torch.frombuffer(base, dtype=dt, count=size // dt.itemsize, offset=off).view(shape)
        off += size
    return kv_formats.from_parts(h.dtype, parts, h.head_dim)


def decode(
    buf: bytes | bytearray | memoryview, *, verify: bool = True, copy: bool = False, pin: bool = False
) -> ChunkEntry:
    """(k, v, header): float tensors, or QTensors for a quantized format. Without `copy`, the tensors are
    views of `buf` (no copy): treat them as read-only and keep `buf` valid while they are used (an LMDB
    buffer dies with its transaction). With `copy`, the payload is copied once, in one memcpy, into memory
    the tensors own (writable); with `pin` too, that memory is page-locked (needs CUDA), so a GPU reads it
    straight over the bus with no staging copy."""
    mv = _byte_view(buf)
    h, start, specs = _parse(mv)
    arts = _artifacts(mv, start, h, specs, verify) if specs else None  # small: always copied
    if copy and pin:
        owned = torch.empty(h.payload_bytes, dtype=torch.uint8, pin_memory=True)
        copy_payload(mv[start : start + h.payload_bytes], h.checksum if verify else None, into=owned.numpy())
        k, v = _kv_views(h, owned, 0)
        return ChunkEntry(k, v, replace(h, artifacts=arts) if arts else h)
    if copy:
        mv, start = memoryview(copy_payload(mv[start : start + h.payload_bytes], h.checksum if verify else None)), 0
    elif verify:
        check(h.checksum, checksum(mv[start : start + h.payload_bytes]))
    k, v = _kv_views(h, mv, start)
    return ChunkEntry(k, v, replace(h, artifacts=arts) if arts else h)


def _artifacts(mv: memoryview, start: int, h: KVHeader, specs: list[_ArtSpec], verify: bool) -> dict[str, Tensor]:
    raw = bytearray(mv[start + h.payload_bytes :])
    if verify:
        check(h.artifacts_checksum, checksum(raw))
    out = {}
    for name, dt, shape, a, stop in specs:
        count = (stop - a) // torch.empty((), dtype=dt).element_size()
        out[name] = (torch.frombuffer(raw, dtype=dt, count=count, offset=a - h.payload_bytes).view(shape)
                     if count else torch.empty(shape, dtype=dt))
    return out


def read_artifacts(buf: bytes | bytearray | memoryview, *, verify: bool = True) -> tuple[KVHeader, dict[str, Tensor] | None]:
    """The header and the artifacts alone (copied; the KV payload is not read), None for none (version 1)."""
    mv = _byte_view(buf)
    h, start, specs = _parse(mv)
    arts = _artifacts(mv, start, h, specs, verify) if specs else None
    return replace(h, artifacts=arts) if arts else h, arts


def read_blocks(buf: bytes | bytearray | memoryview, blocks: Sequence[int], *, verify: bool = True
                ) -> ChunkEntry:
    """(k, v, header) of the tokens of `blocks` (sorted block indices of `header.block_tokens` tokens), in
    block order: [L, Hkv, m, D] tensors (or QTensors) that own their memory. Only those blocks' bytes are
    copied and, with `verify`, checked against their block checksums. Version 1 blobs have no blocks:
    CorruptBlobError (the caller reads the whole blob instead)."""
    mv = _byte_view(buf)
    h, start, _ = _parse(mv)
    if not h.block_tokens:
        raise CorruptBlobError(f"blob format version {h.format_version} has no blocks")
    k, v = _kv_views(h, mv, start)
    ks, vs, t = [], [], h.block_tokens
    for b in blocks:
        if not 0 <= b < len(h.block_checksums):
            raise ValueError(f"block {b} outside the blob's {len(h.block_checksums)} blocks")
        stop = min((b + 1) * t, h.num_tokens)
        kb, vb = kv_formats.token_slice(k, b * t, stop), kv_formats.token_slice(v, b * t, stop)
        if verify:
            check(h.block_checksums[b], block_checksum(kb, vb, 0, stop - b * t))
        ks.append(kb)
        vs.append(vb)
    return ChunkEntry(kv_formats.cat_tokens(ks, k), kv_formats.cat_tokens(vs, v), h)
