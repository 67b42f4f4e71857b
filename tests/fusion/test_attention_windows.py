"""Sliding windows and soft-capped logits on every attention path, against attention written out by hand
in float64: a row at p sees keys p - window < key <= p (transformers' sliding-window mask), logits
capped at c * tanh(s / c) (Gemma 2). Paths: the blocked CPU kernel, the dense mask over the keys some
row sees, FlexAttention's windowed block mask (run eagerly), the written-out path (attention_math), the
probe's log-sum-exp and probabilities, and the decode step's `attend_all` over a window's keys."""

from __future__ import annotations

import pytest
import torch
from test_attention_paths import HKV, SCALE, H, assert_bf16_rows_on_cuda, row_sets, rows_at, tensors

from kvfuse.fusion.methods import scoring
from kvfuse.fusion.model import attention, attention_flex, attention_math
from kvfuse.fusion.model.attention import Attention


def reference(q, k, v, positions, window=None, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64."""
    q, k, v = q.double(), k.double(), v.double()
    kk, vv = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    keys = torch.arange(k.shape[2])[None, :]
    hidden = keys > positions[:, None]
    if window is not None:
        hidden |= keys <= positions[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return scores.softmax(-1) @ vv, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("window", [1, 40, 500])
@pytest.mark.parametrize("path", ["blocked-16", "blocked-128", "dense", "flex-eager", "written"])
def test_windowed_paths_match_attention_by_hand(path: str, window: int) -> None:
    gen = torch.Generator().manual_seed(window)
    for kind, positions in row_sets(700, gen).items():
        q, k, v = tensors(positions.numel(), 700, gen)
        rows = rows_at(positions)
        k, v = k[:, :, : rows.stop], v[:, :, : rows.stop]
        if path == "flex-eager":
            out = attention_flex.FlexRows(SCALE, compiled=False)(q, k, v, attention_flex.plan(positions, window))
        elif path == "written":
            out = attention_math.attend(q, k, v, positions, SCALE, window=window)
        else:
            block_rows = int(path.split("-")[1]) if path.startswith("blocked") else 0
            att = Attention(SCALE, torch.device("cpu"), block_rows=block_rows)
            out = att(q, k, v, rows, window)
            hides = rows.stop > window
            if path == "dense":  # the kernel's causal flags have no lower edge: the dense mask when it bites
                assert att.path(rows, window) == (att.path(rows) if not hides else "dense")
        want, _ = reference(q, k, v, positions, window)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5, msg=f"{path}, {kind}")


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("path", ["auto", "flex-eager"])
def test_soft_capped_logits_on_every_path(path: str, window: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    for kind, positions in row_sets(400, gen).items():
        q, k, v = tensors(positions.numel(), 400, gen)
        q = q * 4  # logits large enough for the cap to matter
        rows = rows_at(positions)
        k, v = k[:, :, : rows.stop], v[:, :, : rows.stop]
        if path == "flex-eager":
            flex = attention_flex.FlexRows(SCALE, compiled=False, softcap=5.0)
            out = flex(q, k, v, attention_flex.plan(positions, window))
        else:
            att = Attention(SCALE, torch.device("cpu"), block_rows=128, softcap=5.0)
            assert att.blocked is None and att.path(rows, window) == "written"
            out = att(q, k, v, rows, window)
        want, _ = reference(q, k, v, positions, window, softcap=5.0)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5, msg=f"{path}, {kind}")


@pytest.mark.parametrize("window,softcap", [(30, None), (None, 5.0), (30, 5.0), (1000, None)])
def test_probe_lse_and_probabilities_with_windows_and_caps(window: int | None, softcap: float | None) -> None:
    gen = torch.Generator().manual_seed(7)
    rows, keys, n = 30, 500, 400
    q, k, v = tensors(rows, keys, gen)
    q = q * 4
    positions = torch.arange(keys - rows, keys)
    out, lse = attention.with_lse(q, k, v, SCALE, window=window, softcap=softcap)
    want, want_lse = reference(q, k, v, positions, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-5)
    probs = scoring.probs_from_lse(q, k[:, :, :n], lse, SCALE, softcap=softcap, window=window, q_positions=positions)
    full = scoring.attention_probs(q, positions, k, SCALE, window=window, softcap=softcap)
    torch.testing.assert_close(probs, full[:, :, :n], atol=1e-6, rtol=1e-5)
    if window == 30:  # rows at 470..499 reach back to key 441: the first 400 keys are out of every window
        assert float(probs.abs().sum()) == 0.0


def test_windowed_flex_block_tables_are_what_the_mask_says() -> None:
    """Per row block and key block: full when every row sees every key, partial when some row sees some
    key, skipped otherwise -- read off the mask itself."""
    b = attention_flex.BLOCK
    gen = torch.Generator().manual_seed(4)
    positions = torch.sort(torch.randperm(9 * b, generator=gen)[: 3 * b + 5]).values
    for window in (50, 200, 700):
        p = attention_flex.plan(positions, window)
        partial_n, partial_i, full_n, full_i = attention_flex.block_tables(p.positions, p.keys, p.rows, window)
        seen = attention_math.visible(p.positions, 0, p.keys, window)
        for qb in range(p.positions.numel() // b):
            real = qb * b < p.rows
            block = seen[qb * b : (qb + 1) * b].view(b, -1, b)  # [rows, key blocks, keys]
            full = [j for j in range(block.shape[1]) if real and bool(block[:, j].all())]
            some = [j for j in range(block.shape[1]) if real and bool(block[:, j].any()) and j not in full]
            assert sorted(full_i[0, 0, qb, : int(full_n[0, 0, qb])].tolist()) == full
            assert sorted(partial_i[0, 0, qb, : int(partial_n[0, 0, qb])].tolist()) == some


def test_decode_step_attention_caps_logits() -> None:
    """attend_all (a decode row over the keys it reads) with a soft-capping model's cap."""
    from types import SimpleNamespace

    from kvfuse.fusion.model.transformer import Transformer

    gen = torch.Generator().manual_seed(8)
    q, k, v = tensors(1, 90, gen)
    tf = SimpleNamespace(softcap=5.0, scale=SCALE)
    out = Transformer.attend_all(tf, q * 4, k, v)
    want, _ = reference(q * 4, k, v, torch.tensor([89]), softcap=5.0)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("window,softcap", [(40, None), (None, 5.0), (40, 5.0)])
def test_cuda_paths_with_windows_and_caps_in_bf16(window: int | None, softcap: float | None) -> None:
    """On CUDA: compiled FlexAttention with the windowed block mask and the soft-capping score_mod, and
    the written-out path, in bf16."""
    att = Attention(SCALE, torch.device("cuda"), softcap=softcap)
    assert_bf16_rows_on_cuda(lambda q, k, v, rows: att(q, k, v, rows, window),
                             lambda q, k, v, positions: reference(q, k, v, positions, window, softcap)[0],
                             (300, 1500), torch.Generator().manual_seed(3))
