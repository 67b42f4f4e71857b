"""Chunking with the LLM's tokenizer, chunk embeddings, and the persistent FAISS index over them."""

from kvfuse.retriever.chunker import Chunk, Chunker
from kvfuse.retriever.embedder import Embedder
from kvfuse.retriever.errors import EmbedderError, EmptyDocumentError, FilterTypeError, IndexLoadError
from kvfuse.retriever.index import VectorIndex
from kvfuse.retriever.results import DriftReport, Hit

__all__ = [
    "Chunk",
    "Chunker",
    "DriftReport",
    "Embedder",
    "EmbedderError",
    "EmptyDocumentError",
    "FilterTypeError",
    "Hit",
    "IndexLoadError",
    "VectorIndex",
]
