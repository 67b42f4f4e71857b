"""Errors of the store package (the service maps them to HTTP answers)."""

from __future__ import annotations


class StoreError(Exception):
    """Any failure of the KV store."""


class IndexUnavailableError(StoreError):
    """The index (Redis) cannot be reached: answer 503 rather than something wrong."""


class StoreReadOnlyError(StoreError):
    """The data directory cannot be written (or the store was opened read-only)."""


class DocumentNotFoundError(StoreError, KeyError):
    """An update named a document the store does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "document not found"
