"""The one on-disk format of a chunk's KV cache, shared by `fusion` and `store`.

A blob is a standard safetensors container: tensors `k` and `v`, both `[num_layers, num_kv_heads,
num_tokens, head_dim]`, and string metadata (format version, model fingerprint, dtype, shapes, token
hash, position convention, payload checksum). Any safetensors reader can open it; `decode` parses the
header itself so the tensors can be views of the caller's buffer (an LMDB memory map, a bytes object)
with no copy.

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

import torch
from torch import Tensor

from kvfuse.blob_checksums import CorruptBlobError, block_checksum, bytes_view, check, checksum, copy_payload
from kvfuse.chunk_keys import (  # noqa: F401 - the keys are part of this module's interface
    DTYPES,
    FORMAT_NAME,
    KEY_VERSION,
    chunk_key,
    chunk_key_from_hash,
    context_hash,
    dtype_size,
    token_hash,
    torch_dtype,
)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
BLOCK_TOKENS = 64  # tokens per checksummed block in version 2 (the SamKV paper's block size)
ARTIFACT_PREFIX = "a."
POSITION_ROPE0 = "rope0"

_ARTIFACT_DTYPES: dict[torch.dtype, str] = {
    torch.int64: "I64", torch.int32: "I32", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
}
_ARTIFACT_CODES = {code: dt for dt, code in _ARTIFACT_DTYPES.items()}
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
    dtype: str  # "float16" | "bfloat16" | "float32"
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
        return 2 * self.num_layers * self.num_kv_heads * self.num_tokens * self.head_dim * dtype_size(self.dtype)

    @property
    def key(self) -> str:
        """The content key this blob must be stored under."""
        return chunk_key_from_hash(self.model_fingerprint, self.dtype, self.token_hash, self.context_hash)


def artifact_order(artifacts: dict[str, Tensor]) -> list[str]:
    """Widest element first, then by name: every artifact then starts aligned to its element size with no
    padding between tensors (safetensors allows none), as k and v end on an 8-byte boundary."""
    return sorted(artifacts, key=lambda n: (-artifacts[n].element_size(), n))


def _artifact_bytes(artifacts: dict[str, Tensor]) -> list[memoryview]:
    return [bytes_view(artifacts[name]) for name in artifact_order(artifacts)]


def _prepare_artifacts(artifacts: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    if not artifacts:
        return None
    out = {}
    for name, t in artifacts.items():
        if t.dtype not in _ARTIFACT_DTYPES:
            raise ValueError(f"artifact {name!r}: dtype {t.dtype} not storable (use one of {list(_ARTIFACT_DTYPES)})")
        out[name] = t.detach().to("cpu").contiguous()
    return out


def encode(k: Tensor, v: Tensor, *, model_fingerprint: str, token_ids: Sequence[int], dtype: str,
           artifacts: dict[str, Tensor] | None = None, context_ids: Sequence[int] = ()) -> bytes:
    """Serialize one chunk's KV (cast to `dtype` at rest) as a version-2 safetensors blob, with per-block
    checksums and the optional `artifacts` (name -> tensor, stored as they are); `context_ids`: what it
    was computed after (recorded as its hash, part of the key)."""
    tdt = torch_dtype(dtype)
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [L, Hkv, n, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
    num_layers, num_kv_heads, num_tokens, head_dim = (int(x) for x in k.shape)
    if num_tokens != len(token_ids) or num_tokens == 0:
        raise ValueError(f"KV has {num_tokens} tokens but {len(token_ids)} token ids were given (need >= 1)")
    k = k.detach().to(device="cpu", dtype=tdt).contiguous()
    v = v.detach().to(device="cpu", dtype=tdt).contiguous()
    arts = _prepare_artifacts(artifacts)
    header = KVHeader(
        format_version=FORMAT_VERSION,
        model_fingerprint=model_fingerprint,
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_tokens=num_tokens,
        token_hash=token_hash(token_ids),
        position=POSITION_ROPE0,
        checksum=checksum(bytes_view(k), bytes_view(v)),
        block_tokens=BLOCK_TOKENS,
        block_checksums=tuple(block_checksum(k, v, a, min(a + BLOCK_TOKENS, num_tokens))
                              for a in range(0, num_tokens, BLOCK_TOKENS)),
        artifacts_checksum=checksum(*_artifact_bytes(arts)) if arts else "",
        artifacts=arts,
        context_hash=context_hash(context_ids),
    )
    return pack(k, v, header)


def pack(k: Tensor, v: Tensor, header: KVHeader) -> bytes:
    """The blob of an already decoded chunk, byte for byte what `encode` wrote: a tier that stores bytes
    keeps what another tier decoded without recomputing the header (its checksum included)."""
    if k.dtype != torch_dtype(header.dtype) or v.dtype != k.dtype or k.shape != header.shape != v.shape:
        raise ValueError(f"k {k.dtype} {tuple(k.shape)}, v {v.dtype} {tuple(v.shape)} disagree with {header}")
    kb, vb = bytes_view(k.contiguous()), bytes_view(v.contiguous())
    nb = kb.nbytes
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
    code, shape = DTYPES[header.dtype][1], list(header.shape)
    table: dict = {
        "__metadata__": meta,
        "k": {"dtype": code, "shape": shape, "data_offsets": [0, nb]},
        "v": {"dtype": code, "shape": shape, "data_offsets": [nb, 2 * nb]},
    }
    parts = [kb, vb]
    arts = header.artifacts if header.format_version >= 2 else None
    off = 2 * nb
    for name in artifact_order(arts or {}):
        mv = bytes_view(arts[name])
        table[ARTIFACT_PREFIX + name] = {"dtype": _ARTIFACT_DTYPES[arts[name].dtype], "shape": list(arts[name].shape),
                                         "data_offsets": [off, off + mv.nbytes]}
        parts.append(mv)
        off += mv.nbytes
    hjson = json.dumps(table, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # pad so the payload (and every tensor) starts 8-byte aligned
    return b"".join((len(hjson).to_bytes(8, "little"), hjson, *parts))


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
        k, v = header["k"], header["v"]
        specs: list[_ArtSpec] = []
        for name, entry in header.items():
            if name.startswith(ARTIFACT_PREFIX) and version >= 2:
                start, stop = (int(x) for x in entry["data_offsets"])
                specs.append((name[len(ARTIFACT_PREFIX):], _ARTIFACT_CODES[entry["dtype"]],
                              [int(x) for x in entry["shape"]], start, stop))
    except CorruptBlobError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CorruptBlobError(f"bad blob header: {err!r}") from None
    if h.dtype not in DTYPES:
        raise CorruptBlobError(f"blob dtype {h.dtype!r} is not supported")
    nb = h.payload_bytes // 2
    want_k = {"dtype": DTYPES[h.dtype][1], "shape": list(h.shape), "data_offsets": [0, nb]}
    want_v = {**want_k, "data_offsets": [nb, 2 * nb]}
    if k != want_k or v != want_v or set(header) != {"__metadata__", "k", "v"} | {ARTIFACT_PREFIX + s[0] for s in specs}:
        raise CorruptBlobError(f"blob tensors {k!r}, {v!r} disagree with its metadata {h}")
    nblocks = -(-h.num_tokens // h.block_tokens) if h.block_tokens else 0
    if len(h.block_checksums) != nblocks:
        raise CorruptBlobError(f"blob has {len(h.block_checksums)} block checksums for {nblocks} blocks")
    end = 2 * nb
    for name, dt, shape, start, stop in sorted(specs, key=lambda x: x[3]):
        size = torch.empty((), dtype=dt).element_size() * (int(torch.tensor(shape).prod()) if shape else 1)
        if start != end or stop - start != size or start % torch.empty((), dtype=dt).element_size():
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


def decode(
    buf: bytes | bytearray | memoryview, *, verify: bool = True, copy: bool = False, pin: bool = False
) -> tuple[Tensor, Tensor, KVHeader]:
    """(k, v, header). Without `copy`, the tensors are views of `buf` (no copy): treat them as read-only
    and keep `buf` valid while they are used (an LMDB buffer dies with its transaction). With `copy`,
    the payload is copied once, in one memcpy, into memory the tensors own (writable); with `pin` too,
    that memory is page-locked (needs CUDA), so a GPU reads it straight over the bus with no staging copy."""
    mv = _byte_view(buf)
    h, start, specs = _parse(mv)
    arts = _artifacts(mv, start, h, specs, verify) if specs else None  # small: always copied
    tdt = torch_dtype(h.dtype)
    numel = h.payload_bytes // 2 // dtype_size(h.dtype)
    if copy and pin:
        owned = torch.empty(h.payload_bytes, dtype=torch.uint8, pin_memory=True)
        copy_payload(mv[start : start + h.payload_bytes], h.checksum if verify else None, into=owned.numpy())
        k, v = (part.view(tdt).view(h.shape) for part in owned.chunk(2))
        return k, v, replace(h, artifacts=arts) if arts else h
    if copy:
        mv, start = memoryview(copy_payload(mv[start : start + h.payload_bytes], h.checksum if verify else None)), 0
    elif verify:
        check(h.checksum, checksum(mv[start : start + h.payload_bytes]))
    k = torch.frombuffer(mv, dtype=tdt, count=numel, offset=start).view(h.shape)
    v = torch.frombuffer(mv, dtype=tdt, count=numel, offset=start + h.payload_bytes // 2).view(h.shape)
    return k, v, replace(h, artifacts=arts) if arts else h


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
                ) -> tuple[Tensor, Tensor, KVHeader]:
    """(k, v, header) of the tokens of `blocks` (sorted block indices of `header.block_tokens` tokens), in
    block order: [L, Hkv, m, D] tensors that own their memory. Only those blocks' bytes are copied and, with
    `verify`, checked against their block checksums. Version 1 blobs have no blocks: CorruptBlobError
    (the caller reads the whole blob instead)."""
    mv = _byte_view(buf)
    h, start, _ = _parse(mv)
    if not h.block_tokens:
        raise CorruptBlobError(f"blob format version {h.format_version} has no blocks")
    tdt = torch_dtype(h.dtype)
    numel = h.payload_bytes // 2 // dtype_size(h.dtype)
    k = torch.frombuffer(mv, dtype=tdt, count=numel, offset=start).view(h.shape)
    v = torch.frombuffer(mv, dtype=tdt, count=numel, offset=start + h.payload_bytes // 2).view(h.shape)
    ks, vs, t = [], [], h.block_tokens
    for b in blocks:
        if not 0 <= b < len(h.block_checksums):
            raise ValueError(f"block {b} outside the blob's {len(h.block_checksums)} blocks")
        kb, vb = k[:, :, b * t : (b + 1) * t].contiguous(), v[:, :, b * t : (b + 1) * t].contiguous()
        if verify:
            check(h.block_checksums[b], checksum(bytes_view(kb), bytes_view(vb)))
        ks.append(kb)
        vs.append(vb)
    if not ks:
        empty = torch.empty((h.num_layers, h.num_kv_heads, 0, h.head_dim), dtype=tdt)
        return empty, empty.clone(), h
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2), h
