"""`kvfuse bench gpu`: the worker at the shape and dtype users deploy, on the device they deploy it on.

An 8B-class Llama-3.1 shape (32 layers, hidden 4096, 32 heads, 8 KV heads, llama3 RoPE scaling) is built
from its config with random weights in the compute dtype: nothing can be downloaded on a GPU host, and
the arithmetic and memory traffic of a prefill or a decode step do not depend on the weights' values.
The prompt is the usual RAG shape: the chat template's prefix, chunks of `--chunk-tokens` tokens each
cached alone (every chunk its own document), the question. Token ids are drawn at random from the
tokenizer's vocabulary, so the selections are as arbitrary as the weights; fidelity is measured by
`kvfuse bench fidelity` on a real model.

Per context and method it measures, with the chunks' KV written to a real LMDB store first:
- TTFT from the RAM tier: the chunks' KV decoded into (page-locked, on CUDA) host memory, as the
  worker's hot tier holds it; the copy to the device is inside the prefill (kv_loading.LayerLoader);
- TTFT from LMDB: the store read and decode added (`read_s`);
- TTFT with the KV already on the device (handed out by the store's device tier: no copy at all);
- TTFT with the recomputed rows through the dense [rows, keys] mask instead of FlexAttention (on CUDA:
  the ratio says what the sparse path gains), and the first, untimed prefill of each shape (compiles);
- the split of one more run, each phase synchronised: assemble, the full layers and selection
  (a probe or check layers), recompute, and the KV copy with the part of it the compute waited on;
- peak device memory above the weights during the prefill; decode tokens/s after the prefill;
- then the engine core's decode steps (its KV memory and runner, CUDA graphs on a GPU) over copies of
  one fused cache of the smallest context at 1, 8 and 32 streams.

Every figure is also given as a ratio to vanilla (a full prefill, SDPA) from the same run. Results:
docs/results/gpu/ (the JSON names the device). A tiny shape runs the same code on the CPU (tests).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B's config (the public one), weights random.
    "llama8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # The same code on a CPU in seconds (tests).
    "tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=16384, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 1024},
    ),
}
DEFAULT_METHODS = ("anchor", "cacheblend", "a3", "prophetkv", "epic", "pie", "full_reuse")
QUESTION = "Which of the documents above names the code word, and what is it?"


def build_engine(shape: str, tokenizer_path: str, device: str, dtype: str, seed: int = 0):
    """A FusionEngine over a random-weight model of `shape` (SHAPES) and a real tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvfuse.fusion import FusionEngine
    from kvfuse.fusion.model.loading import torch_dtype

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype), attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return FusionEngine(model, tokenizer, dtype=dtype)


