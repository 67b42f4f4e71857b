"""Errors raised by the retriever package."""

from __future__ import annotations


class EmptyDocumentError(ValueError):
    """The document has no text to chunk (empty or whitespace only)."""


class EmbedderError(RuntimeError):
    """The embedding model could not be loaded; the message says what to install or set."""


class IndexLoadError(RuntimeError):
    """The saved vector index cannot be used as it is (torn or corrupt files, another dimension).

    The caller rebuilds it from the stored documents (`VectorIndex.rebuild`)."""


class FilterTypeError(ValueError):
    """A metadata filter compares a field with a value of another JSON type than the documents store
    there (a string against numbers, say): it could never match, so it is refused rather than answered
    with nothing."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class FilterSyntaxError(ValueError):
    """A metadata filter that is not one: an unknown operator, an operand of the wrong shape (`$in` without
    a list, `$gt` on a boolean), an empty `$and`. `path` names where, as the request spells it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
