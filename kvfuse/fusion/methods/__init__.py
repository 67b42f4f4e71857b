"""Fusion methods, one module each, registered by name (see `base`)."""

from __future__ import annotations

import importlib
import pkgutil

from kvfuse.fusion.errors import UnknownMethodError
from kvfuse.fusion.methods.base import FusionMethod, register, registry

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")


def available_methods() -> list[str]:
    return sorted(registry())


def get_method(name: str) -> FusionMethod:
    try:
        return registry()[name]()
    except KeyError:
        raise UnknownMethodError(
            f"unknown fusion method {name!r}; available: {', '.join(available_methods())}"
        ) from None


__all__ = ["FusionMethod", "available_methods", "get_method", "register"]
