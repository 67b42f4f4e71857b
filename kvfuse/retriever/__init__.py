"""Chunking with the LLM's tokenizer, chunk embeddings, and the persistent FAISS index over them."""

from kvfuse.retriever.chunker import Chunk, Chunker
from kvfuse.retriever.embedder import Embedder
from kvfuse.retriever.errors import EmbedderError, EmptyDocumentError, IndexLoadError
from kvfuse.retriever.index import DriftReport, Hit, VectorIndex

__all__ = [
    "Chunk",
    "Chunker",
    "DriftReport",
    "Embedder",
    "EmbedderError",
    "EmptyDocumentError",
    "Hit",
    "IndexLoadError",
    "VectorIndex",
]