class Bench:
    def __init__(self, engine, *, kv_dtype: str, chunk_tokens: int, repeats: int, decode_tokens: int,
                 ratio: float, seed: int, lmdb_repeats: int = 1, profile_method: str = "anchor",
                 profile_context: int = 1 << 62) -> None:
        import torch

        self.torch = torch
        self.engine = engine
        self.kv_dtype = kv_dtype
        self.chunk_tokens = chunk_tokens
        self.repeats = repeats
        self.lmdb_repeats = lmdb_repeats
        self.profile_method, self.profile_context = profile_method, profile_context
        self.profiles: dict[str, str] = {}  # "method@context": the profiler's table of the prefill
        self.decode_tokens = decode_tokens
        self.ratio = ratio
        self.gen = torch.Generator().manual_seed(seed)
        self.cuda = engine.device.type == "cuda"
        self.vocab = min(len(engine.tokenizer), engine.model.config.vocab_size)

    # -- timing helpers -------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.engine.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def options(self, method: str):
        from kvfuse.fusion import FusionOptions

        return FusionOptions(method=method, recompute_ratio=self.ratio)

    # -- the prompt and its store ------------------------------------------------------------------------
    def prompt(self, context_tokens: int):
        """(prefix ChunkKV, chunk token ids, question ids): random ids of the tokenizer's vocabulary."""
        prefix_ids, question_ids = self.engine.prompt_parts(QUESTION, None)
        n = max(1, round(context_tokens / self.chunk_tokens))
        ids = self.torch.randint(0, self.vocab, (n, self.chunk_tokens), generator=self.gen)
        return prefix_ids, [row.tolist() for row in ids], question_ids

    def fill_store(self, root: Path, prefix_ids: list[int], chunk_ids: list[list[int]]):
        """Precompute every chunk alone (and the prefix), write them to a fresh KVStore; returns
        (store, keys, ingest seconds)."""
        from kvfuse.config import Settings
        from kvfuse.store import KVStore

        e = self.engine
        per_token = 2 * e.num_layers * e.num_kv_heads * e.head_dim * 4
        total = (len(prefix_ids) + sum(map(len, chunk_ids))) * per_token
        base = Settings()
        settings = base.model_copy(update={
            "data_dir": root, "redis_url": "",
            "model": base.model.model_copy(update={"device": str(e.device)}),
            "store": base.store.model_copy(update={"hot_tier_mb": 0, "kv_dtype": self.kv_dtype,
                                                   "lmdb_map_size_mb": 256 + 2 * total // 2**20}),
        })
        store = KVStore.open(settings)
        t = self.now()
        keys = []
        for ids in [prefix_ids, *chunk_ids]:
            kv = e.precompute([ids])[0]
            key, _ = store.put_kv(e.fingerprint, self.kv_dtype, ids, kv.k, kv.v)
            keys.append((key, ids))
        return store, keys, self.now() - t

    def read(self, store, keys) -> list:
        from kvfuse.fusion import ChunkKV

        out = []
        for key, ids in keys:
            k, v, _ = store.load_chunk(key)
            out.append(ChunkKV(list(ids), k, v))
        return out

    # -- one prefill -------------------------------------------------------------------------------------
    def prefill(self, method: str, prefix, chunks, question_ids, *, split: bool = False):
        """(ttft_s, FusedPrefill, peak bytes above what was allocated before)."""
        torch, e = self.torch, self.engine
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(e.device)
            before = torch.cuda.memory_allocated(e.device)
        e.sync_timings = split
        try:
            t = self.now()
            fused = e.fuse(prefix, chunks, question_ids, self.options(method), max_tokens=self.decode_tokens)
            int(fused.logits.argmax())  # the first token, on the host
            ttft = time.perf_counter() - t
        finally:
            e.sync_timings = False
        peak = torch.cuda.max_memory_allocated(e.device) - before if self.cuda else 0
        return ttft, fused, peak

    def device_tier(self, chunks: list) -> list:
        """The chunks as the store's device tier hands them out: put in a HotTier on the engine's device
        (the stored dtype, in device memory) and read back."""
        from kvfuse.fusion import ChunkKV
        from kvfuse.kvblob import ChunkEntry
        from kvfuse.store.hot_tier import HotTier

        tier = HotTier(1 << 62, device=str(self.engine.device), name="device")
        out = []
        for i, c in enumerate(chunks):
            tier.put(str(i), ChunkEntry(c.k, c.v, None))  # no header: this entry is never packed
            k, v, _ = tier.get(str(i))
            out.append(ChunkKV(c.token_ids, k, v))
        return out

    def median_ttft(self, method: str, prefix, chunks, question_ids) -> float:
        return statistics.median(self.prefill(method, prefix, chunks, question_ids)[0] for _ in range(self.repeats))

    def dense_mask_ttft(self, method: str, prefix, chunks, question_ids) -> float | None:
        """TTFT with the recomputed rows attended through one dense [rows, keys] mask (the path before
        FlexAttention), where the engine would take FlexAttention; None where it would not."""
        attention = self.engine.tf.attention
        if attention.flex is None or method == "vanilla":
            return None
        flex, attention.flex = attention.flex, None
        try:
            self.prefill(method, prefix, chunks, question_ids)  # warm-up
            return self.median_ttft(method, prefix, chunks, question_ids)
        finally:
            attention.flex = flex

    def profile(self, method: str, prefix, chunks, question_ids, rows: int = 30) -> str:
        """One prefill under the torch profiler: its ops by device time (kernels, copies) and host time."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=acts) as prof:
            self.prefill(method, prefix, chunks, question_ids)
        key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=rows)

    def decode_rate(self, fused: Any) -> float:
        """Tokens per second of batched greedy steps of one stream on an engine core (kvfuse/bench/streams.py),
        over the room `fused.cache` has past its prompt (the first decode step untimed)."""
        from kvfuse.bench.streams import core_streams, time_steps

        core = core_streams(self.engine, fused, 1)
        times = time_steps(core, max(1, fused.cache.capacity - fused.cache.length - 2), warmup=1)
        return len(times) / sum(times)

    def context(self, context_tokens: int, methods: list[str], progress) -> list[dict[str, Any]]:
        torch, e = self.torch, self.engine
        prefix_ids, chunk_ids, question_ids = self.prompt(context_tokens)
        rows = []
        with tempfile.TemporaryDirectory(prefix="kvfuse-gpu-") as tmp:
            store, keys, ingest_s = self.fill_store(Path(tmp), prefix_ids, chunk_ids)
            hot = self.read(store, keys)  # what the RAM tier holds (page-locked on a CUDA worker)
            prefix, chunks = hot[0], hot[1:]
            n_ctx = sum(map(len, chunk_ids))
            kv_mb = sum(c.k.numel() * c.k.element_size() * 2 for c in chunks) / 2**20
            on_device = self.device_tier(hot)  # what the device tier (store.device_tier_mb) hands out
            for method in ["vanilla", *methods]:
                progress(f"{n_ctx} tokens {method}")
                first = self.prefill(method, prefix, chunks, question_ids)[0]  # warm-up: kernels, compiles
                runs = [self.prefill(method, prefix, chunks, question_ids) for _ in range(self.repeats)]
                ttft = statistics.median(r[0] for r in runs)
                fused, peak = runs[-1][1], max(r[2] for r in runs)
                decode = self.decode_rate(fused)
                del runs, fused
                ttft_device = self.median_ttft(method, on_device[0], on_device[1:], question_ids)
                ttft_dense = self.dense_mask_ttft(method, prefix, chunks, question_ids)
                cold, reads = [], []
                if method != "vanilla":  # vanilla reads no KV
                    for _ in range(self.lmdb_repeats):
                        t = self.now()
                        loaded = self.read(store, keys)
                        reads.append(time.perf_counter() - t)
                        cold.append(reads[-1] + self.prefill(method, loaded[0], loaded[1:], question_ids)[0])
                        del loaded
                split_ttft, split, _ = self.prefill(method, prefix, chunks, question_ids, split=True)
                if n_ctx >= self.profile_context and method in ("vanilla", self.profile_method):
                    self.profiles[f"{method}@{n_ctx}"] = self.profile(method, prefix, chunks, question_ids)
                rows.append({
                    "method": method, "ratio": None if method == "vanilla" else self.ratio,
                    "context_tokens": n_ctx, "chunks": len(chunks), "chunk_kv_mb": kv_mb,
                    "ttft_s": ttft, "ttft_lmdb_s": statistics.median(cold) if cold else ttft,
                    "ttft_device_kv_s": ttft_device, "ttft_dense_mask_s": ttft_dense, "first_ttft_s": first,
                    "read_s": statistics.median(reads) if reads else 0.0,
                    "split": {"ttft_s": split_ttft, **split.timings},
                    "recomputed_tokens": int(split.stats.get("recomputed_tokens", n_ctx)),
                    "sparse_attention": e.tf.attention.flex is not None,  # False: FlexAttention off or failed
                    "peak_prefill_mb": peak / 2**20, "decode_tok_s": decode, "ingest_s": ingest_s,
                })
                del split
                if self.cuda:
                    torch.cuda.empty_cache()
            store.close()
        van = rows[0]
        for row in rows:
            for key in ("ttft_s", "ttft_lmdb_s", "ttft_device_kv_s", "peak_prefill_mb", "decode_tok_s"):
                row[f"{key}_vs_vanilla"] = row[key] / van[key] if van[key] else None
            row["ttft_s_vs_dense_mask"] = row["ttft_s"] / row["ttft_dense_mask_s"] if row["ttft_dense_mask_s"] else None
            sp = row["split"]
            row["kv_copy_hidden_share"] = (1 - sp["kv_copy_exposed_s"] / sp["kv_copy_s"]
                                           if sp.get("kv_copy_s") else None)
        return rows

    def streams(self, context_tokens: int, counts: list[int], steps: int) -> list[dict[str, Any]]:
        """Steps of an engine core decoding `counts` streams in its KV memory (kvfuse/bench/streams.py: one
        extent per stream, the static step captured as CUDA graphs on a GPU, the tokens chosen on the
        device), each stream holding a copy of one fused cache of `context_tokens`."""
        from kvfuse.bench.decode import WARMUP_STEPS
        from kvfuse.bench.streams import core_streams, time_steps
        from kvfuse.fusion import ChunkKV

        prefix_ids, chunk_ids, question_ids = self.prompt(context_tokens)
        chunks = [ChunkKV(ids) for ids in chunk_ids]
        fused = self.engine.fuse(ChunkKV(prefix_ids), chunks, question_ids, self.options("vanilla"),
                                 max_tokens=WARMUP_STEPS + steps + 1)
        out = []
        # The baseline warm before it is timed: a first timed pass in the process pays once for what every
        # later one reuses (allocator pools, kernel selection, lazy initialisation), which would flatter
        # every ratio to it. One untimed pass of the first count, on its own copies, is thrown away.
        warm = core_streams(self.engine, fused, counts[0], static=self.cuda)
        time_steps(warm, steps, warmup=WARMUP_STEPS)
        del warm
        for b in counts:
            core = core_streams(self.engine, fused, b, static=self.cuda)
            self.sync()
            times = time_steps(core, steps, warmup=WARMUP_STEPS)
            step_s, best_s = statistics.median(times), min(times)
            out.append({"streams": b, "context_tokens": fused.cache.length, "tokens_per_s": b / step_s,
                        "step_ms": step_s * 1e3, "best_step_ms": best_s * 1e3, "best_tokens_per_s": b / best_s,
                        "warmup_s": core.runner.warmup_s, "path": "static" if core.runner.static else "eager"})
            del core
            if self.cuda:
                self.torch.cuda.empty_cache()
        # vs_one_stream: the medians' ratio (sustained throughput, what the table shows); vs_one_stream_best:
        # the fastest steps' ratio, which noise (only ever added time) moves least; step_noise: how far the
        # baseline's median step is above its fastest, the run's own measure of that noise
        base, best = out[0]["tokens_per_s"], out[0]["best_tokens_per_s"]
        for row in out:
            row["vs_one_stream"] = row["tokens_per_s"] / base
            row["vs_one_stream_best"] = row["best_tokens_per_s"] / best
        out[0]["step_noise"] = out[0]["step_ms"] / out[0]["best_step_ms"] - 1.0
        return out


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from kvfuse.bench.gpu_report import write_json
    from kvfuse.bench.machine import command_line, machine_info

    engine = build_engine(args.shape, args.tokenizer, args.device, args.dtype, args.seed)
    bench = Bench(engine, kv_dtype=args.kv_dtype, chunk_tokens=args.chunk_tokens, repeats=args.repeats,
                  decode_tokens=args.decode_tokens, ratio=args.ratio, seed=args.seed,
                  lmdb_repeats=args.lmdb_repeats, profile_method=args.methods[0] if args.methods else "vanilla",
                  profile_context=args.profile_context or 1 << 62)
    device = torch.cuda.get_device_name(engine.device) if bench.cuda else "cpu"
    payload: dict[str, Any] = {
        "kind": "gpu", "command": command_line("kvfuse bench gpu", args.parser, args),
        "machine": {**machine_info(), "device": device}, "partial": True,
        "params": {k: getattr(args, k) for k in ("shape", "dtype", "kv_dtype", "contexts", "methods", "ratio",
                                                  "repeats", "lmdb_repeats", "chunk_tokens", "decode_tokens", "streams")},
        "rows": [], "streams": [],
    }
    out = Path(args.json)
    bar = tqdm(total=len(args.contexts) * (1 + len(args.methods)), file=sys.stderr, unit="method")

    def progress(what: str) -> None:
        bar.set_description(what)
        bar.update(1)

    try:
        for i, ctx in enumerate(sorted(args.contexts)):
            payload["rows"] += bench.context(ctx, args.methods, progress)
            payload["profiles"] = bench.profiles
            if i == 0 and args.streams:  # before the longer contexts: a run cut short keeps the streams
                payload["streams"] = bench.streams(ctx, args.streams, args.stream_steps)
            write_json(payload, out)  # a context at a time: a run cut short keeps what it measured
    finally:
        bar.close()
    payload["partial"] = False
    write_json(payload, out)
    from kvfuse.bench.gpu_report import render

    print(render(payload, out))
    from kvfuse.bench.gpu_report import summary

    print(summary(payload))  # last: what the targets read
    return 0


def register(bsub) -> None:
    from kvfuse.bench.args import csv_list

    p = bsub.add_parser("gpu", help="the worker on a GPU at an 8B shape: TTFT split, copy overlap, decode, memory")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b", help="model shape (random weights)")
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (the default model's will do)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--kv-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="the stored chunks' dtype")
    p.add_argument("--contexts", type=csv_list(int), default=[4096, 8192, 16384, 32768])
    p.add_argument("--methods", type=csv_list(str), default=list(DEFAULT_METHODS),
                   help="fusion methods beside vanilla (always run)")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per figure (median; a warm-up first)")
    p.add_argument("--lmdb-repeats", type=int, default=1, help="timed runs that read the KV from LMDB")
    p.add_argument("--profile-context", type=int, default=0,
                   help="profile one prefill of vanilla and the first method at the first context of at least "
                        "this many tokens (0: none)")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64, help="decode steps timed after each prefill")
    p.add_argument("--streams", type=csv_list(int), default=[1, 8, 32], help="batched decode stream counts")
    p.add_argument("--stream-steps", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="docs/results/gpu/gpu.json", help="result file (.md and .png beside it)")
    p.set_defaults(func=run, parser=p)
