"""The decode benches' streams (kvfuse/bench/streams.py) on the engine core: copies of one fused prefill,
each in its own extent of the core's KV memory, decode the tokens the fused cache decodes alone (the
runner's own steps over it), an evicted cache's positions included, and a timed window is refused when a
stream has left the batch. A tiny random-weight Llama keeps it fast."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvfuse.bench.streams import core_streams, time_steps
from kvfuse.fusion import FusionEngine, FusionOptions
from kvfuse.fusion.engine import outputs as E
from kvfuse.fusion.engine.runner import ModelRunner

ROOM = 6


@pytest.fixture(scope="module")
def tiny(tokenizer) -> FusionEngine:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return FusionEngine(LlamaForCausalLM(config).eval(), tokenizer, dtype="float32")


def _fused(engine: FusionEngine, evict: int = 0):
    chunk = torch.randint(100, 5000, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    prefix_ids, question_ids = engine.prompt_parts("Question?", "Answer.")
    prefix, kv = engine.precompute([prefix_ids, chunk])
    return engine.fuse(prefix, [kv], question_ids, FusionOptions(method="pie", recompute_ratio=0.2,
                                                                  evict_capacity=evict), max_tokens=ROOM)


def _alone(engine: FusionEngine, fused) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each decode step's logits of the fused cache decoded by the runner's own steps,
    for its whole room."""
    runner, tokens, rows = ModelRunner(engine.tf), [int(fused.logits.argmax())], []
    for _ in range(ROOM):
        rows.append(runner.decode([fused.cache], torch.tensor(tokens[-1:]))[0])
        tokens.append(int(rows[-1].argmax()))
    return tokens, rows


@pytest.mark.parametrize("evict", [0, 48])
def test_streams_decode_the_fused_cache_s_own_tokens(tiny, evict: int) -> None:
    fused = _fused(tiny, evict)
    assert (fused.cache.position_offset > 0) == (evict > 0)
    core = core_streams(tiny, fused, 3)
    seqs = [r.seq for r in core.scheduler.decode_batch()]
    assert len(seqs) == 3 and all(s.gen.decode_steps == 1 for s in seqs)  # one decode step ran as they started
    seen: list[list[torch.Tensor]] = [[] for _ in seqs]
    for s, rows in zip(seqs, seen, strict=True):
        s.on_logits = rows.append
    times = time_steps(core, ROOM - 2)
    assert len(times) == ROOM - 2 and min(times) > 0
    out: list = []
    while core.has_work:
        out.extend(core.step())
    finished = [o.seq.gen.token_ids for o in out if isinstance(o, E.Finished)]
    tokens, rows = _alone(tiny, _fused(tiny, evict))
    assert finished == [tokens] * 3  # each stream: the cache's own tokens, its whole room, no stop
    for got in seen:  # steps 2.. of each stream: the runner's logits over the cache alone, at its positions
        torch.testing.assert_close(torch.stack(got), torch.stack(rows[1:]), atol=1e-5, rtol=0)


def test_a_window_longer_than_the_streams_room_is_refused(tiny) -> None:
    core = core_streams(tiny, _fused(tiny), 2)
    with pytest.raises(RuntimeError, match="decoded 0 streams, not 2"):
        time_steps(core, ROOM + 1)
