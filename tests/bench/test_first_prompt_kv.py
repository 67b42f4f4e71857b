"""`kvfuse bench fidelity --chunk-kv first-prompt` (option (b) of docs/DESIGN.md, "KV when it pays"):
each chunk's KV is what the vanilla prefill of another prompt over the same chunks (the example's chunks
in reverse order) left for it. Pinned to the math with the real default model: reusing that KV in the
prompt it came from, with nothing recomputed (`pie`), is that prompt's vanilla prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def test_first_prompt_kv_is_the_reverse_prompts_vanilla_prefill(default_llm_path: str, shared_data: Path):
    from kvfuse.bench import tasks
    from kvfuse.bench.engine_backend import EngineBackend
    from kvfuse.config import Settings
    from kvfuse.fusion import ChunkKV, FusionOptions

    settings = Settings(model_cache_dir=Path(default_llm_path).parent)
    backend = EngineBackend(settings, max_tokens=4, chunk_kv="first-prompt")
    ex = tasks.build_examples("needle", backend.tokenizer, shared_data,
                              tasks.TaskConfig(n=1, docs=3, doc_tokens=48, seed=0))[0]
    prefix, chunks, _ = backend.prepare(ex)
    order = list(reversed(range(len(chunks))))
    _, question_ids = backend.question_ids(ex, order)
    first = [chunks[i] for i in order]
    assert all(c.after_context for c in first)
    e = backend.engine
    reuse = e.fuse(prefix, first, question_ids, FusionOptions(method="pie"))
    plain = [ChunkKV(c.token_ids) for c in first]
    vanilla = e.fuse(prefix, plain, question_ids, FusionOptions(method="vanilla"))
    torch.testing.assert_close(reuse.logits, vanilla.logits, atol=1e-3, rtol=1e-3)
    # in the example's own order the same KV sits after other chunks than it was computed after
    _, own_q = backend.question_ids(ex)
    moved = e.fuse(prefix, chunks, own_q, FusionOptions(method="pie"))
    own = e.fuse(prefix, [ChunkKV(c.token_ids) for c in chunks], own_q, FusionOptions(method="vanilla"))
    assert (moved.logits - own.logits).abs().max() > 1e-3
    with pytest.raises(ValueError, match="first-prompt"):
        EngineBackend(settings, max_tokens=4, chunk_kv="elsewhere")
