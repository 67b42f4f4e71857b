"""`kvfuse train kvlink` on a tiny random Llama (built from a config, the default tokenizer): a few steps
lower the answer loss, checkpoints resume, and the artifact it writes is what the engine loads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvfuse.config import FusionSettings
from kvfuse.fusion import FusionEngine, FusionOptions
from kvfuse.fusion.methods.kvlink import KVLink
from kvfuse.fusion.methods.kvlink_artifact import artifact_path, read
from kvfuse.train.kvlink import TrainConfig, Trainer, answer_loss, encode, init_tables
from kvfuse.train.kvlink_data import Passages, make_example


@pytest.fixture(scope="module")
def tiny_engine(default_llm_path: str) -> FusionEngine:
    tokenizer = AutoTokenizer.from_pretrained(default_llm_path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    return FusionEngine(model, tokenizer, dtype="float32")


def small_config(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": 4, "docs": (2, 3), "doc_tokens": (16, 32), "val_examples": 2, "val_every": 2,
                          "save_every": 2, "lr": 1e-2, "warmup": 1, **kw})


def test_a_few_steps_lower_the_answer_loss(tiny_engine: FusionEngine, shared_data: Path):
    cfg = small_config()
    for p in tiny_engine.model.parameters():
        p.requires_grad_(False)
    passages = Passages(tiny_engine.tokenizer, shared_data)
    examples = [encode(tiny_engine, make_example(passages, 7, i, cfg.docs, cfg.doc_tokens), cfg.system_prompt)
                for i in range(3)]
    tables = init_tables(tiny_engine, cfg)
    opt = torch.optim.Adam(list(tables.values()), lr=cfg.lr)

    def loss() -> float:
        with torch.no_grad():
            return sum(answer_loss(tiny_engine, e, tables[k], k).item() for e in examples for k in tables)

    before = loss()
    for _ in range(8):
        opt.zero_grad()
        for e in examples:
            for k, t in tables.items():
                answer_loss(tiny_engine, e, t, k).backward()
        opt.step()
    assert loss() < before


def test_training_checkpoints_resume_and_write_the_artifact_the_engine_loads(
        tiny_engine: FusionEngine, shared_data: Path, tmp_path: Path):
    run, out = tmp_path / "run", tmp_path / "artifacts"
    first = Trainer(tiny_engine, small_config(steps=2), shared_data, run, out, log=lambda s: None)
    first.run()
    assert (run / "checkpoint.pt").is_file() and (run / "train_log.jsonl").is_file()
    resumed = Trainer(tiny_engine, small_config(steps=4), shared_data, run, out, log=lambda s: None)
    assert resumed.resume() and resumed.step == 2
    resumed.run()
    assert resumed.step == 4 and [r["step"] for r in resumed.history] == [0, 1, 2, 3, 4]
    # the same data stream as an uninterrupted run: step 3 trains on example index 2 either way
    assert resumed.history[3]["loss_k1"] > 0

    art = read(artifact_path(out, tiny_engine.fingerprint))
    assert art.fingerprint == tiny_engine.fingerprint and art.link_counts == [1, 5]
    assert art.meta["steps"] == "4"
    for k, t in resumed.tables.items():
        assert torch.equal(art.tables[k], t.detach())
    engine = tiny_engine
    saved = dict(engine.artifacts)
    try:
        KVLink.load_artifacts(engine, SimpleNamespace(fusion=FusionSettings(kvlink_dir=str(out))))
        prefix_ids, question_ids = engine.prompt_parts("Who?", None)
        kvs = engine.precompute([prefix_ids, engine.tokenize("One document."), engine.tokenize("Another one.")])
        fused = engine.fuse(kvs[0], kvs[1:], question_ids, FusionOptions(method="kvlink", link_tokens=1))
        assert fused.stats["recomputed_tokens"] == 2
    finally:
        engine.artifacts.clear()
        engine.artifacts.update(saved)
