"""The model runner: one forward decode step for every sequence in a `KVPool`, from static-shape inputs.

The step (`forward`) is a pure function of tensors -- the B new token ids, their positions, the slot
index each writes its K/V at, how many keys each then sees, and the pool's K/V viewed as its first B
slots and first `window` tokens -- so nothing in it depends on a Python number: it can be captured.
Per layer: the B rows' projections as one matrix, their K/V written into the pool, then ONE attention
call for all B sequences over the pool view, with a boolean length mask (key j visible to row i while
j < seen[i]); the query heads sharing a KV head are folded into the rows of that call, as in
`Transformer.attend_all`.

Three ways to run it, chosen once (docs/DESIGN.md, "Decoding"):
- eager (the default off CUDA): the exact batch and window, no padding;
- `torch.compile(fullgraph=True, dynamic=False)` (`fusion.decode_compile`): batch and window rounded
  to buckets (powers of two, windows of at least `TOKEN_ROUND`) so compiles stay few; each new bucket
  compiles once;
- CUDA graphs (`fusion.decode_cuda_graphs`, on a CUDA device only), as nano-vllm's model runner: a
  graph per (batch bucket, window bucket), captured on first use into static input buffers and
  replayed after; rows past the batch are dummies writing into free slots. Graphs are dropped when the
  pool's buffers are replaced (`KVPool.generation`). A capture that fails falls back to eager.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvfuse.fusion.kv_pool import TOKEN_ROUND, KVPool, pow2_at_least

log = logging.getLogger("kvfuse.fusion")


class DecodeRunner:
    """Decode steps over `pool` with the layers of `tf` (kvfuse.fusion.model.transformer.Transformer)."""

    def __init__(self, tf, pool: KVPool, *, cuda_graphs: bool = False, compile_backend: str | None = None) -> None:
        """compile_backend: run the step through torch.compile with this backend (None: eagerly)."""
        self.tf, self.pool = tf, pool
        self.num_heads, self.num_kv_heads, self.head_dim = tf.num_heads, tf.num_kv_heads, tf.head_dim
        self.use_graphs = cuda_graphs and pool.device.type == "cuda"
        self.bucketed = self.use_graphs or compile_backend is not None
        self.forward_fn = self.forward
        if compile_backend is not None:
            self.forward_fn = torch.compile(self.forward, fullgraph=True, dynamic=False, backend=compile_backend)
        self._graphs: dict[tuple[int, int], _CapturedStep] = {}
        self._graph_generation = -1
        self._graph_memory = None  # one CUDA memory pool shared by every captured graph

    @classmethod
    def from_settings(cls, tf, fusion) -> DecodeRunner:
        """A runner over a new, empty pool for `tf`, run as `fusion` (kvfuse.config FusionSettings) says."""
        return cls(tf, KVPool.for_transformer(tf), cuda_graphs=fusion.decode_cuda_graphs,
                   compile_backend="inductor" if fusion.decode_compile else None)

    # -- the step -----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor, seen: torch.Tensor,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """ids, positions, write, seen [B] (int64) and the pool's view [L, B, Hkv, window, D] -> logits
        [B, vocab] (fp32). Writes each row's K/V at index write[i] of slot i (through the view)."""
        tf = self.tf
        b, window = ids.shape[0], k_pool.shape[3]
        group = self.num_heads // self.num_kv_heads
        cos, sin = (t.view(b, 1, 1, -1) for t in tf.rope.cos_sin(positions, tf.dtype))  # [B, 1, 1, D]
        rows = torch.arange(b, device=ids.device)
        visible = torch.arange(window, device=ids.device).view(1, window) < seen.view(b, 1)
        mask = visible.view(b, 1, 1, window)
        h = tf.embed_tokens(ids.view(b, 1))  # [B, 1, hidden]
        for layer in range(tf.num_layers):
            q, k, v = tf.project(layer, h, cos, sin)  # [B, H | Hkv, 1, D]
            k_layer, v_layer = k_pool[layer], v_pool[layer]  # [B, Hkv, window, D]
            k_layer[rows, :, write] = k[:, :, 0].to(k_layer.dtype)
            v_layer[rows, :, write] = v[:, :, 0].to(v_layer.dtype)
            out = F.scaled_dot_product_attention(q.reshape(b, self.num_kv_heads, group, self.head_dim),
                                                 k_layer, v_layer, attn_mask=mask, scale=tf.scale)
            h = tf.finish(layer, h, out.reshape(b, self.num_heads, 1, self.head_dim))
        return tf.logits(h[:, -1])

    @torch.inference_mode()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append token_ids [size] (slot i's token at row i) to every occupied slot; returns the
        next-token logits [size, vocab] (fp32, on the pool's device)."""
        pool = self.pool
        n = pool.size
        if n == 0 or token_ids.numel() != n:
            raise ValueError(f"{token_ids.numel()} tokens for {n} occupied slots")
        pool.check_room()
        seen = [length + 1 for length in pool.lengths]
        rows = pow2_at_least(n) if self.bucketed else n
        window = self._window(max(seen))
        meta = _pad([pool.positions(), pool.lengths, seen], rows)  # one host -> device copy
        meta = meta.to(pool.device, non_blocking=True)
        ids = torch.zeros(rows, dtype=torch.long, device=pool.device)
        ids[:n] = token_ids.to(pool.device)
        if self.use_graphs:
            logits = self._graph_step(rows, window, ids, meta)
        else:
            kv = pool.k[:, :rows, :, :window], pool.v[:, :rows, :, :window]
            logits = self.forward_fn(ids, meta[0], meta[1], meta[2], *kv)
        pool.advance()
        return logits[:n]

    def _window(self, longest: int) -> int:
        """Keys the step reads per slot: exactly the longest sequence's eagerly, a bucket when captured."""
        if not self.bucketed:
            return longest
        return min(self.pool.tokens, pow2_at_least(max(longest, TOKEN_ROUND)))

    # -- CUDA graphs ----------------------------------------------------------------------------------------
    def _graph_step(self, rows: int, window: int, ids: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        if self._graph_generation != self.pool.generation:  # the pool's buffers moved: graphs are stale
            self._graphs.clear()
            self._graph_generation = self.pool.generation
        graph = self._graphs.get((rows, window))
        if graph is not None:
            return graph.replay(ids, meta)
        try:
            if self._graph_memory is None:
                self._graph_memory = torch.cuda.graph_pool_handle()
            graph = _CapturedStep(self, rows, window)
            logits = graph.capture(ids, meta)
        except Exception:  # noqa: BLE001 - the eager step computes the same; keep serving
            log.warning("CUDA graph capture failed; decoding eagerly from now on", exc_info=True)
            self.use_graphs = False
            kv = self.pool.k[:, :rows, :, :window], self.pool.v[:, :rows, :, :window]
            return self.forward_fn(ids, meta[0], meta[1], meta[2], *kv)
        self._graphs[(rows, window)] = graph
        return logits


class _CapturedStep:
    """One CUDA graph of the step for `rows` rows over `window` keys, with its static input buffers."""

    def __init__(self, runner: DecodeRunner, rows: int, window: int) -> None:
        pool = runner.pool
        self.runner = runner
        self.ids = torch.zeros(rows, dtype=torch.long, device=pool.device)
        self.meta = torch.zeros(3, rows, dtype=torch.long, device=pool.device)
        self.kv = pool.k[:, :rows, :, :window], pool.v[:, :rows, :, :window]
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None

    def _run(self) -> torch.Tensor:
        return self.runner.forward_fn(self.ids, self.meta[0], self.meta[1], self.meta[2], *self.kv)

    def capture(self, ids: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """This step run eagerly (its result), then captured: the capture writes the same K/V again."""
        self.ids.copy_(ids)
        self.meta.copy_(meta)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._run()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.runner._graph_memory):
            self.logits = self._run()
        return logits

    def replay(self, ids: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.meta.copy_(meta)
        self.graph.replay()
        return self.logits.clone()  # the graph's output buffer is overwritten by the next replay


def _pad(columns: list[list[int]], rows: int) -> torch.Tensor:
    """Host lists -> one int64 tensor [len(columns), rows]; rows past the batch see one key at index 0
    (dummies writing into free slots; a row that sees no key would make NaNs)."""
    out = torch.zeros(len(columns), rows, dtype=torch.long)
    for i, column in enumerate(columns):
        out[i, : len(column)] = torch.tensor(column, dtype=torch.long)
    out[len(columns) - 1, len(columns[-1]):] = 1  # `seen` of the dummy rows
    return out
