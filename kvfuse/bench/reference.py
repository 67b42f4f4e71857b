"""Vanilla's outputs kept on disk, so a later fidelity run over the same examples skips vanilla.

An entry holds vanilla's answer text, its greedy tokens (the stop token included when it stopped), the
next-token log-probabilities at each of those steps (fp16: the answer KL renormalises them), its TTFT and
token counts. The key is a hash of the model fingerprint, the exact prompt tokens (system prefix, every
chunk, question and answer prefix: the example's content and template) and the generation settings
(greedy, the answer budget), so any change to one of them is a miss, never a stale hit. The folder is the
setting `bench.reference_dir`; see docs/DESIGN.md, "Fidelity measures".
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "kvfuse-vanilla-reference/1"


@dataclass
class Reference:
    prediction: str
    tokens: list[int]  # vanilla's greedy answer, stop token included when it stopped
    logprobs: Any  # [len(tokens), vocab] fp16 tensor: the distribution each token was chosen from
    ttft_s: float
    context_tokens: int
    recomputed_tokens: int
    cached: bool = False  # read back from disk (not computed in this run)


def reference_key(fingerprint: str, prompt: Sequence[Sequence[int]], max_tokens: int) -> str:
    """prompt: the token id lists of the prefix, each chunk and the question, in order."""
    text = json.dumps({"format": FORMAT, "model": fingerprint, "prompt": [list(p) for p in prompt],
                       "generation": {"greedy": True, "max_tokens": int(max_tokens)}}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class ReferenceCache:
    """One file per example under `root` (created on first write)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.pt"

    def load(self, key: str) -> Reference | None:
        import torch

        path = self.path(key)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - a truncated or foreign file is a miss; it is rewritten
            self.misses += 1
            return None
        if raw.get("format") != FORMAT:
            self.misses += 1
            return None
        self.hits += 1
        return Reference(raw["prediction"], list(raw["tokens"]), raw["logprobs"], float(raw["ttft_s"]),
                         int(raw["context_tokens"]), int(raw["recomputed_tokens"]), cached=True)

    def save(self, key: str, ref: Reference) -> None:
        import torch

        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"format": FORMAT, "prediction": ref.prediction, "tokens": list(ref.tokens),
                    "logprobs": ref.logprobs.to(torch.float16).contiguous(), "ttft_s": ref.ttft_s,
                    "context_tokens": ref.context_tokens, "recomputed_tokens": ref.recomputed_tokens}, tmp)
        tmp.replace(path)  # atomic: a concurrent reader sees the old state or the whole file
