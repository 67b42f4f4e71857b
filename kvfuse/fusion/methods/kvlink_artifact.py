"""The trained link-token embeddings of `kvlink` (KVLink, docs/methods/kvlink.md): one small file per model.

A file holds, for each trained link count K, a table [max_docs, K, hidden]: row n is the K link
embeddings that follow the n-th chunk of a prompt (the paper's "link n-1 … link n-K": the identity of a
link token is the chunk's index, not its content). Its metadata names the model fingerprint it was
trained for (`FusionEngine.fingerprint`), so an engine only ever uses embeddings trained on its own
weights, tokenizer and dtype. Format: safetensors (tensors `links_k{K}`) with string metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

FORMAT = "kvfuse-kvlink/1"
# The artifacts shipped with the package (pyproject's package-data, kvfuse/artifacts/kvlink), found through
# the installed package itself, so a wheel, an editable install and the image all resolve the same folder.
PACKAGED_DIR = Path(str(resources.files("kvfuse") / "artifacts" / "kvlink"))
TRAIN_COMMAND = "kvfuse train kvlink"


class KVLinkArtifactError(ValueError):
    """No usable link embeddings for this request (a ValueError: the service answers 422)."""


@dataclass
class LinkArtifact:
    fingerprint: str
    tables: dict[int, torch.Tensor]  # K -> [max_docs, K, hidden]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def max_docs(self) -> int:
        return next(iter(self.tables.values())).shape[0]

    @property
    def link_counts(self) -> list[int]:
        return sorted(self.tables)

    def embeddings(self, k: int, num_chunks: int) -> torch.Tensor:
        """[num_chunks, k, hidden]: the links of chunks 0..num_chunks-1. Chunks past the trained
        `max_docs` reuse the last trained index (the paper's table has a fixed size too)."""
        if k not in self.tables:
            raise KVLinkArtifactError(
                f"kvlink: link_tokens={k} was not trained for this model (trained: "
                f"{', '.join(map(str, self.link_counts))}; 0 = no link tokens); run `{TRAIN_COMMAND} "
                f"--link-tokens {k}` to train it")
        table = self.tables[k]
        idx = torch.clamp(torch.arange(num_chunks), max=table.shape[0] - 1)
        return table[idx]

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        meta = {**self.meta, "format": FORMAT, "fingerprint": self.fingerprint,
                "link_counts": json.dumps(self.link_counts)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({f"links_k{k}": t.detach().float().contiguous().cpu() for k, t in self.tables.items()},
                  str(tmp), metadata=meta)
        tmp.replace(path)


def artifact_path(directory: Path, fingerprint: str) -> Path:
    return Path(directory) / f"{fingerprint[:16]}.safetensors"


def read(path: Path) -> LinkArtifact:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        if meta.get("format") != FORMAT:
            raise KVLinkArtifactError(f"{path}: not a {FORMAT} file (format {meta.get('format')!r})")
        tables = {int(name.removeprefix("links_k")): f.get_tensor(name) for name in f.keys()}
    return LinkArtifact(meta.pop("fingerprint"), tables, meta)


def find(directory: Path, fingerprint: str) -> LinkArtifact | None:
    """The artifact of `fingerprint` in `directory`, or None."""
    path = artifact_path(directory, fingerprint)
    if not path.is_file():
        return None
    art = read(path)
    return art if art.fingerprint == fingerprint else None


def missing_message(fingerprint: str) -> str:
    return (f"kvlink needs link-token embeddings trained for this model (fingerprint {fingerprint[:16]}), "
            f"and none were found: train them with `{TRAIN_COMMAND}` (they are saved where the server loads "
            f"them, fusion.kvlink_dir), then restart the server")
