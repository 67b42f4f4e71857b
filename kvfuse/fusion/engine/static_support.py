"""What the static decode path (runner.py) needs from torch, and what of it only a CUDA device runs.

The static step is FlexAttention over the whole KV memory with a block mask rebuilt from each row's key
range, traced whole by `torch.compile`; on CUDA each batch bucket is then captured as a CUDA graph. The
torch a GPU image brings need not be the one requirements.txt pins, so the runner asks here first and
refuses, naming what is missing and the way round it (fusion.decode_cuda_graphs=false: the eager path),
instead of failing inside a compile. docs/DESIGN.md, "Decoding", has the two paths.

Everything but the graph capture runs on the CPU too (tests/fusion/test_static_path.py compiles it with
inductor there); CUDA_ONLY names the rest, so no other module need say it.
"""

from __future__ import annotations

import inspect

import torch

# What only a CUDA device runs: the tests of these skip without one (pytest -m cuda).
CUDA_ONLY = (
    "CUDA-graph capture and replay of the static step per batch bucket (torch.cuda.CUDAGraph, "
    "runner._StaticStep._capture)",
)

# What the static step calls in torch.nn.attention.flex_attention (torch >= 2.5 has all of it).
NEEDED = ("flex_attention(enable_gqa=...)", "BlockMask.from_kv_blocks", "BlockMask(seq_lengths, *tables)")


class StaticPathUnavailable(RuntimeError):
    """This torch lacks something the static decode path calls."""


def missing() -> list[str]:
    """The NEEDED entries this torch lacks (empty: the static path can run)."""
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError:
        return list(NEEDED)
    out = []
    if "enable_gqa" not in inspect.signature(fa.flex_attention).parameters:
        out.append(NEEDED[0])
    if not hasattr(fa.BlockMask, "from_kv_blocks"):
        out.append(NEEDED[1])
    if "seq_lengths" not in inspect.signature(fa.BlockMask.__init__).parameters:
        out.append(NEEDED[2])
    return out


def require() -> None:
    """Raise StaticPathUnavailable, saying what is missing and what to do, unless this torch has it all."""
    lacking = missing()
    if lacking:
        raise StaticPathUnavailable(
            f"the static decode path needs torch.nn.attention.flex_attention's {', '.join(lacking)}, which torch "
            f"{torch.__version__} lacks (requirements.txt pins the torch it is built on); install that torch, "
            f"or set fusion.decode_cuda_graphs=false to decode on the eager path")
