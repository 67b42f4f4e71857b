"""Sentence embeddings for chunks and questions (small model, runs in the API process on CPU)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvfuse.retriever.errors import EmbedderError

log = logging.getLogger(__name__)

# Inputs of at most this many model windows (a question, a short chunk) run on one torch thread. Such
# small work gains little from a second thread, and when the CPU is busy (the worker generating beside
# the API process) every parallel region waits for a descheduled thread, which costs far more than the
# work itself. `kvfuse bench retriever` measures question embedding latency.
SINGLE_THREAD_MAX_WINDOWS = 2


class Embedder:
    """A sentence-transformers model loaded from local files only (kvfuse never reaches a model hub).

    A text longer than the model's window (all-MiniLM-L6-v2: 256 word pieces, about half of a default
    512-token chunk) would be silently truncated, leaving the end of the chunk unsearchable. Such a text
    is split into consecutive windows and its embedding is the token-weighted mean of the windows'
    embeddings, normalized again.
    """

    def __init__(self, name_or_path: str, *, device: str = "cpu", batch_size: int = 32):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as err:  # pragma: no cover - a broken install
            raise EmbedderError(f"sentence-transformers is not installed: {err}") from err
        try:
            # local_files_only: a path is read as is; a hub id only from the local cache, never fetched.
            self.model: Any = SentenceTransformer(name_or_path, device=device, local_files_only=True)
        except (OSError, ValueError) as err:
            raise EmbedderError(
                f"cannot load the embedding model {name_or_path!r} from local files: {err}. "
                "Set model.embedder to a local sentence-transformers directory, or 'default'."
            ) from err
        self.name_or_path = name_or_path
        self.batch_size = batch_size
        # The API embeds questions from a thread pool while ingestion embeds chunks. A fast tokenizer
        # called concurrently with padding/truncation settings fails ("Already borrowed"), and the CPU
        # is saturated by one call anyway: calls take turns, a question's first (_Turns).
        self._turns = _Turns()
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim: int = int(get_dim())
        self.max_seq_length: int = int(self.model.max_seq_length)
        self.fingerprint: str = _fingerprint(self.model, self.dim)
        tok = self.model.tokenizer
        self._tokenizer = tok if getattr(tok, "is_fast", False) else None
        if self._tokenizer is None:
            log.warning("embedder tokenizer has no offsets: texts longer than %d tokens are truncated",
                        self.max_seq_length)

    def embed(self, texts: list[str], *, background: bool = False) -> np.ndarray:
        """float32 [len(texts), dim], each row L2-normalized. `background` (ingestion's chunks, the inputs of
        /v1/embeddings): embedded a batch per turn, every question that waits meanwhile going first, so a
        flood of them delays a query's retrieval by one batch at most, not by every text queued before it."""
        return self.embed_counted(texts, background=background)[0]

    def embed_counted(self, texts: list[str], *, background: bool = False) -> tuple[np.ndarray, int]:
        """`embed(texts)` and the number of word pieces the texts hold (special tokens not counted): the
        usage /v1/embeddings reports. Counted in the embedder's turn, as the tokenizer may not run
        concurrently."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32), 0
        if background and len(texts) > self.batch_size:
            parts = [self.embed_counted(texts[i : i + self.batch_size], background=True)
                     for i in range(0, len(texts), self.batch_size)]
            return np.concatenate([v for v, _ in parts]), sum(n for _, n in parts)
        with self._turns.turn(urgent=not background):
            pieces, owner, weight, tokens = self._windows(texts)
            with _torch_threads(1 if len(pieces) <= SINGLE_THREAD_MAX_WINDOWS else None):
                vecs = self.model.encode(
                    pieces,
                    batch_size=self.batch_size,
                    convert_to_numpy=True,
                    normalize_embeddings=True,
                    show_progress_bar=False,
                ).astype(np.float32, copy=False)
        if len(pieces) == len(texts):
            return np.ascontiguousarray(vecs), tokens
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        np.add.at(out, owner, vecs * weight[:, None])
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12), tokens

    def _windows(self, texts: list[str]) -> tuple[list[str], np.ndarray, np.ndarray, int]:
        """Split texts longer than the model window at token offsets: (pieces, owning text, weights, the
        texts' tokens)."""
        if self._tokenizer is None:
            counted = self.model.tokenizer(texts, add_special_tokens=False)["input_ids"]
            return texts, np.arange(len(texts)), np.ones(len(texts), dtype=np.float32), sum(map(len, counted))
        window = max(1, self.max_seq_length - 2)  # room for [CLS] and [SEP]
        enc = self._tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        pieces: list[str] = []
        owner: list[int] = []
        weight: list[float] = []
        tokens = 0
        for i, (text, offsets) in enumerate(zip(texts, enc["offset_mapping"], strict=True)):
            n = len(offsets)
            tokens += n
            if n <= window:
                pieces.append(text)
                owner.append(i)
                weight.append(float(max(n, 1)))
                continue
            for a in range(0, n, window):
                b = min(a + window, n)
                start = 0 if a == 0 else offsets[a][0]
                end = len(text) if b == n else offsets[b][0]
                pieces.append(text[start:end])
                owner.append(i)
                weight.append(float(b - a))
        return pieces, np.asarray(owner), np.asarray(weight, dtype=np.float32), tokens


class _Turns:
    """A lock whose urgent takers (questions) go before the others (ingestion's batches): a waiting
    background taker lets every urgent one that waits go first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._urgent_waiting = 0

    @contextlib.contextmanager
    def turn(self, *, urgent: bool) -> Iterator[None]:
        with self._cond:
            self._urgent_waiting += urgent
            try:
                while self._held or (not urgent and self._urgent_waiting):
                    self._cond.wait()
            finally:
                self._urgent_waiting -= urgent
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()


def _fingerprint(model: Any, dim: int) -> str:
    """Identity of the weights (not of their path): names, shapes and the leading bytes of every tensor.
    The vector index records it, so vectors of another model are never searched with this one's."""
    h = hashlib.sha256(f"dim={dim};max_seq_length={model.max_seq_length}".encode())
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu").contiguous().reshape(-1)[:1024]
        h.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        h.update(t.float().numpy().tobytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """torch intra-op threads for this block (None: unchanged); restored after, and the setting is held
    by the calling OS thread, so other threads keep theirs."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
