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


def wait_ready(url: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """True once `url`/ready answers 200; False when `alive()` turns false or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while alive():
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return False
