"""RoPE helpers: cos/sin taken from the model's own rotary module, and position recovery of cached keys.

Cached keys are post-RoPE at positions 0..n-1. RoPE rotations compose (R(p + d) = R(d) R(p)) when the
rotation angle is a fixed linear function of the position, so a chunk placed at offset d is recovered
by rotating its keys by d. cos/sin always come from the model's `rotary_emb`, never from re-derived
frequencies, so scaled variants (linear, llama3, yarn) match the model exactly. Types whose angle
depends on the sequence length (dynamic NTK, longrope) do not compose and are refused.
"""

from __future__ import annotations

import torch

from kvfuse.fusion.errors import UnsupportedModelError

# Rope types whose rotation is a pure, linear function of the position (angle = p * inv_freq).
COMPOSABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def rope_type_of(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., n, D]; cos/sin broadcastable to x (the model's formula: x*cos + rotate_half(x)*sin)."""
    return x * cos + rotate_half(x) * sin


class Rope:
    """The model's rotary embedding, as cos/sin for given positions."""

    def __init__(self, rotary_emb: torch.nn.Module, config, device: torch.device) -> None:
        rope_type = rope_type_of(config)
        if rope_type not in COMPOSABLE_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported: its rotation depends on the sequence length, so "
                f"cached keys cannot be moved to new positions exactly (supported: {sorted(COMPOSABLE_ROPE_TYPES)})"
            )
        self.rotary_emb = rotary_emb
        self.device = device
        # yarn multiplies cos/sin by an attention factor; a shift must be a pure rotation.
        self.attention_scaling = float(getattr(rotary_emb, "attention_scaling", 1.0) or 1.0)
        self._probe = torch.zeros(1, device=device, dtype=torch.float32)
        self._check_composes()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, n, D] for 1-D positions, exactly as the model computes them (incl. its scaling)."""
        cos, sin = self.rotary_emb(self._probe.to(dtype), positions.to(self.device).view(1, -1))
        return cos, sin

    def shift_cos_sin(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [D] of a pure rotation by `delta` positions (attention scaling removed)."""
        cos, sin = self.rotary_emb(self._probe, torch.tensor([[delta]], device=self.device))
        return cos[0, 0] / self.attention_scaling, sin[0, 0] / self.attention_scaling

    def shift_table(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [n, D] of pure rotations by `deltas` [n] positions (attention scaling removed)."""
        cos, sin = self.rotary_emb(self._probe, deltas.to(self.device).view(1, -1))
        return cos[0] / self.attention_scaling, sin[0] / self.attention_scaling

    def shift_keys_(self, k: torch.Tensor, delta: int) -> None:
        """Rotate keys [..., n, D] computed at positions 0..n-1 to positions delta..delta+n-1, in place."""
        if delta == 0:
            return
        cos, sin = self.shift_cos_sin(delta)
        if k.dtype == torch.float32:
            turned = rotate_half(k).mul_(sin)
            k.mul_(cos).add_(turned)
        else:  # rotate in fp32, round once
            k.copy_(apply_rope(k.float(), cos, sin))

    def _check_composes(self) -> None:
        # Guard against rotary modules that are not a fixed rotation per position (e.g. a custom dynamic
        # variant behind an allowed name): rotating by p then by d must equal rotating by p + d.
        x = torch.randn(4, self.rotary_emb.inv_freq.numel() * 2, generator=torch.Generator().manual_seed(0))
        x = x.to(self.device)
        for p, d in ((3, 5), (100, 2000), (1000, 3000)):
            cp, sp = self.shift_cos_sin(p)
            cd, sd = self.shift_cos_sin(d)
            cpd, spd = self.shift_cos_sin(p + d)
            twice = apply_rope(apply_rope(x, cp, sp), cd, sd)
            once = apply_rope(x, cpd, spd)
            if not torch.allclose(twice, once, atol=1e-3, rtol=1e-3):
                raise UnsupportedModelError("the model's rotary embedding does not compose across positions")
