"""The fusion engine: chunk KV precompute, position recovery, token selection, fused prefill, decoding.

Pure torch + transformers; no web, no storage. See docs/INTERFACES.md for the contract.
"""

from kvfuse.fusion.errors import ContextOverflowError, FusionError, UnknownMethodError, UnsupportedModelError
from kvfuse.fusion.fusion_engine import FusionEngine
from kvfuse.fusion.methods import available_methods
from kvfuse.fusion.types import (
    ChunkKV,
    FusedPrefill,
    FusionOptions,
    GenerationOptions,
    GenerationResult,
    TokenDelta,
)

__all__ = [
    "ChunkKV", "ContextOverflowError", "FusedPrefill", "FusionEngine", "FusionError", "FusionOptions",
    "GenerationOptions", "GenerationResult", "TokenDelta", "UnknownMethodError", "UnsupportedModelError",
    "available_methods",
]
