"""The formats chunk KV is kept in at rest, what each stores besides the values, and how the quantized
ones are quantized and dequantized (docs/DESIGN.md, "Storage"; measured in docs/results/kv-formats/).

Float formats (float16, bfloat16, float32) keep k and v as they are, cast. Quantized formats keep codes
plus fp16 scales (and zeros), all counted in a blob's size:

- `fp8`: float8 e4m3, vLLM's and LMCache's fp8 KV cache element, with one scale per token per KV head
  (amax / 448) for k and v. vLLM keeps one scale per tensor; per token per head costs 2 bytes per
  head_dim codes, and keeps one token with large keys (an attention sink) from pushing every other
  token's values into the few codes near zero.
- `int8`: symmetric integers, one scale per token per head (amax / 127).
- `int4`: KIVI's asymmetric min-max quantization (codes 0..15, a scale and a zero per group), keys per
  channel (a scale per channel over a group of `KEY_GROUP` tokens, the blob's 64-token block, so a
  block read takes whole groups) and values per token (a scale per group of `VALUE_GROUP` channels).
  Departure: KIVI keeps the newest tokens (its residual) in full precision because its cache grows while
  decoding and a channel's group needs its tokens first; a stored chunk is complete when it is
  quantized, so every token is quantized, and a last, shorter group gets its own scale.

Scales and zeros are fp16 and are rounded before the codes are computed, so a code decodes with the
scale stored beside it. A quantized k or v travels as a `QTensor` (codes, scale, zero): the tiers keep
it as it is (fewer bytes in RAM, on the device and on the wire), and it is dequantized a layer at a time
where it is used (`QTensor.layer`, `kvfuse.fusion.types.ChunkKV.layer_kv`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import Tensor

from kvfuse.chunk_keys import FLOAT_CODES, QUANTIZED_FORMATS, torch_dtype

KEY_GROUP = 64  # int4 keys: tokens per channel scale (divides kvblob.BLOCK_TOKENS: a block is whole groups)
VALUE_GROUP = 32  # int4 values: channels per token scale

# float format name -> (torch dtype, safetensors dtype code)
DTYPES: dict[str, tuple[torch.dtype, str]] = {name: (torch_dtype(name), code) for name, code in FLOAT_CODES.items()}
_CODES: dict[str, torch.dtype] = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "U8": torch.uint8,
                                  "F16": torch.float16}
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class Side:
    """How one of a chunk's k or v is quantized."""

    code: str  # safetensors dtype of the codes: F8_E4M3 | I8 | U8 (two 4-bit codes a byte)
    qmax: float  # symmetric: the largest code magnitude; asymmetric: the top code (codes from 0)
    zero: bool  # asymmetric: a zero (the group's minimum) beside each scale
    per_channel: bool  # a scale per channel over `group` tokens (KIVI's keys); else per token
    group: int  # tokens (per channel) or channels (per token) sharing a scale; 0 = the whole head_dim

    @property
    def packed(self) -> bool:
        return self.code == "U8"


QUANTIZED: dict[str, tuple[Side, Side]] = {  # format -> (k's side, v's side)
    "fp8": (Side("F8_E4M3", 448.0, False, False, 0), Side("F8_E4M3", 448.0, False, False, 0)),
    "int8": (Side("I8", 127.0, False, False, 0), Side("I8", 127.0, False, False, 0)),
    "int4": (Side("U8", 15.0, True, True, KEY_GROUP), Side("U8", 15.0, True, False, VALUE_GROUP)),
}
assert set(QUANTIZED) == set(QUANTIZED_FORMATS)


def is_quantized(fmt: str) -> bool:
    return fmt in QUANTIZED


def channels_per_scale(s: Side, head_dim: int) -> int:
    """Channels sharing a per-token scale: `s.group`, or the largest divisor of head_dim below it (a head
    of 80 channels takes groups of 16), or the whole head (group 0)."""
    if not s.group or s.group >= head_dim:
        return head_dim
    return max(g for g in range(1, s.group + 1) if head_dim % g == 0)


