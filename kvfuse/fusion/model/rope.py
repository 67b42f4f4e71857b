"""RoPE helpers: cos/sin taken from the model's own rotary module, and position recovery of cached keys.

Cached keys are post-RoPE at positions 0..n-1. RoPE rotations compose (R(p + d) = R(d) R(p)) when the
rotation angle is a fixed linear function of the position, so a chunk placed at offset d is recovered
by rotating its keys by d. cos/sin always come from the model's rotary module, never from re-derived
frequencies, so scaled variants (linear, llama3, yarn, LongRoPE's factors) match the model exactly.

A model may rotate only the first dimensions of each head (partial rotary, Phi-4-mini): cos/sin then
cover those dimensions and `apply_rope` passes the rest through, as transformers' Phi-3 code does. A
model may have one rotary embedding per layer type (Gemma 3: local layers base 10k, global layers 1M,
each with its own scaling): a `Rope` is one of them (`layer_type`), and the transformer keeps one per
layer (kvfuse/fusion/model/transformer.py, `rope_of`).

Types whose angle depends on the sequence length are a fixed rotation only up to a length, and are
served up to it (docs/models.md):
- longrope (Phi-3.5/4-mini) uses its short factors while the sequence is within
  `original_max_position_embeddings` and switches every position to its long factors past it; stored
  chunk caches carry the short rotation, so the engine's context stops there (`valid_length`);
- dynamic NTK is the plain rotation up to `max_position_embeddings`, the model's own limit, which the
  engine never passes.
"""

from __future__ import annotations

import torch

from kvfuse.fusion.errors import UnsupportedModelError

# Rope types whose rotation is a pure, linear function of the position (angle = p * inv_freq) at any length.
COMPOSABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# Rope types that are such a rotation up to a length (`valid_length`), and change past it.
BOUNDED_ROPE_TYPES = frozenset({"longrope", "dynamic"})


def rope_params(config, layer_type: str | None = None) -> dict:
    """The rope parameters of `config` (of one layer type, for a model with one set per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params


def rope_type_of(config, layer_type: str | None = None) -> str:
    params = rope_params(config, layer_type)
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def valid_length(config, layer_type: str | None = None) -> tuple[int | None, str]:
    """(tokens, why): the sequence length past which this rope stops being the rotation stored chunk
    caches carry, and a sentence saying so; (None, "") when it never stops within the model's positions."""
    if rope_type_of(config, layer_type) != "longrope":
        return None, ""
    params = rope_params(config, layer_type)
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    if not original or int(original) >= int(config.max_position_embeddings):
        return None, ""
    return int(original), (
        f"LongRoPE switches every position to its long factors past original_max_position_embeddings = {original}, "
        "where stored chunk caches (computed with the short factors) stop being valid")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., n, D]; cos/sin broadcastable to x's first cos.shape[-1] dimensions (the model's formula:
    x*cos + rotate_half(x)*sin over the rotary dimensions, the rest passed through)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :d]
    return torch.cat([rot * cos + rotate_half(rot) * sin, x[..., d:]], dim=-1)


