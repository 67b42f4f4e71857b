"""The worker process: owns the LLM (FusionEngine) and writes/reads chunk KV in the store itself.

It runs in its own OS process (spawn), so a crash or a hung kernel never takes the API down, and the API
process never imports the model. Messages over the pipe carry only chunk keys, token ids and options:
KV bytes never cross it (LMDB is memory-mapped and both processes open it).

Protocol (tuples of plain values):
  API -> worker  ("precompute", job_id, {"chunks": [[ids]]})
                 ("query", job_id, {question, system_prompt, explicit, fusion, generation,
                                    chunks: [{key, token_ids, score}]})  (built by QueryService.start)
                 ("shutdown", 0, {})
  worker -> API  ("ready", 0, info) once loaded, or ("fatal", 0, {"message"}) and exit
                 ("plan", job_id, {...}) ("delta", job_id, {"text"}) ("result", job_id, {...})
                 ("done", job_id, {...}) ("error", job_id, {"kind", "message", ...})
One job runs at a time; the API sends the next only after the previous one's final message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import traceback
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from kvfuse.config import Settings

log = logging.getLogger("kvfuse.worker")

# Error kinds the API maps to HTTP statuses (see supervisor.WorkerJobError).
ERR_CONTEXT_OVERFLOW = "context_overflow"   # explicit documents do not fit -> 400
ERR_MAX_TOKENS = "max_tokens_overflow"      # prompt + max_tokens alone exceed the context -> 400
ERR_INVALID = "invalid_request"             # the engine refused the options -> 422
ERR_INTERNAL = "internal"                   # anything else -> 500

_PREFIX_CACHE_ENTRIES = 8  # distinct system prompts kept decoded in the worker


def kv_nbytes(num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Payload size of a chunk's K and V at rest (used when a chunk is already stored)."""
    itemsize = 4 if kv_dtype == "float32" else 2
    return 2 * num_layers * num_kv_heads * num_tokens * head_dim * itemsize