def _scale_shape(side: Side, lead: tuple[int, ...], n: int, d: int) -> tuple[int, ...]:
    if side.per_channel:
        return (*lead, -(-n // side.group), d)
    return (*lead, n, d // channels_per_scale(side, d))


def payload_specs(fmt: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor a chunk of `shape` [L, Hkv, n, D] stores in `fmt`,
    in the blob's order: k and v first (their codes, for a quantized format), then the scales and zeros."""
    *lead, n, d = shape
    if fmt in DTYPES:
        return [("k", DTYPES[fmt][1], tuple(shape)), ("v", DTYPES[fmt][1], tuple(shape))]
    sides = QUANTIZED[fmt]
    out = [(name, s.code, (*lead, n, d // 2 if s.packed else d)) for name, s in zip("kv", sides, strict=True)]
    for name, s in zip("kv", sides, strict=True):
        sshape = _scale_shape(s, tuple(lead), n, d)
        out.append((f"{name}.scale", "F16", sshape))
        if s.zero:
            out.append((f"{name}.zero", "F16", sshape))
    return out


def torch_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code of the KV payload."""
    return _CODES.get(code) or next(dt for dt, c in DTYPES.values() if c == code)


def spec_bytes(code: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=torch_code(code)).element_size()


def payload_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a chunk's KV at rest in `fmt`, scales and zeros included."""
    return sum(spec_bytes(code, s) for _, code, s in payload_specs(fmt, shape))


def bytes_per_token(fmt: str, layers: int, kv_heads: int, head_dim: int, tokens: int = 512) -> float:
    """Stored bytes per token of a `tokens`-token chunk (a multiple of KEY_GROUP: the key scales whole)."""
    return payload_bytes(fmt, (layers, kv_heads, tokens, head_dim)) / tokens


@dataclass
class QTensor:
    """A chunk's k or v in a quantized format: `data` (codes [..., n, D] or, 4-bit, [..., n, D/2]), `scale`
    and `zero` (fp16). Leading dims are [layers, heads] for a chunk, [heads] for one layer.

    It answers the few tensor questions the store's tiers ask (`shape`, `nbytes`, `device`, `to`,
    `is_pinned`), so a tier keeps and moves it without dequantizing it."""

    fmt: str
    side: int  # 0: k, 1: v
    data: Tensor
    scale: Tensor
    zero: Tensor | None
    head_dim: int

    @property
    def spec(self) -> Side:
        return QUANTIZED[self.fmt][self.side]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.head_dim))

    @property
    def num_tokens(self) -> int:
        return int(self.data.shape[-2])

    def parts(self) -> list[Tensor]:
        """The tensors stored, in the blob's order (codes, scale, zero)."""
        return [self.data, self.scale] + ([self.zero] if self.zero is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts())

    @property
    def device(self) -> torch.device:
        return self.data.device

    def is_pinned(self) -> bool:
        return all(p.is_pinned() for p in self.parts())

    def _map(self, fn: Callable[[Tensor], Tensor]) -> QTensor:
        return replace(self, data=fn(self.data), scale=fn(self.scale),
                       zero=None if self.zero is None else fn(self.zero))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QTensor:
        if torch.device(device) == self.data.device:
            return self
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def contiguous(self) -> QTensor:
        return self._map(Tensor.contiguous)

    def layer(self, i: int) -> QTensor:
        """One layer of a chunk's [L, Hkv, n, ...] tensor (views)."""
        return self._map(lambda t: t[i])

    def tokens(self, start: int, stop: int) -> QTensor:
        """Tokens [start, stop) (views). Per-channel groups are taken whole, so `start` must begin one and
        `stop` end one or the chunk (block boundaries do)."""
        s, n = self.spec, self.num_tokens
        if not s.per_channel:
            return self._map(lambda t: t[..., start:stop, :])
        if start % s.group or (stop % s.group and stop != n):
            raise ValueError(f"tokens {start}..{stop} cut a group of {s.group}")
        a, b = start // s.group, -(-stop // s.group)
        return replace(self, data=self.data[..., start:stop, :], scale=self.scale[..., a:b, :],
                       zero=None if self.zero is None else self.zero[..., a:b, :])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values, computed in fp32 on this tensor's device and returned in `dtype`."""
        out = _dequantize(self.data, self.scale, self.zero, self.spec, self.head_dim)
        return out if dtype == torch.float32 else out.to(dtype)


def _dequantize(data: Tensor, scale: Tensor, zero: Tensor | None, s: Side, head_dim: int) -> Tensor:
    """codes * scale (+ zero) in fp32: one multiply(-add) over the whole tensor from the codes as they are
    (uint8, int8, or fp16 for e4m3), which on a CPU is cheaper than casting the codes to fp32 first."""
    codes, scale = _codes(data, s, head_dim), scale.float()
    if s.code == "F8_E4M3":
        scale = scale * 256  # _codes gives e4m3 codes over 256 (see there)
    zero = None if zero is None else zero.float()
    if s.per_channel:
        return _affine_per_channel(codes, scale, zero, s.group)
    g = channels_per_scale(s, head_dim)
    grouped, scale = codes.unflatten(-1, (-1, g)), scale.unsqueeze(-1)
    out = grouped * scale if zero is None else torch.addcmul(zero.unsqueeze(-1), grouped, scale)
    return out.flatten(-2)


_NIBBLES = 0x0F0F0F0F  # the low nibble of each byte of an int32 word


def _codes(data: Tensor, s: Side, head_dim: int) -> Tensor:
    """The codes one per value, in few whole-tensor operations (each costs a fixed overhead besides its
    bytes, and a layer of a chunk is small): 4-bit codes split four bytes at a time as int32 words into
    uint8; e4m3 codes turned into fp16 by moving their bits (sign to bit 15, exponent and mantissa to bits
    7..13: the fp16 number is the e4m3 one over 256, subnormals too; e4m3's NaN code is never written),
    several times faster than torch's fp8 cast on a CPU; int8 codes as they are."""
    if s.packed:  # channel c in the low nibble of byte c, channel c + D/2 in its high nibble
        if data.shape[-1] % 4 == 0 and data.is_contiguous():
            words = data.view(torch.int32)
            lo, hi = (words & _NIBBLES).view(torch.uint8), ((words >> 4) & _NIBBLES).view(torch.uint8)
        else:
            lo, hi = data & 15, data >> 4
        return torch.cat((lo, hi), dim=-1)
    if s.code == "F8_E4M3":  # sign-extended to 16 bits, shifted by 7: bit 14 is the sign again, cleared
        return ((data.view(torch.int8).to(torch.int16) << 7) & -0x4001).view(torch.float16)
    return data


def _affine_per_channel(codes: Tensor, scale: Tensor, zero: Tensor | None, group: int) -> Tensor:
    """codes[..., t, c] * scale[..., t // group, c] (+ zero) in fp32: the whole groups in one operation, a
    last, shorter group in another."""
    n = codes.shape[-2]
    whole = n // group * group
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    for lo, hi, size in ((0, whole, group), (whole, n, n - whole)):
        if hi <= lo:
            continue
        g0, g1 = lo // group, -(-hi // group)
        c, o = (x[..., lo:hi, :].unflatten(-2, (-1, size)) for x in (codes, out))
        sc = scale[..., g0:g1, :].unsqueeze(-2)
        if zero is None:
            torch.mul(c, sc, out=o)
        else:
            torch.addcmul(zero[..., g0:g1, :].unsqueeze(-2), c, sc, out=o)
    return out


def _fp16_scales(scale: Tensor) -> Tensor:
    """Scales rounded to fp16 as stored; a group of zeros (scale 0) gets 1, so nothing divides by 0."""
    s = scale.clamp(max=_FP16_MAX).to(torch.float16)
    return torch.where(s == 0, torch.ones_like(s), s)


def quantize(x: Tensor, fmt: str, side: int) -> QTensor:
    """k (side 0) or v (side 1), [..., n, D] floating, in `fmt`: computed in fp32 on x's device."""
    data, scale, zero = _quantize(x, QUANTIZED[fmt][side])
    return QTensor(fmt, side, data, scale, zero, int(x.shape[-1]))


def round_trip_side(x: Tensor, s: Side) -> Tensor:
    """x quantized as `s` says and dequantized, in fp32: how a side that is not a format would do
    (studies/kv_format_error.py compares groupings this way)."""
    data, scale, zero = _quantize(x, s)
    return _dequantize(data, scale, zero, s, int(x.shape[-1]))


def _quantize(x: Tensor, s: Side) -> tuple[Tensor, Tensor, Tensor | None]:
    x = x.float()
    n, d = int(x.shape[-2]), int(x.shape[-1])
    if s.per_channel:
        pad = -n % s.group  # the last group padded with its last token: its min and max do not move
        xp = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, d)], -2) if pad else x
        groups = xp.unflatten(-2, (-1, s.group))  # [..., n/g, g, D]
        lo, hi = groups.amin(-2), groups.amax(-2)
        zero = lo.to(torch.float16)
        scale = _fp16_scales((hi - zero.float()) / s.qmax)
        codes = ((groups - zero.float().unsqueeze(-2)) / scale.float().unsqueeze(-2)).flatten(-3, -2)[..., :n, :]
    else:
        groups = x.unflatten(-1, (-1, channels_per_scale(s, d)))  # [..., n, D/g, g]
        if s.zero:
            lo, hi = groups.amin(-1), groups.amax(-1)
            zero = lo.to(torch.float16)
            scale = _fp16_scales((hi - zero.float()) / s.qmax)
            codes = ((groups - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).flatten(-2)
        else:
            zero = None
            scale = _fp16_scales(groups.abs().amax(-1) / s.qmax)
            codes = (groups / scale.float().unsqueeze(-1)).flatten(-2)
    return _encode_codes(codes, s), scale, zero if s.zero else None


def _encode_codes(codes: Tensor, s: Side) -> Tensor:
    if s.code == "F8_E4M3":
        return codes.clamp(-s.qmax, s.qmax).to(torch.float8_e4m3fn)
    if s.code == "I8":
        return codes.round().clamp(-s.qmax, s.qmax).to(torch.int8)
    q = codes.round().clamp(0, s.qmax).to(torch.uint8)
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def encode_kv(k: Tensor, v: Tensor, fmt: str) -> tuple[Tensor | QTensor, Tensor | QTensor]:
    """k and v as stored in `fmt`, on the CPU and contiguous (quantized on their own device first, so a
    GPU moves the smaller codes)."""
    if fmt in DTYPES:
        dt = DTYPES[fmt][0]
        return (k.detach().to(device="cpu", dtype=dt).contiguous(), v.detach().to(device="cpu", dtype=dt).contiguous())
    return (quantize(k.detach(), fmt, 0).to("cpu").contiguous(), quantize(v.detach(), fmt, 1).to("cpu").contiguous())


def named_parts(k: Tensor | QTensor, v: Tensor | QTensor) -> dict[str, Tensor]:
    """The tensors of a chunk's k and v by their blob names (see `payload_specs`)."""
    out: dict[str, Tensor] = {}
    for name, x in (("k", k), ("v", v)):
        if isinstance(x, QTensor):
            out[name], out[f"{name}.scale"] = x.data, x.scale
            if x.zero is not None:
                out[f"{name}.zero"] = x.zero
        else:
            out[name] = x
    return out


def from_parts(fmt: str, parts: dict[str, Tensor], head_dim: int) -> tuple[Tensor | QTensor, Tensor | QTensor]:
    """k and v from the tensors `named_parts` gave (views stay views)."""
    if fmt in DTYPES:
        return parts["k"], parts["v"]
    k, v = (QTensor(fmt, side, parts[name], parts[f"{name}.scale"], parts.get(f"{name}.zero"), head_dim)
            for side, name in enumerate("kv"))
    return k, v


def token_slice(x: Tensor | QTensor, start: int, stop: int) -> Tensor | QTensor:
    """Tokens [start, stop) of a chunk's k or v [L, Hkv, n, ...], copied (contiguous)."""
    if isinstance(x, QTensor):
        return x.tokens(start, stop).contiguous()
    return x[:, :, start:stop].contiguous()


def cat_tokens(pieces: list[Tensor | QTensor], like: Tensor | QTensor) -> Tensor | QTensor:
    """Token slices of one chunk's k or v (`token_slice`, block-aligned) side by side; none: 0 tokens of
    `like`'s kind."""
    if not pieces:
        return token_slice(like, 0, 0)
    if not isinstance(like, QTensor):
        return torch.cat(cast(list[Tensor], pieces), dim=2)
    qs = cast(list[QTensor], pieces)  # the pieces of one chunk are all of `like`'s kind
    first = qs[0]
    zero = None if first.zero is None else torch.cat([p.zero for p in qs if p.zero is not None], dim=-2)
    return replace(first, data=torch.cat([p.data for p in qs], dim=-2),
                   scale=torch.cat([p.scale for p in qs], dim=-2), zero=zero)


def dequantize(x: Tensor | QTensor, dtype: torch.dtype | None = None) -> Tensor:
    """A floating tensor of x: a float tensor as it is (cast to `dtype` if given), a QTensor's values in
    `dtype` (fp32 when None)."""
    if isinstance(x, QTensor):
        return x.dequantize(dtype or torch.float32)
    return x if dtype is None else x.to(dtype)


def round_trip(x: Tensor, fmt: str, side: int) -> Tensor:
    """x stored in `fmt` and read back, in x's dtype: the error the format adds (the floor's fp8
    perturbation, the benchmarks' formats)."""
    if fmt in DTYPES:
        return x.to(DTYPES[fmt][0]).to(x.dtype)
    return quantize(x, fmt, side).dequantize(x.dtype)
