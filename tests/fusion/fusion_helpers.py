"""Helpers of the fusion tests (prompt building, HF reference computations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvfuse.fusion import ChunkKV, FusionEngine


def tiny_llama_engine(tokenizer, max_positions: int = 4096) -> FusionEngine:
    """A two-layer random-weight Llama (seed 0) over the default tokenizer: the engine tests' small model."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    return FusionEngine(LlamaForCausalLM(config).eval(), tokenizer, dtype="float32")


@dataclass
class Prompt:
    prefix: ChunkKV
    chunks: list[ChunkKV]
    question_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prefix.token_ids + [t for c in self.chunks for t in c.token_ids] + self.question_ids


def make_prompt(engine: FusionEngine, text: str, question: str, chunk_tokens: list[int]) -> Prompt:
    prefix_ids, question_ids = engine.prompt_parts(question, "Answer briefly.")
    ids = engine.tokenize(text)
    pieces, start = [], 0
    for n in chunk_tokens:
        pieces.append(ids[start : start + n])
        start += n
    kvs = engine.precompute([prefix_ids, *pieces])
    return Prompt(kvs[0], kvs[1:], question_ids)


def hf_forward(engine: FusionEngine, ids: list[int], **kwargs):
    with torch.inference_mode():
        return engine.model(torch.tensor([ids], device=engine.device), use_cache=True, **kwargs)


def to_dynamic_cache(k: torch.Tensor, v: torch.Tensor) -> DynamicCache:
    """An HF cache holding [L, Hkv, n, D] tensors (a copy)."""
    cache = DynamicCache()
    for layer in range(k.shape[0]):
        cache.update(k[layer].unsqueeze(0).clone(), v[layer].unsqueeze(0).clone(), layer)
    return cache
