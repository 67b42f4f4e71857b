"""`kvfuse` subcommands of the bench package (registered by kvfuse.cli)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's subcommands; import nothing heavy here."""
