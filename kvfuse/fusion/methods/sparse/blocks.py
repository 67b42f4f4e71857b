"""How a chunk divides into blocks: SamKV's segments (paper Sec. 4.1: 64-token blocks, one initial block,
two local blocks; the blocks in between are the middle, the only ones sparsified).

A chunk of fewer than initial + local + 1 blocks has no middle: every block is kept. A short last block
counts as a block (it holds the chunk's last tokens, the local ones)."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_TOKENS = 64
INITIAL_BLOCKS = 1
LOCAL_BLOCKS = 2


@dataclass(frozen=True)
class Segments:
    num_tokens: int
    block_tokens: int = BLOCK_TOKENS
    initial_blocks: int = INITIAL_BLOCKS
    local_blocks: int = LOCAL_BLOCKS

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_tokens)

    @property
    def initial(self) -> list[int]:
        return list(range(min(self.initial_blocks, self.num_blocks)))

    @property
    def local(self) -> list[int]:
        first = max(len(self.initial), self.num_blocks - self.local_blocks)
        return list(range(first, self.num_blocks))

    @property
    def middle(self) -> list[int]:
        return list(range(len(self.initial), self.num_blocks - len(self.local)))

    @property
    def anchor(self) -> list[int]:
        """Initial + local blocks: always kept, and the anchor of Eq. 2."""
        return self.initial + self.local

    def tokens(self, block: int) -> range:
        return range(block * self.block_tokens, min((block + 1) * self.block_tokens, self.num_tokens))

    def token_list(self, blocks: list[int]) -> list[int]:
        return [t for b in blocks for t in self.tokens(b)]


STABLE_SHARE = 0.125  # N*: the last ceil(L / 8) layers


def stable_layers(num_layers: int) -> range:
    """N*, the "attention-stable" layers Eq. 3 averages over. The paper derives them per model (Appendix
    A.2) and finds the last 4-5 layers for 32-36-layer models; that derivation is not run here: the last
    ceil(L / 8) layers are taken (4 of the default model's 30, as the paper's 4 of Llama-3.1-8B's 32)."""
    count = max(1, -(-num_layers // int(round(1 / STABLE_SHARE))))
    return range(num_layers - count, num_layers)
