"""kvfuse: RAG serving over reusable per-chunk KV caches, fused by selective recomputation."""

__version__ = "0.1.0"
