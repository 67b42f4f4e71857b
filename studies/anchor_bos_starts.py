"""Does anchor lose values on Gemma 3 at ~2k because it recomputes no chunk starts after the BOS? (docs/results/fidelity-gemma3)

    python studies/anchor_bos_starts.py BENCH-FIDELITY-ARGS... --methods anchor_starts[,...]

`kvfuse bench fidelity` with one more method registered, `anchor_starts`: anchor with its
`fusion.anchor_tokens` chunk-start tokens forced on every chunk, as for chunks cached alone. The service's
anchor forces them only on chunks cached alone (`SelectionContext.sink_starts`), and a chunk cached after
the sequence's BOS (kvfuse/fusion/chunk_context.py, `starting_with`) counts as cached after a context. Such
a chunk has no start sink of its own (the BOS is the sink), but its first tokens saw nothing of the
prompt before them, so their K/V are the furthest from vanilla's; at 256-token chunks they are twice the
share of the context that they are at 512. Run on the examples of the ~2k runs (same seed, vanilla read
from `--reference-dir`), it pairs example for example with anchor's rows there.
"""

from __future__ import annotations

import sys

from kvfuse import cli
from kvfuse.fusion.methods.anchor import Anchor
from kvfuse.fusion.methods.base import register
from kvfuse.fusion.methods.selection import SelectionContext


@register
class AnchorStarts(Anchor):
    """anchor, its chunk-start anchors forced on every chunk whatever it was cached after."""

    name = "anchor_starts"

    def select(self, ctx: SelectionContext):
        ctx.alone = [True] * len(ctx.alone)
        return super().select(ctx)


if __name__ == "__main__":
    sys.exit(cli.main(["bench", "fidelity", *sys.argv[1:]]))
