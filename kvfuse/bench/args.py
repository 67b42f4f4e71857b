"""Argument types shared by the `kvfuse bench` subcommands (imports nothing heavy)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

_NAMES = {int: "integers", float: "numbers", str: "names"}


def csv_list(kind: type) -> Callable[[str], list]:
    """An argparse type: "a,b,c" as a list of `kind` (empty items skipped)."""

    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected comma-separated {_NAMES.get(kind, kind.__name__)}: "
                                             f"{text!r}") from err

    return parse