class Rope:
    """The model's rotary embedding (of one layer type, when it has one per type), as cos/sin for given
    positions. `limit`: the length it is valid up to for stored caches (`valid_length`; None: any)."""

    def __init__(self, rotary_emb: torch.nn.Module, config, device: torch.device, layer_type: str | None = None) -> None:
        rope_type = rope_type_of(config, layer_type)
        if rope_type not in COMPOSABLE_ROPE_TYPES | BOUNDED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported: the engine must move cached keys to new positions "
                f"by a rotation (supported: {sorted(COMPOSABLE_ROPE_TYPES | BOUNDED_ROPE_TYPES)})")
        self.rotary_emb = rotary_emb
        self.layer_type = layer_type
        self.rope_type = rope_type
        self.device = device
        self.limit, self.limit_reason = valid_length(config, layer_type)
        self.max_positions = min(int(config.max_position_embeddings), self.limit or int(config.max_position_embeddings))
        suffix = f"{layer_type}_" if layer_type is not None else ""
        # yarn and longrope multiply cos/sin by an attention factor; a shift must be a pure rotation.
        scaling = getattr(rotary_emb, f"{suffix}attention_scaling", getattr(rotary_emb, "attention_scaling", 1.0))
        self.attention_scaling = float(scaling or 1.0)
        self.dim = 2 * getattr(rotary_emb, f"{suffix}inv_freq").numel()  # rotary dimensions of a head
        self._probe = torch.zeros(1, device=device, dtype=torch.float32)
        self._check_composes()

    def _call(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_type is None:
            return self.rotary_emb(x, positions)
        return self.rotary_emb(x, positions, self.layer_type)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, n, dim] for 1-D positions, exactly as the model computes them (incl. its scaling)."""
        return self._call(self._probe.to(dtype), positions.to(self.device).view(1, -1))

    def shift_cos_sin(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [dim] of a pure rotation by `delta` positions (attention scaling removed)."""
        cos, sin = self._call(self._probe, torch.tensor([[delta]], device=self.device))
        return cos[0, 0] / self.attention_scaling, sin[0, 0] / self.attention_scaling

    def shift_table(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [n, dim] of pure rotations by `deltas` [n] positions (attention scaling removed).
        A negative delta is the inverse rotation: cos(-a) = cos(a), sin(-a) = -sin(a), so it is taken from
        |delta| (a position the rotary module is valid at)."""
        deltas = deltas.to(self.device).view(-1)
        cos, sin = self._call(self._probe, deltas.abs().view(1, -1))
        sign = torch.where(deltas < 0, -1.0, 1.0).to(sin.dtype)[:, None]
        return cos[0] / self.attention_scaling, sin[0] * sign / self.attention_scaling

    def shift_keys_(self, k: torch.Tensor, delta: int) -> None:
        """Rotate keys [..., n, D] computed at positions 0..n-1 to positions delta..delta+n-1, in place
        (a negative delta rotates them back)."""
        if delta == 0:
            return
        cos, sin = self.shift_table(torch.tensor([delta]))
        cos, sin = cos[0], sin[0]
        rot = k[..., : self.dim]
        if k.dtype == torch.float32:
            turned = rotate_half(rot).mul_(sin)
            rot.mul_(cos).add_(turned)
        else:  # rotate in fp32, round once
            rot.copy_(apply_rope(rot.float(), cos, sin))

    def frequencies(self) -> torch.Tensor:
        """fp32 [dim]: each rotary dimension's angle per position, read from the module's own rotation by
        one position (so a scaled rope's scaling is in it: linear, llama3, yarn, LongRoPE's factors)."""
        cos, sin = self.shift_cos_sin(1)
        return torch.atan2(sin, cos).abs()

    def _check_composes(self) -> None:
        # Guard against rotary modules that are not a fixed rotation per position (e.g. a dynamic variant
        # behind an allowed name): rotating by p then by d must equal rotating by p + d, up to the float
        # rounding a true rotation has there (`composition_tolerance`), at positions where the rope is
        # valid, up to the last one. It judges the module over every position the model has, not the
        # deployment's `model.max_context_tokens`: stored chunk caches are keyed by the model, not by that
        # setting, so a later deployment with a longer context reuses them and shifts them further.
        x = torch.randn(4, self.dim, generator=torch.Generator().manual_seed(0)).to(self.device)
        freq = self.frequencies()
        top = self.max_positions - 1
        pairs = [(p, d) for p, d in ((3, 5), (100, 2000), (1000, 3000)) if p + d <= top]
        pairs += [(top // 4, top // 2), (top // 4, top - top // 4)]
        for p, d in pairs:
            cp, sp = self.shift_cos_sin(p)
            cd, sd = self.shift_cos_sin(d)
            cpd, spd = self.shift_cos_sin(p + d)
            twice = apply_rope(apply_rope(x, cp, sp), cd, sd)
            once = apply_rope(x, cpd, spd)
            err = (twice - once).abs()
            tol = composition_tolerance(x, freq, p, d, cpd.dtype)
            if not bool((err <= tol).all()):  # NaN fails too
                worst = int(torch.argmax(torch.nan_to_num(err / tol, nan=float("inf"))))
                raise UnsupportedModelError(
                    f"the model's rotary embedding does not compose across positions: rotating by {p} then by "
                    f"{d} differs from rotating by {p + d} by {err.view(-1)[worst]:.2e}, over the "
                    f"{tol.view(-1)[worst]:.2e} that float rounding of a true rotation allows there "
                    f"(rotary dimension {worst % self.dim}{self._named()})")

    def _named(self) -> str:
        return f", {self.layer_type} layers" if self.layer_type is not None else ""


# Rounding steps of one rotation besides its angle, in units of the dtype's unit roundoff u, per unit of a
# rotary pair's norm: cos and sin each within 2 ulp (sleef, libm) of the rounded angle's, so the rotation
# matrix is off by <= 2u per entry, <= 2*sqrt(2) u in norm; the division by the attention scaling, u per
# entry; x*cos + rotate_half(x)*sin, two products and a sum, <= 2*sqrt(2) u. So ~7u per rotation, and the
# check compares three (two, then one): ~21u, taken as 32 for headroom. (Rotations keep norms, so a
# perturbation made before the second rotation carries through unchanged.)
ROTATION_ROUNDING_ULPS = 32.0


def composition_tolerance(x: torch.Tensor, freq: torch.Tensor, p: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The largest |R(d) R(p) x - R(p + d) x| a true rotation rounded in `dtype` can give, per element of
    x [..., dim] (rotary dimensions, rotate_half's pairing), with `freq` [dim] each dimension's angle per
    position (`Rope.frequencies`).

    Why it grows with the position: the module computes the angle as fl(q * f) for position q, rounded
    to u = eps/2 relative, i.e. an absolute angle error up to u * q * f radians (f itself is rounded
    once, but the same f serves all three rotations, so its error composes exactly). The three angles
    (p, d, p + d) err by up to u * f * (p + d + (p + d)) together, and a pair of norm r turned by an angle
    off by e moves by at most r * e. On top of that the rounding of each rotation
    (`ROTATION_ROUNDING_ULPS`). So per element: r * u * (2 (p + d) f + ROTATION_ROUNDING_ULPS). The head
    dim and base enter through f = base^(-2i/dim) (the fastest dimensions, f ~ 1, err the most: Gemma 3's
    sliding layers, base 10k and 256-wide heads, have many of them). In float32 at p + d = 32k positions
    that is ~4e-3 r on the fastest dimension: real error, which shifted chunk caches carry too
    (tests/fusion/test_rope.py pins `shift_keys_` to the same bound). A rope whose angle is not linear in
    the position misses it by orders of magnitude on some dimension."""
    u = torch.finfo(dtype).eps / 2
    half = x.shape[-1] // 2
    pair = (x[..., :half].float().pow(2) + x[..., half:].float().pow(2)).sqrt()
    r = torch.cat([pair, pair], dim=-1)
    return r * u * (2.0 * (p + d) * freq.to(r.device).float() + ROTATION_ROUNDING_ULPS)
