"""The load check refuses a model the engine would compute wrong, naming the layer where it parts from
transformers, before the model serves: in FusionEngine.from_settings (the worker's start-up) and in
`kvfuse models check PATH`. The variation shown is one the engine does not compute: Gemma 3 with
`use_bidirectional_attention` (EmbeddingGemma's setting), which transformers honours and the engine's
causal layers do not."""

from __future__ import annotations

import pytest
import tiny_models

from kvfuse.cli import main
from kvfuse.fusion import FusionEngine
from kvfuse.fusion.model.check import ModelCheckError, check_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory, default_llm_path) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {"good": tiny_models.save("gemma3_text", root / "good", default_llm_path),
            "bidirectional": tiny_models.save("gemma3_text", root / "bidirectional", default_llm_path,
                                              use_bidirectional_attention=True)}


def test_a_setting_the_engine_does_not_compute_fails_at_layer_0(tokenizer) -> None:
    model = tiny_models.build("gemma3_text", len(tokenizer), use_bidirectional_attention=True)
    engine = FusionEngine(model, tokenizer, dtype="float32")
    report = check_model(engine)
    assert not report.ok
    forward = report.results[0]
    assert forward.name == "forward" and forward.verdict == "FAILED" and forward.layer == 0
    assert "parts at layer 0" in forward.detail
    with pytest.raises(ModelCheckError, match=r"refusing to serve it") as err:
        report.raise_on_failure()
    assert "forward: parts at layer 0" in str(err.value)


def test_the_worker_start_up_refuses_it_before_serving(saved, settings_factory) -> None:
    settings = settings_factory(model={"llm": str(saved["bidirectional"])})
    assert settings.model.check_on_load  # on by default
    with pytest.raises(ModelCheckError, match="parts at layer 0"):
        FusionEngine.from_settings(settings)
    # without the check the same model loads, and would answer from attention it does not compute
    unchecked = FusionEngine.from_settings(settings_factory(model={"llm": str(saved["bidirectional"]),
                                                                   "check_on_load": False}))
    assert unchecked.family.model_type == "gemma3_text"
    engine = FusionEngine.from_settings(settings_factory(model={"llm": str(saved["good"])}))
    assert engine.tf.windows[0] == tiny_models.WINDOW


def test_models_check_prints_a_verdict_per_check_and_exits_0_or_2(saved, tmp_path, capsys) -> None:
    assert main(["models", "check", str(saved["good"])]) == 0
    out = capsys.readouterr().out
    assert "gemma3_text" in out and "passed" in out
    for name in ("forward", "decode", "recovery", "fused:anchor", "fused:a3", "fused:cacheblend"):
        assert any(line.startswith(name) and " ok " in line for line in out.splitlines()), out
    assert main(["models", "check", str(saved["bidirectional"])]) == 2
    out = capsys.readouterr().out
    assert "FAILED" in out and "forward" in out and "parts at layer 0" in out


def test_models_check_refuses_a_model_type_it_does_not_know(tmp_path, default_llm_path, capsys) -> None:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(default_llm_path)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main(["models", "check", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'gpt2' is not supported" in err and "gemma3_text" in err


def test_a_pass_is_remembered_for_this_model_and_code_and_a_failure_never(saved, settings_factory, tmp_path,
                                                                          monkeypatch, caplog) -> None:
    from kvfuse.fusion.model import check_cache

    caplog.set_level("INFO", logger="kvfuse.fusion")
    models_dir = tmp_path / "models"
    good = settings_factory(model_cache_dir=models_dir, model={"llm": str(saved["good"])})
    FusionEngine.from_settings(good)
    first = sorted((models_dir / "checks").glob("*.json"))
    assert len(first) == 1 and "model check passed" in caplog.text
    caplog.clear()
    FusionEngine.from_settings(good)  # a restart: the same model on the same code
    assert "model check skipped" in caplog.text and "model check passed" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(check_cache, "source_hash", lambda: "the engine's code changed")
    FusionEngine.from_settings(good)
    assert "model check passed" in caplog.text and len(list((models_dir / "checks").glob("*.json"))) == 2
    bad = settings_factory(model_cache_dir=models_dir, model={"llm": str(saved["bidirectional"])})
    for _ in range(2):  # refused at every start: nothing remembered
        with pytest.raises(ModelCheckError):
            FusionEngine.from_settings(bad)
    assert len(list((models_dir / "checks").glob("*.json"))) == 2
    # models in a folder the service cannot write (a read-only image): the verdict goes to the data dir
    (tmp_path / "not-a-folder").write_text("")
    ro = settings_factory(model_cache_dir=tmp_path / "not-a-folder" / "models", model={"llm": str(saved["good"])})
    FusionEngine.from_settings(ro)
    assert len(list((ro.data_dir / "model-checks").glob("*.json"))) == 1


def test_the_tolerance_is_the_dtypes_rounding_over_layers_and_steps() -> None:
    """4 (u + sqrt(K) u32) sqrt(L (1 + s)): one op's rounding (the output's, plus fp32 accumulation over K
    terms), a random walk over L layers and s earlier decode steps."""
    import torch

    from kvfuse.fusion.model.check import tolerance

    u32 = 2.0**-24
    assert tolerance(torch.bfloat16, 1, 1) == pytest.approx(4 * (2.0**-8 + u32))
    assert tolerance(torch.float16, 1, 1) == pytest.approx(4 * (2.0**-11 + u32))
    assert tolerance(torch.float32, 1, 1024) == pytest.approx(4 * 33 * u32)
    assert tolerance(torch.bfloat16, 30, 1, step=3) == pytest.approx(tolerance(torch.bfloat16, 1, 1) * 120**0.5)
