"""Per-chunk artifacts a KV blob may carry after its KV (version 2: tensors named `a.<name>`, with their
own checksum), e.g. samkv's sparse-attention analysis (kvfuse.fusion.methods.sparse): which dtypes they
may have, the order they are laid out in, and their bytes. The blob format is `kvfuse.kvblob`."""

from __future__ import annotations

import torch
from torch import Tensor

from kvfuse.blob_checksums import bytes_view

ARTIFACT_PREFIX = "a."
ARTIFACT_DTYPES: dict[torch.dtype, str] = {
    torch.int64: "I64", torch.int32: "I32", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
}
ARTIFACT_CODES = {code: dt for dt, code in ARTIFACT_DTYPES.items()}


def artifact_order(artifacts: dict[str, Tensor]) -> list[str]:
    """Widest element first, then by name: every artifact then starts aligned to its element size from the
    payload's end, with no padding between tensors (safetensors allows none). A float payload ends on an
    8-byte boundary; a quantized one may not, and the artifacts are copied out before they are viewed."""
    return sorted(artifacts, key=lambda n: (-artifacts[n].element_size(), n))


def artifact_bytes(artifacts: dict[str, Tensor]) -> list[memoryview]:
    return [bytes_view(artifacts[name]) for name in artifact_order(artifacts)]


def prepare_artifacts(artifacts: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    if not artifacts:
        return None
    out = {}
    for name, t in artifacts.items():
        if t.dtype not in ARTIFACT_DTYPES:
            raise ValueError(f"artifact {name!r}: dtype {t.dtype} not storable (use one of {list(ARTIFACT_DTYPES)})")
        out[name] = t.detach().to("cpu").contiguous()
    return out
