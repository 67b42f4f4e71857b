"""The fusion engine: chunk KV precompute, position recovery, token selection, fused prefill, decoding.

Pure torch + transformers; no web, no storage. See docs/INTERFACES.md for the contract.

The names below are imported on first use (PEP 562): the API process reaches torch-free modules of this
package (the prompt layout, the errors, the option types) without loading the engine, its methods and
torch's compiler with them, which would add seconds to every start of a process that never runs the model.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "ContextOverflowError": "errors", "FusionError": "errors", "UnknownMethodError": "errors",
    "UnsupportedModelError": "errors", "FusionEngine": "fusion_engine", "available_methods": "methods",
    "ChunkKV": "types", "FusedPrefill": "types", "FusionOptions": "types", "GenerationOptions": "types",
    "GenerationResult": "types", "TokenDelta": "types",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
