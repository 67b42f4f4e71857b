"""Waiting for a kvfuse server from outside it: poll `GET /ready` until it answers 200.

One loop for everything that starts a server and then talks to it: `kvfuse ingest/query --local` (a
server in a thread), `kvfuse bench load` (a server process) and the tests' server processes. The
caller says how to tell that the server died meanwhile (`alive`), so a crash ends the wait at once
instead of at the timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

POLL_S = 0.5


def wait_ready(url: str, timeout: float, alive: Callable[[], bool] = lambda: True, every: float = POLL_S) -> bool:
    """True once `url`/ready answers 200; False when `alive()` turns false or `timeout` seconds pass.
    `every`: seconds between polls (the tests, which start a server some hundred times, poll faster)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:  # one client: a fresh one per poll costs more CPU than the poll
        while alive():
            try:
                if client.get(f"{url}/ready").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(every)
    return False
