"""Errors raised by the fusion engine."""

from __future__ import annotations


class FusionError(Exception):
    """Base class of every fusion engine error."""


class UnknownMethodError(FusionError, ValueError):
    """The requested fusion method is not registered."""


class ContextOverflowError(FusionError, ValueError):
    """prefix + chunks + question (+ max_tokens) exceed the model's context."""

    def __init__(self, message: str, *, excess_tokens: int) -> None:
        super().__init__(message)
        self.excess_tokens = excess_tokens


class UnsupportedModelError(FusionError):
    """The model's architecture or position encoding cannot be fused exactly."""


class MethodRefusedError(FusionError, ValueError):
    """A fusion method (or eviction) cannot compute this model exactly, and refuses the request rather
    than answer wrong (docs/models.md says which, and why)."""


class NonFiniteLogits(FusionError):
    """The model's logits for one sequence hold NaN or inf (its prefill's or a decode step's): that
    sequence fails, its neighbours in the batch keep their tokens (docs/DESIGN.md, "Decoding")."""

    def __init__(self, message: str = "the model produced non-finite logits for this sequence") -> None:
        super().__init__(message)
