"""Peak resident memory of this process while a block runs.

A sampling thread reads VmRSS from /proc/self/status every `interval_s`: it sees the growth of the
current block (unlike ru_maxrss, which only ever reports the process's lifetime peak). A spike shorter
than the interval can be missed, so the figure is a lower bound of the true peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
import threading
from pathlib import Path

SAMPLE_INTERVAL_S = 0.005  # shorter than a prefill, cheap enough not to slow it
_STATUS = Path("/proc/self/status")


def rss_bytes() -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    # No /proc (not Linux): the lifetime peak is the best there is (kilobytes on Linux, bytes on macOS).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim), so one method's
    freed buffers do not hide the next one's growth (RSS never shrinks on its own)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


class PeakRSS:
    """`with PeakRSS() as m: ...` then `m.delta_mb`: peak VmRSS during the block minus VmRSS at entry."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S):
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRSS:
        release_free_memory()
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.start) / 2**20
