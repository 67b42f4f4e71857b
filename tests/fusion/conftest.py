"""Fixtures of the fusion tests: the real default model (session-scoped engine) and a small prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fusion_helpers import Prompt, make_prompt

from kvfuse.fusion import FusionEngine


@pytest.fixture(scope="session")
def engine(default_llm_path: str) -> FusionEngine:
    return FusionEngine.load(default_llm_path, dtype="float32")


@pytest.fixture(scope="session")
def essay_text(essays) -> str:
    return dict(essays)["apple"]


@pytest.fixture(scope="session")
def prompt(engine: FusionEngine, essay_text: str) -> Prompt:
    """A system prefix, three chunks of 48-64 tokens and a question (~200 tokens in all)."""
    return make_prompt(engine, essay_text, "What does the author think of the App Store?", [64, 48, 56])


@pytest.fixture(scope="session")
def hf_greedy(engine: FusionEngine, prompt: Prompt) -> list[int]:
    with torch.inference_mode():
        out = engine.model.generate(torch.tensor([prompt.ids]), max_new_tokens=8, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt.ids):].tolist()


@pytest.fixture(scope="session")
def prompts(engine: FusionEngine, essays) -> list[Prompt]:
    """Three prompts of different contexts and lengths (the batched decode tests' batch)."""
    texts = dict(essays)
    return [
        make_prompt(engine, texts["apple"], "What does the author think of the App Store?", [64, 48, 56]),
        make_prompt(engine, list(texts.values())[3], "Who is the essay about?", [30]),
        make_prompt(engine, list(texts.values())[7], "What is the main point?", [90, 20, 41, 12]),
    ]


@pytest.fixture(scope="session")
def inductor_cache():
    """One inductor compile cache for every test that compiles (tests/fusion/test_static_path.py), kept
    between runs in .pytest_cache: only the first run on a machine pays for the compiles."""
    path = Path(__file__).resolve().parents[2] / ".pytest_cache" / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    yield path
    mp.undo()
