"""The language model of a multimodal Gemma 3 checkpoint (`gemma3`: 4B, 12B, 27B) as a `gemma3_text` one.

Gemma3ForConditionalGeneration is a SigLIP vision tower and a projector in front of a Gemma3 text decoder;
on text-only input the projector is never called and the decoder computes what Gemma3ForCausalLM with the
same weights computes. So the text config is saved as the model's config and the decoder's tensors are
renamed to Gemma3ForCausalLM's names, one shard at a time (a 27B checkpoint never sits in memory whole).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfuse.model_files import ModelFilesError

# Where the decoder's tensors live in a multimodal checkpoint: the hub's layout (`language_model.model.`)
# and transformers' own saves since 4.52 (`model.language_model.`); the vision tower and projector go.
_RENAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def text_name(key: str) -> str | None:
    """The Gemma3ForCausalLM name of a multimodal checkpoint's tensor, None for the vision parts."""
    for old, new in _RENAMES:
        if key.startswith(old):
            return new + key[len(old):]
    return None


def extract_text_model(folder: Path, config: dict, out: Path) -> dict:
    """Write `folder`'s language model (config and weights) into `out`; returns the config written."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from kvfuse.fusion.model.loading import check_supported

    text = AutoConfig.from_pretrained(str(folder)).text_config
    check_supported(text)
    written = text.to_dict()
    written.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text")
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype:
        written["dtype"] = dtype
    shards = sorted(folder.glob("*.safetensors"))
    index: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                renamed = text_name(key)
                if renamed is not None:
                    tensors[renamed] = f.get_tensor(key)
        if tensors:
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            index.update(dict.fromkeys(tensors, name))
    if not any(k.startswith("model.embed_tokens.") for k in index):
        raise ModelFilesError(f"{folder} holds no Gemma 3 language model weights (model.language_model.* or "
                              "language_model.model.*)")
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(written, indent=2))
    return written
