"""How late the API's event loop runs: every request, refusal and stream of the API process shares one
loop, so work that holds it (a parse, a JSON decode, a flood's refusals) delays everything else by as
much. A timer asks to wake every `every_s`; how much later it woke goes to `kvfuse_event_loop_lag_seconds`
(docs/DESIGN.md, "Bounded under load"; `kvfuse bench overload` reads it per block).
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

EVERY_S = 0.05  # often enough to see a stall of a few milliseconds, cheap enough to run always


async def watch_loop_lag(histogram: Histogram, every_s: float = EVERY_S) -> None:
    """Observe the loop's lag into `histogram` until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + every_s
        await asyncio.sleep(every_s)
        histogram.observe(max(0.0, loop.time() - asked))
