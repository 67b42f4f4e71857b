"""The KV formats at rest (kvfuse/kv_formats.py): each round trip within its format's error bound, the sizes
the blobs and the reports count (scales included), and the pieces block reads are cut into."""

from __future__ import annotations

import pytest
import torch

from kvfuse import kv_formats as F
from kvfuse import kvblob

SHAPE = (4, 3, 150, 64)  # 150 tokens: two whole 64-token key groups and a shorter last one


def _kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K with a few large channels and one large token (what real keys have: outlier channels and an
    attention sink), V plain."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SHAPE, generator=g)
    k[..., 5] *= 20
    k[..., 0, :] *= 8
    v = torch.randn(SHAPE, generator=g) * 0.5
    return k, v


def _per_element(q: F.QTensor, t: torch.Tensor) -> torch.Tensor:
    """A QTensor's scale (or zero) [.., groups] spread to its values' shape."""
    s, n, d = q.spec, q.num_tokens, q.head_dim
    if s.per_channel:
        return t.float().repeat_interleave(s.group, dim=-2)[..., :n, :]
    return t.float().repeat_interleave(s.group or d, dim=-1)


@pytest.mark.parametrize("fmt", list(F.QUANTIZED))
@pytest.mark.parametrize("side", [0, 1])
def test_a_round_trip_stays_within_its_formats_bound(fmt: str, side: int) -> None:
    x = _kv()[side]
    q = F.quantize(x, fmt, side)
    err = (q.dequantize() - x).abs()
    scale = _per_element(q, q.scale)
    if fmt == "fp8":  # e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value), subnormals below 2^-6 * scale
        bound = x.abs() * 2**-4 + scale * 2**-9
    else:  # integer codes: half a step, plus the fp16 rounding of the zero (int4) or the scale's
        spread = x.abs().amax() * 2**-10 if q.zero is not None else 0.0
        bound = scale * 0.5 * (1 + 2**-9) + spread
    assert (err <= bound).all(), float((err - bound).max())
    # and it is what a format like it is expected to keep: relative error of the whole tensor
    rel = float(err.norm() / x.norm())
    assert rel < {"fp8": 0.04, "int8": 0.02, "int4": 0.12}[fmt], rel


def test_float_formats_are_a_cast() -> None:
    k, v = _kv()
    for fmt, (dt, _) in kvblob.DTYPES.items():
        ks, vs = F.encode_kv(k, v, fmt)
        assert torch.equal(ks, k.to(dt)) and torch.equal(vs, v.to(dt))
        assert F.round_trip(k, fmt, 0).dtype == k.dtype


def test_a_group_of_zeros_and_a_single_token_survive() -> None:
    x = torch.zeros(2, 3, 1, 64)
    for fmt in F.QUANTIZED:
        for side in (0, 1):
            q = F.quantize(x, fmt, side)
            assert torch.equal(q.dequantize(), x) and torch.isfinite(q.scale.float()).all()


def test_sizes_count_the_scales() -> None:
    # the default model's shape, per token of a 512-token chunk (k and v, every layer)
    L, H, D = 30, 3, 64
    f16 = F.bytes_per_token("float16", L, H, D)
    assert f16 == 2 * L * H * D * 2 == 23040
    assert F.bytes_per_token("fp8", L, H, D) / f16 == F.bytes_per_token("int8", L, H, D) / f16 == (64 + 2) / 128
    # int4: 32 bytes of codes + a scale and zero per channel per 64 tokens (keys) / per 32 channels (values)
    assert F.bytes_per_token("int4", L, H, D) == L * H * ((32 + 2 * 2 * 64 / 64) + (32 + 2 * 2 * 2))
    assert F.bytes_per_token("int4", L, H, D) / f16 <= 0.30
    k, v = _kv()
    blob = kvblob.encode(k, v, model_fingerprint="m", token_ids=list(range(SHAPE[2])), dtype="int4")
    h = kvblob.read_header(blob)
    assert h.payload_bytes == F.payload_bytes("int4", SHAPE) and len(blob) - h.payload_bytes < 2048


@pytest.mark.parametrize("fmt", list(F.QUANTIZED))
def test_block_slices_dequantize_to_the_same_values(fmt: str) -> None:
    k, _ = _kv()
    q = F.quantize(k, fmt, 0)
    whole = q.dequantize()
    spans = [(0, 64), (128, 150)]
    got = F.cat_tokens([F.token_slice(q, a, b) for a, b in spans], q).dequantize()
    assert torch.equal(got, torch.cat([whole[:, :, a:b] for a, b in spans], dim=2))
    assert torch.equal(q.layer(2).dequantize(), whole[2])
    assert F.cat_tokens([], q).shape == (*SHAPE[:2], 0, SHAPE[3])
    if fmt == "int4":
        with pytest.raises(ValueError, match="cut a group"):
            q.tokens(10, 64)


def test_every_e4m3_code_decodes_as_torchs_own_cast() -> None:
    """The fp8 decode moves bits instead of calling torch's (slow on a CPU) cast: every code but NaN's."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    side = F.QUANTIZED["fp8"][0]
    got = F._codes(codes.view(torch.float8_e4m3fn).view(1, -1), side, codes.numel()).float() * 256
    assert side.code == "F8_E4M3" and torch.equal(got, codes.view(torch.float8_e4m3fn).float().view(1, -1))
