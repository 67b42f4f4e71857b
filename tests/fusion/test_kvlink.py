"""kvlink pinned to the math: K = 0 is pie; with links, the engine computes exactly the paper's attention
map (a full pass with its segment mask); link rows see every earlier token and nothing after; a saved
and reloaded artifact gives the same logits; the trainer's forward is the engine's."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import Prompt

from kvfuse.config import FusionSettings
from kvfuse.fusion import ChunkKV, FusionEngine, FusionOptions
from kvfuse.fusion.methods.kvlink import KVLink, link_layout
from kvfuse.fusion.methods.kvlink_artifact import (
    PACKAGED_DIR,
    KVLinkArtifactError,
    LinkArtifact,
    artifact_path,
    find,
)
from kvfuse.train.kvlink import Encoded, link_rows_forward


def random_artifact(engine: FusionEngine, counts=(1, 5), max_docs: int = 8, seed: int = 0) -> LinkArtifact:
    g = torch.Generator().manual_seed(seed)
    hidden = engine.model.config.hidden_size
    scale = float(engine.tf.embed_tokens.weight.detach().std())
    tables = {k: torch.randn(max_docs, k, hidden, generator=g) * scale for k in counts}
    return LinkArtifact(engine.fingerprint, tables, {"placeholder_id": "0"})


@pytest.fixture
def with_links(engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> LinkArtifact:
    art = random_artifact(engine)
    monkeypatch.setitem(engine.artifacts, "kvlink", art)
    return art


def fuse(engine: FusionEngine, prompt: Prompt, k: int, chunks: list[ChunkKV] | None = None, method="kvlink"):
    opts = FusionOptions(method=method, link_tokens=k)
    return engine.fuse(prompt.prefix, chunks if chunks is not None else prompt.chunks, prompt.question_ids, opts)


def segment_mask_reference(engine: FusionEngine, prompt: Prompt, links: torch.Tensor, k: int) -> torch.Tensor:
    """The paper's training computation (§2.3): one pass over [prefix, doc 1, links 1, …, question] at
    contiguous positions, query i seeing key j iff j <= i and (i is not a document token or j is in
    i's document). Returns the last row's logits."""
    ids: list[int] = []
    seg: list[int] = []
    tf = engine.tf
    ids += prompt.prefix.token_ids
    seg += [0] * len(prompt.prefix)
    link_rows = []
    for n, c in enumerate(prompt.chunks, start=1):
        ids += c.token_ids
        seg += [n] * len(c)
        link_rows += list(range(len(ids), len(ids) + k))
        ids += [0] * k
        seg += [0] * k
    ids += prompt.question_ids
    seg += [0] * len(prompt.question_ids)
    t = len(ids)
    with torch.no_grad():
        h = tf.embed(torch.tensor(ids))
        if k:
            h[0, link_rows] = links[: len(prompt.chunks), :k].reshape(-1, h.shape[-1])
        s = torch.tensor(seg)
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        mask = (j <= i) & ((s[:, None] == 0) | (s[:, None] == s[None, :]))
        cos, sin = (x.unsqueeze(1) for x in engine.rope.cos_sin(torch.arange(t), engine.dtype))
        for layer in range(tf.num_layers):
            q, kk, vv = tf.project(layer, h, cos, sin)
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=tf.scale, enable_gqa=True)
            h = tf.finish(layer, h, out)
        return tf.logits(h[:, -1])[0]


def test_kvlink_with_no_link_tokens_is_pie(engine: FusionEngine, prompt: Prompt):
    # K = 0 needs no artifact and adds nothing: the same computation as pie, bit for bit.
    pie = fuse(engine, prompt, 0, method="pie")
    out = fuse(engine, prompt, 0)
    assert torch.equal(out.logits, pie.logits)
    assert out.stats == pie.stats


@pytest.mark.parametrize("k", [1, 5])
def test_kvlink_computes_the_papers_attention_map(engine: FusionEngine, prompt: Prompt, with_links, k: int):
    out = fuse(engine, prompt, k)
    ref = segment_mask_reference(engine, prompt, with_links.tables[k], k)
    torch.testing.assert_close(out.logits, ref, atol=2e-4, rtol=1e-4)
    n = len(prompt.chunks)
    slots = [len(prompt.prefix) + s for s in link_layout([len(c) for c in prompt.chunks], k)]
    assert out.selected.tolist() == slots  # exactly the link rows are computed, besides the question
    assert out.stats["recomputed_tokens"] == n * k
    assert out.stats["context_tokens"] == sum(len(c) for c in prompt.chunks) + n * k


def _link_kv(out, slots: list[int]) -> torch.Tensor:
    cache = out.cache
    return torch.stack([cache.k[:, :, slots], cache.v[:, :, slots]])  # [2, L, Hkv, slots, D]


def test_link_tokens_see_every_earlier_token_and_nothing_after(engine: FusionEngine, prompt: Prompt, with_links):
    k = 5
    lens = [len(c) for c in prompt.chunks]
    p = len(prompt.prefix)
    first_links = [p + s for s in link_layout(lens, k)][:k]  # the links after chunk 0
    base = fuse(engine, prompt, k)

    def with_chunk_changed(i: int):
        chunks = list(prompt.chunks)
        changed = chunks[i].token_ids[:-1] + [engine.tokenize(" zebra")[0]]
        chunks[i] = engine.precompute([changed])[0]
        return fuse(engine, prompt, k, chunks)

    later = with_chunk_changed(1)  # a token after the first links: they must not move
    assert torch.equal(_link_kv(later, first_links), _link_kv(base, first_links))
    assert not torch.equal(later.logits, base.logits)  # the question sees it
    earlier = with_chunk_changed(0)  # the last token of chunk 0, just before them: they must move
    assert not torch.allclose(_link_kv(earlier, first_links), _link_kv(base, first_links))
    # and the prefix: every layer of every link row depends on it
    other_prefix = engine.precompute([prompt.prefix.token_ids[:-1] + engine.tokenize(" zebra")[:1]])[0]
    moved = engine.fuse(other_prefix, prompt.chunks, prompt.question_ids, FusionOptions(method="kvlink", link_tokens=k))
    assert not torch.allclose(_link_kv(moved, first_links)[:, 1:], _link_kv(base, first_links)[:, 1:])


def test_saved_and_reloaded_artifact_gives_the_same_logits(engine: FusionEngine, prompt: Prompt, tmp_path,
                                                           monkeypatch: pytest.MonkeyPatch):
    art = random_artifact(engine, seed=3)
    monkeypatch.setitem(engine.artifacts, "kvlink", art)
    before = fuse(engine, prompt, 5).logits
    art.save(artifact_path(tmp_path, engine.fingerprint))
    monkeypatch.delitem(engine.artifacts, "kvlink")
    KVLink.load_artifacts(engine, SimpleNamespace(fusion=FusionSettings(kvlink_dir=str(tmp_path))))
    assert engine.artifacts["kvlink"].link_counts == [1, 5]
    assert torch.equal(fuse(engine, prompt, 5).logits, before)
    # another model's artifact is not picked up
    assert find(tmp_path, "0" * 64) is None


def test_missing_artifact_or_untrained_count_is_refused_naming_the_command(engine: FusionEngine, prompt: Prompt,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delitem(engine.artifacts, "kvlink", raising=False)
    with pytest.raises(KVLinkArtifactError, match="kvfuse train kvlink"):
        fuse(engine, prompt, 1)
    monkeypatch.setitem(engine.artifacts, "kvlink", random_artifact(engine, counts=(1,)))
    with pytest.raises(ValueError, match="link_tokens=3 was not trained"):
        fuse(engine, prompt, 3)


def test_the_training_forward_is_the_engines(engine: FusionEngine, prompt: Prompt, with_links):
    # The trainer's rows (links + question + answer) give the logits the engine serves.
    k = 5
    enc = Encoded(prompt.prefix, prompt.chunks, prompt.question_ids[:-1], prompt.question_ids[-1:])
    with torch.no_grad():
        train_logits = link_rows_forward(engine, enc, with_links.tables[k], k)[0]
    served = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids[:-1],
                         FusionOptions(method="kvlink", link_tokens=k)).logits
    torch.testing.assert_close(train_logits, served, atol=2e-4, rtol=1e-4)


REPO = Path(__file__).resolve().parents[2]


def test_the_package_ships_link_embeddings_for_the_default_model(engine: FusionEngine):
    art = find(PACKAGED_DIR, engine.fingerprint)
    assert art is not None and art.link_counts == [1, 5]
    assert PACKAGED_DIR == Path(__import__("kvfuse").__file__).parent / "artifacts" / "kvlink"


@pytest.mark.slow
def test_an_installed_wheel_finds_its_packaged_artifact(engine: FusionEngine, tmp_path: Path):
    """Built as a wheel and installed elsewhere (as `pip install .` does in the image), the package still
    finds the artifact it ships: PACKAGED_DIR is resolved through the installed package, not the source tree."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "kvfuse", src / "kvfuse", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("kvfuse-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel installs by unpacking
    code = ("from kvfuse.fusion.methods import kvlink_artifact as k; import sys; "
            "a = k.find(k.PACKAGED_DIR, sys.argv[1]); print(k.PACKAGED_DIR); print(a.link_counts)")
    out = subprocess.run([sys.executable, "-c", code, engine.fingerprint], cwd=tmp_path, check=True,
                         capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(site)})
    where, counts = out.stdout.split("\n")[:2]
    assert Path(where) == site / "kvfuse" / "artifacts" / "kvlink"
    assert counts == "[1, 5]"
