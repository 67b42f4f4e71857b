"""`server.kv_budget_tokens` is a device's: local workers sharing a device split it (and the device tier's
`store.device_tier_mb`, carved from it), so the device holds their sum within it; a worker with a device
of its own keeps the whole (kvfuse/service/dispatch/local_pool.py, `device_shares`)."""

from __future__ import annotations

from kvfuse.config import load_settings
from kvfuse.service.dispatch.local_pool import device_shares


def _shares(tmp_path, **over) -> list[tuple[str, int, int]]:
    s = load_settings(data_dir=tmp_path, **over)
    return [(w.model.device, w.server.kv_budget_tokens, w.store.device_tier_mb) for w in device_shares(s)]


def test_workers_on_one_device_split_its_budget(tmp_path) -> None:
    got = _shares(tmp_path, server={"workers": 3, "kv_budget_tokens": 10_000}, store={"device_tier_mb": 64})
    assert got == [("cpu", 3334, 22), ("cpu", 3333, 21), ("cpu", 3333, 21)]
    assert sum(b for _, b, _ in got) == 10_000 and sum(t for _, _, t in got) == 64


def test_a_worker_per_device_keeps_the_whole_budget_and_a_shared_device_splits_it(tmp_path) -> None:
    whole = _shares(tmp_path, server={"workers": 2, "kv_budget_tokens": 8192}, model={"devices": ["cuda:0", "cuda:1"]})
    assert whole == [("cuda:0", 8192, 0), ("cuda:1", 8192, 0)]
    # three workers over two devices: cuda:0 holds two of them, cuda:1 one
    mixed = _shares(tmp_path, server={"workers": 3, "kv_budget_tokens": 8192}, model={"devices": ["cuda:0", "cuda:1"]})
    assert mixed == [("cuda:0", 4096, 0), ("cuda:1", 8192, 0), ("cuda:0", 4096, 0)]
    one = _shares(tmp_path, server={"workers": 1, "kv_budget_tokens": 8192})
    assert one == [("cpu", 8192, 0)]
