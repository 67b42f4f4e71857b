"""The load check catches the mistakes it exists for: each family feature the engine computes by its
family table (kvfuse/fusion/model/families.py) -- attention and final soft-caps, per-layer sliding
windows, per-layer-type ropes, where the norms sit, q/k norms -- switched off or altered in that table
(the model and transformers' reference untouched), and the check fails, naming where the two part and
what the engine computed there. The prompt crosses the window of the model's config however the table
is altered (`check.prompt_length` reads the config). Tied embeddings and MoE routing have no table entry
(the engine calls the model's own LM head and MLP modules); an engine that ignored the tie (an LM head of
its own) or routed each token to fewer experts than the config's is caught the same way."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import tiny_models
import torch

from kvfuse.fusion import FusionEngine
from kvfuse.fusion.errors import UnsupportedModelError
from kvfuse.fusion.model import families
from kvfuse.fusion.model.check import check_model, prompt_length

# (family, what the table gets wrong, the altered fields, the tiny config's overrides, the first layer where
# the check parts (None: the output), what its message shows the engine computed there). A cap of 0.1 on
# the tiny model's attention logits: its random weights give scores far below Gemma 2's 50, where tanh is
# nearly the identity.
MUTATIONS = [
    ("gemma2", "attention soft-cap off", dict(attn_softcap=False), dict(attn_logit_softcapping=0.1), 0,
     "no attention soft-cap"),
    ("gemma2", "final soft-cap off", dict(final_softcap=False), {}, None, "no final soft-cap"),
    ("mistral", "window ignored", dict(windows="none"), {}, 0, "layer 0: no window"),
    ("gemma3_text", "a window on the global layer too", dict(windows="all"), {}, 2, "layer 2: sliding window 24"),
    ("qwen3", "per-layer windows ignored", dict(windows="none"), {}, 2, "layer 2: no window"),
    ("gemma3_text", "pre-norm layers instead of Gemma's four norms", dict(layout="pre"), {}, 0, "pre norms"),
]


@pytest.fixture(autouse=True)
def one_thread():
    """The CPU's kernels on one thread: on a busy 2-core machine two threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine_of(family: str, dtype: torch.dtype = torch.float32, **overrides) -> FusionEngine:
    model = tiny_models.build(family, len(TOKENIZER[0]), dtype=dtype, **overrides)
    engine = FusionEngine(model, TOKENIZER[0], dtype=str(dtype).removeprefix("torch."), attention_block_rows=32)
    engine.stop_token_ids = set()
    return engine


TOKENIZER: list = []


@pytest.fixture(autouse=True)
def _tokenizer(tokenizer):
    TOKENIZER[:] = [tokenizer]


def altered(monkeypatch, family: str, **fields) -> None:
    monkeypatch.setitem(families.FAMILIES, family, dataclasses.replace(families.FAMILIES[family], **fields))


def assert_fails(engine: FusionEngine, layer: int | None, shows: str) -> None:
    report = check_model(engine)
    assert not report.ok, report.summary()
    forward = report.results[0]
    assert forward.name == "forward" and forward.verdict == "FAILED", report.summary()
    assert forward.layer == layer, forward.detail
    assert ("at the output" if layer is None else f"at layer {layer}") in forward.detail
    assert shows in forward.detail, forward.detail


@pytest.mark.parametrize(("family", "mistake", "fields", "config", "layer", "shows"), MUTATIONS,
                         ids=[f"{m[0]}: {m[1]}" for m in MUTATIONS])
def test_a_feature_the_table_gets_wrong_fails_the_check(monkeypatch, family, mistake, fields, config, layer,
                                                        shows) -> None:
    if config:  # the table as it is passes on the altered config (the unaltered ones: test_families.py)
        assert check_model(engine_of(family, **config)).ok
    altered(monkeypatch, family, **fields)
    assert_fails(engine_of(family, **config), layer, shows)


def test_the_prompt_crosses_the_configs_window_whatever_the_table_says(monkeypatch) -> None:
    altered(monkeypatch, "mistral", windows="none")
    engine = engine_of("mistral", sliding_window=120)  # longer than the canned prompt's 96 tokens
    assert engine.tf.windows == [None] * engine.num_layers  # the table ignores it...
    assert prompt_length(engine) == 120 + 48  # ...the check's prompt still crosses it
    assert_fails(engine, 0, "no window")


def test_one_rope_for_every_layer_type_fails_the_check(monkeypatch) -> None:
    """Gemma 3's local layers rotating by the global layers' rope (base 1M, linear factor 8)."""
    monkeypatch.setattr(families, "rope_layer_types", lambda config: ["full_attention"] * config.num_hidden_layers)
    assert_fails(engine_of("gemma3_text"), 0, "rope linear of full_attention layers")


def test_q_k_norms_the_table_lacks_are_refused_at_load(monkeypatch) -> None:
    """A table without Qwen3's q/k norms is refused before the check runs: the layers carry norms the
    engine would not apply."""
    altered(monkeypatch, "qwen3", qk_norm=None)
    with pytest.raises(UnsupportedModelError, match="has q/k norms, which qwen3 does not"):
        engine_of("qwen3")


def test_an_lm_head_of_its_own_instead_of_the_tied_embedding_fails_the_check() -> None:
    """Not a table entry: an engine that ignored Llama 3.2's tie and used an LM head of its own."""
    engine = engine_of("llama")
    assert engine.tf.lm_head.weight is engine.tf.embed_tokens.weight
    torch.manual_seed(1)
    untied = torch.nn.Linear(engine.tf.config.hidden_size, engine.tf.config.vocab_size, bias=False)
    engine.tf.lm_head = untied
    assert_fails(engine, None, "untied LM head")


@pytest.mark.parametrize(("family", "fields", "layer", "shows"), [
    ("mistral", dict(windows="none"), 0, "no window"),
    ("gemma3_text", dict(layout="pre"), 0, "pre norms"),
])
def test_in_bfloat16_the_check_still_catches_it(monkeypatch, family, fields, layer, shows) -> None:
    """bfloat16's wider tolerance (`check.tolerance`) still leaves a wrong computation far outside it."""
    altered(monkeypatch, family, **fields)
    assert_fails(engine_of(family, torch.bfloat16), layer, shows)


def test_routing_each_token_to_fewer_experts_fails_the_check() -> None:
    """Not a table entry: an engine whose layers route each token to one expert where Qwen3-MoE's config
    routes it to two (the engine's own copies of the layers; transformers' reference keeps the model's)."""
    engine = engine_of("qwen3_moe")
    assert engine.tf.layers[0].mlp.gate.top_k == 2
    for i, layer in enumerate(engine.tf.layers):
        mine, mlp, gate = copy.copy(layer), copy.copy(layer.mlp), copy.copy(layer.mlp.gate)
        gate.top_k = 1
        mlp._modules = {**layer.mlp._modules, "gate": gate}
        mine._modules = {**layer._modules, "mlp": mlp}
        engine.tf.layers[i] = mine
    assert engine.model.model.layers[0].mlp.gate.top_k == 2
    assert_fails(engine, 0, "the engine's layer 0")