class Worker:
    def __init__(self, settings: Settings, conn: Connection, cancel_flag: Any) -> None:
        from kvfuse.fusion import FusionEngine
        from kvfuse.store import KVStore

        self.settings = settings
        self.conn = conn
        self.cancel_flag = cancel_flag
        self.engine = FusionEngine.from_settings(settings)
        self.store = KVStore.open(settings)
        self.kv_dtype = settings.store.kv_dtype
        self.max_context = self.engine.max_context_tokens  # the model's limit, lowered by the setting
        self._prefixes: OrderedDict[str, Any] = OrderedDict()

    # -- helpers -------------------------------------------------------------------------------------------
    def send(self, kind: str, job_id: int, payload: dict) -> None:
        self.conn.send((kind, job_id, payload))

    def info(self) -> dict:
        from kvfuse.fusion import available_methods

        e = self.engine
        return {"pid": os.getpid(), "fingerprint": e.fingerprint, "max_context_tokens": self.max_context,
                "num_layers": e.num_layers, "num_kv_heads": e.num_kv_heads, "head_dim": e.head_dim,
                "methods": list(available_methods()), "kv_dtype": self.kv_dtype}

    def key_of(self, token_ids: list[int]) -> str:
        from kvfuse import kvblob

        return kvblob.chunk_key(self.engine.fingerprint, self.kv_dtype, token_ids)

    def compute_and_store(self, chunks: list[list[int]]) -> list[tuple[str, int]]:
        """Precompute, encode and store chunks; returns (key, blob bytes) each."""
        from kvfuse import kvblob

        out = []
        for ckv in self.engine.precompute(chunks):
            blob = kvblob.encode(ckv.k, ckv.v, model_fingerprint=self.engine.fingerprint,
                                 token_ids=ckv.token_ids, dtype=self.kv_dtype)
            key = self.key_of(ckv.token_ids)
            self.store.put_chunk(key, blob)
            out.append((key, len(blob)))
        return out

    def load_or_rebuild(self, key: str, token_ids: list[int], *, write_back: bool) -> tuple[Any, bool]:
        """A chunk's ChunkKV from the store; recomputed from its token ids on a miss or a corrupt blob.

        A miss is not written back by default: the owning document may have been deleted meanwhile, and
        an unreferenced blob would leak. A corrupt blob is replaced (its document still refers to it)."""
        from kvfuse import kvblob
        from kvfuse.fusion import ChunkKV

        corrupt = False
        try:
            hit = self.store.load_chunk(key)
        except kvblob.CorruptBlobError as err:
            log.warning("chunk %s is corrupt (%s): rebuilding it from its tokens", key[:16], err)
            hit, corrupt = None, True
        if hit is not None:
            k, v, header = hit
            if header.num_tokens == len(token_ids) and header.token_hash == kvblob.token_hash(token_ids):
                return ChunkKV(token_ids=token_ids, k=k, v=v), False
            log.warning("chunk %s does not match its tokens: rebuilding it", key[:16])
            corrupt = True
        ckv = self.engine.precompute([token_ids])[0]
        if corrupt or write_back:
            blob = kvblob.encode(ckv.k, ckv.v, model_fingerprint=self.engine.fingerprint, token_ids=token_ids,
                                 dtype=self.kv_dtype)
            self.store.put_chunk(key, blob)
        return ckv, True

    def prefix_kv(self, prefix_ids: list[int]) -> Any:
        """The system prompt's KV, cached by content like any chunk (kept decoded in this process)."""
        key = self.key_of(prefix_ids)
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            return self._prefixes[key]
        ckv = self.engine.precompute([prefix_ids])[0]
        self._prefixes[key] = ckv
        while len(self._prefixes) > _PREFIX_CACHE_ENTRIES:
            self._prefixes.popitem(last=False)
        return ckv

    # -- jobs ----------------------------------------------------------------------------------------------
    def precompute(self, job_id: int, p: dict) -> None:
        keys, nbytes, computed = [], [], 0
        todo: list[list[int]] = []
        for ids in p["chunks"]:
            key = self.key_of(ids)
            keys.append(key)
            if self.store.has_chunk(key):
                # Content-addressed: an identical chunk (same model, dtype, tokens) is stored once.
                nbytes.append(kv_nbytes(len(ids), self.engine.num_layers, self.engine.num_kv_heads,
                                        self.engine.head_dim, self.kv_dtype))
            else:
                nbytes.append(-1)
                todo.append(ids)
        if todo:
            stored = dict(self.compute_and_store(todo))
            computed = len(todo)
            nbytes = [stored[k] if n < 0 else n for k, n in zip(keys, nbytes, strict=True)]
        self.send("done", job_id, {"keys": keys, "nbytes": nbytes, "computed": computed})

    def query(self, job_id: int, p: dict) -> None:
        from kvfuse.fusion import ChunkKV, FusionOptions, GenerationOptions
        from kvfuse.fusion.methods import get_method

        prefix_ids, question_ids = self.engine.prompt_parts(p["question"], p["system_prompt"])
        max_tokens = p["generation"]["max_tokens"]
        fixed = len(prefix_ids) + len(question_ids) + max_tokens
        if fixed > self.max_context:
            self.send("error", job_id, {
                "kind": ERR_MAX_TOKENS, "excess_tokens": fixed - self.max_context,
                "message": f"the prompt ({len(prefix_ids) + len(question_ids)} tokens) plus max_tokens "
                           f"({max_tokens}) exceed the model context of {self.max_context} tokens by "
                           f"{fixed - self.max_context}"})
            return
        chunks = p["chunks"]
        budget = self.max_context - fixed
        kept = list(range(len(chunks)))
        dropped: list[int] = []
        total = sum(len(c["token_ids"]) for c in chunks)
        if total > budget:
            if p["explicit"]:
                self.send("error", job_id, {
                    "kind": ERR_CONTEXT_OVERFLOW, "excess_tokens": total - budget,
                    "message": f"the requested documents ({total} tokens) do not fit the model context: "
                               f"{total - budget} tokens too many beside the prompt and max_tokens "
                               f"({self.max_context} tokens in all)"})
                return
            # Retrieved chunks: drop the lowest-scored first until the rest fits.
            for i in sorted(kept, key=lambda i: chunks[i]["score"]):
                if total <= budget:
                    break
                dropped.append(i)
                total -= len(chunks[i]["token_ids"])
            kept = [i for i in kept if i not in set(dropped)]
        self.send("plan", job_id, {"kept": kept, "dropped": dropped, "context_tokens": total,
                                   "prefix_tokens": len(prefix_ids), "question_tokens": len(question_ids)})

        fusion = FusionOptions(**p["fusion"])
        t0 = time.perf_counter()
        rebuilt = 0
        loaded = []
        if get_method(fusion.method).full_prefill:  # prefills from the tokens: no stored KV to read
            loaded = [ChunkKV(chunks[i]["token_ids"]) for i in kept]
            prefix = ChunkKV(prefix_ids)
        else:
            for i in kept:
                ckv, was_rebuilt = self.load_or_rebuild(chunks[i]["key"], chunks[i]["token_ids"],
                                                        write_back=False)
                loaded.append(ckv)
                rebuilt += was_rebuilt
            prefix = self.prefix_kv(prefix_ids)
        kv_load_s = time.perf_counter() - t0

        def cancelled() -> bool:
            return self.cancel_flag.value == job_id

        gen = GenerationOptions(**p["generation"])
        result = None
        for ev in self.engine.generate(prefix, loaded, question_ids, fusion, gen, cancel=cancelled):
            if hasattr(ev, "finish_reason"):
                result = ev
            elif ev.text:
                self.send("delta", job_id, {"text": ev.text})
        assert result is not None, "generate() ended without a GenerationResult"
        self.send("result", job_id, {
            "text": result.text, "finish_reason": result.finish_reason, "usage": dict(result.usage),
            "timings": {**{k: float(v) for k, v in result.timings.items()}, "kv_load_s": kv_load_s},
            "rebuilt_chunks": rebuilt})

    def serve(self) -> None:
        self.send("ready", 0, self.info())
        while True:
            try:
                kind, job_id, payload = self.conn.recv()
            except EOFError:
                return  # the API went away
            if kind == "shutdown":
                return
            try:
                if kind == "precompute":
                    self.precompute(job_id, payload)
                elif kind == "query":
                    self.query(job_id, payload)
                else:
                    self.send("error", job_id, {"kind": ERR_INTERNAL, "message": f"unknown job kind {kind!r}"})
            except (ValueError, TypeError) as err:
                # UnknownMethodError / ContextOverflowError are ValueErrors: the request was not servable.
                log.warning("job %d refused: %s", job_id, err)
                excess = getattr(err, "excess_tokens", None)
                kind_ = ERR_CONTEXT_OVERFLOW if excess is not None else ERR_INVALID
                self.send("error", job_id, {"kind": kind_, "message": str(err), "excess_tokens": excess})
            except Exception as err:  # noqa: BLE001 - a failed job must not kill the worker
                log.error("job %d failed: %s", job_id, traceback.format_exc())
                self.send("error", job_id, {"kind": ERR_INTERNAL, "message": f"{type(err).__name__}: {err}"})


def worker_main(settings: Settings, conn: Connection, cancel_flag: Any) -> None:
    """Entry point of the worker process."""
    # Ctrl-C in a terminal reaches the whole process group: the API decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s")
    try:
        worker = Worker(settings, conn, cancel_flag)
    except Exception as err:  # noqa: BLE001 - reported to the API, which decides to retry
        log.error("worker failed to start: %s", traceback.format_exc())
        with contextlib.suppress(OSError):
            conn.send(("fatal", 0, {"message": f"{type(err).__name__}: {err}"}))
        return
    try:
        worker.serve()
    finally:
        worker.store.close()
