"""Every attention path of kvfuse/fusion/model/attention.py against attention written out by hand in float64,
for random row sets: the kernel's causal mask, lower-right causal (contiguous rows), the LSE-returning
call the probe uses, FlexAttention's block mask by position (its plan and padding, run eagerly on the
CPU: the same function the CUDA path compiles), and the dense mask. The CUDA half (`-m cuda`) runs the
CUDA kernels (flash's lower-right causal and log-sum-exp, compiled FlexAttention) in bf16 wherever a GPU
is present."""

from __future__ import annotations

import pytest
import torch

from kvfuse.fusion.model import attention, attention_flex
from kvfuse.fusion.model.attention import Attention
from kvfuse.fusion.model.transformer import Rows

H, HKV, D, SCALE = 4, 2, 64, 64**-0.5
CUDA = torch.cuda.is_available()
ON_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device")])


def reference(q, k, v, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64: row i sees keys 0..positions[i]."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    kk, vv = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * SCALE
    hidden = torch.arange(k.shape[2])[None, :] > positions.cpu()[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    return scores.softmax(-1) @ vv, torch.logsumexp(scores, dim=-1)


def row_sets(total: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "scattered": torch.sort(torch.randperm(total, generator=gen)[: total // 5]).values,
        # 257 rows: padded to 512, the last row block padding only (FlexAttention gives it no key block)
        "scattered-257": torch.sort(torch.randperm(total, generator=gen)[:257]).values,
        "scattered-then-question": torch.cat([torch.sort(torch.randperm(total - 30, generator=gen)[:60]).values,
                                              torch.arange(total - 30, total)]),
        "dense-start": torch.cat([torch.arange(0, 150), torch.tensor([total - 1])]),
        "two-rows": torch.tensor([3, total - 1]),
        "contiguous": torch.arange(total - 37, total),
        "from-zero": torch.arange(total),
        "one-row": torch.tensor([total - 1]),
    }


def tensors(rows: int, keys: int, gen: torch.Generator, device="cpu", dtype=torch.float32):
    q = torch.randn(1, H, rows, D, generator=gen)
    k, v = torch.randn(1, HKV, keys, D, generator=gen), torch.randn(1, HKV, keys, D, generator=gen)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


def rows_at(positions: torch.Tensor, dtype=torch.float32) -> Rows:
    rows = Rows.__new__(Rows)  # only the positions matter here; cos/sin are the rotary module's
    rows.positions, rows.dtype, rows.count = positions, dtype, int(positions.numel())
    rows.stop = int(positions[-1]) + 1
    rows.contiguous = rows.stop - int(positions[0]) == rows.count
    rows._plans = {}
    return rows


@pytest.mark.parametrize("total", [300, 1100])
@pytest.mark.parametrize("path", ["auto", "dense", "flex-eager"])
def test_every_path_matches_attention_by_hand(path: str, total: int) -> None:
    gen = torch.Generator().manual_seed(total)
    for kind, positions in row_sets(total, gen).items():
        q, k, v = tensors(positions.numel(), total, gen)
        rows = rows_at(positions)
        att = Attention(SCALE, torch.device("cpu"), block_rows=0)
        k, v = k[:, :, : rows.stop], v[:, :, : rows.stop]
        if path == "dense":
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=rows.mask, scale=SCALE,
                                                                   is_causal=rows.mask is None, enable_gqa=True)
        elif path == "flex-eager":
            out = attention_flex.FlexRows(SCALE, compiled=False)(q, k, v, attention_flex.plan(positions))
        else:
            out = att(q, k, v, rows)
            assert att.path(rows) == {"contiguous": "lower_right", "one-row": "lower_right",
                                      "from-zero": "causal"}.get(kind, "dense")
        want, _ = reference(q, k, v, positions)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5, msg=f"{path}, {kind}")


def test_cuda_picks_flex_for_scattered_rows_and_no_mask_for_contiguous_ones() -> None:
    att = Attention(SCALE, torch.device("cuda"), block_rows=128)  # nothing is allocated: the choice only
    assert att.blocked is None  # the blocked kernel is the CPU's
    for kind, positions in row_sets(300, torch.Generator().manual_seed(0)).items():
        rows = rows_at(positions)
        want = {"contiguous": "lower_right", "one-row": "lower_right", "from-zero": "causal"}.get(kind, "flex")
        assert att.path(rows) == (want if attention_flex.available() else want.replace("flex", "dense"))
        assert not rows._plans  # choosing builds no mask
    assert Attention(SCALE, torch.device("cuda"), sparse=False).path(rows_at(torch.tensor([3, 9]))) == "dense"


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("rows,keys", [(37, 300), (300, 300), (1, 50), (130, 1100)])
def test_with_lse_gives_the_output_and_log_sum_exp_of_the_last_rows(device: str, rows: int, keys: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = tensors(rows, keys, gen, device, dtype)
    out, lse = attention.with_lse(q, k, v, SCALE)
    want, want_lse = reference(q, k, v, torch.arange(keys - rows, keys))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-5)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (1, H, rows)
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse, **tol)
    math_out, math_lse = attention._math_with_lse(q, k, v, SCALE)  # the fallback, the same numbers
    torch.testing.assert_close(math_lse.double().cpu(), want_lse, **tol)
    torch.testing.assert_close(math_out.double().cpu(), want, **tol)


def test_flex_plan_lists_full_partial_and_skipped_key_blocks() -> None:
    b = attention_flex.BLOCK
    positions = torch.cat([torch.arange(0, b), torch.arange(5 * b + 7, 6 * b + 7), torch.tensor([9 * b + 3])])
    p = attention_flex.plan(positions)
    assert p.rows == 2 * b + 1 and p.positions.numel() == 4 * b and p.keys == 1280  # 1156 keys: steps of 256
    partial_n, partial_i, full_n, full_i = attention_flex.block_tables(p.positions, p.keys, p.rows)
    # row block 0 (rows 0..127): key block 0 partial, none full; row block 1 (positions 647..774): key
    # blocks 0..4 full, 5..6 partial; row block 2 (one real row at 1155, padded with it): 0..8 full, 9
    # partial; row block 3 (padding only): nothing
    assert partial_n.view(-1).tolist() == [1, 2, 1, 0] and full_n.view(-1).tolist() == [0, 5, 9, 0]
    assert partial_i[0, 0, 1, :2].tolist() == [5, 6] and full_i[0, 0, 1, :5].tolist() == [0, 1, 2, 3, 4]
    assert partial_i[0, 0, 2, :1].tolist() == [9]


def test_buckets_are_few_and_pad_keys_by_under_a_quarter() -> None:
    assert [attention_flex.bucket_rows(n) for n in (1, 128, 129, 4915)] == [128, 128, 256, 8192]
    assert attention_flex.bucket_keys(1) == 128 and attention_flex.bucket_keys(1024) == 1024
    sizes = list(range(1025, 131072, 37))
    buckets = [attention_flex.bucket_keys(n) for n in sizes]
    assert all(n <= b < n * 1.25 and b % 128 == 0 for n, b in zip(sizes, buckets, strict=True))
    assert len(set(buckets)) == 4 * 7  # four per octave from 1k to 128k
    # at one ratio a keys bucket meets one or two rows buckets: the shapes of 128 to 128k tokens fit the limit
    shapes = {(attention_flex.bucket_rows(round(0.15 * n) + 30), attention_flex.bucket_keys(n))
              for n in range(128, 131072, 37)}
    assert len(shapes) <= attention_flex.MAX_COMPILES


def assert_bf16_rows_on_cuda(attend, expect, totals: tuple[int, ...], gen: torch.Generator) -> None:
    """Every row set of each total, in bf16 on CUDA: `attend(q, k, v, rows)` against `expect(q, k, v,
    positions)` (float64 on the CPU), within bf16's tolerance."""
    for total in totals:
        for kind, positions in row_sets(total, gen).items():
            q, k, v = tensors(positions.numel(), total, gen, "cuda", torch.bfloat16)
            rows = rows_at(positions.cuda(), torch.bfloat16)
            out = attend(q, k[:, :, : rows.stop], v[:, :, : rows.stop], rows)
            want = expect(q.cpu(), k.cpu(), v.cpu(), positions)
            torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2, msg=f"{kind} at {total}")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("sparse", [True, False])
def test_cuda_paths_in_bf16_match_attention_by_hand(sparse: bool) -> None:
    att = Attention(SCALE, torch.device("cuda"), sparse=sparse)
    assert_bf16_rows_on_cuda(att, lambda q, k, v, positions: reference(q, k, v, positions)[0], (300, 2100),
                             torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_compiled_flex_on_the_cpu_matches_the_eager_call() -> None:
    """The CUDA path's compiled call, compiled for the CPU (about half a minute): the same numbers."""
    gen = torch.Generator().manual_seed(5)
    positions = row_sets(700, gen)["scattered-257"]  # a row block of padding only, too
    q, k, v = tensors(positions.numel(), int(positions[-1]) + 1, gen)
    p = attention_flex.plan(positions)
    eager = attention_flex.FlexRows(SCALE, compiled=False)(q, k, v, p)
    compiled = attention_flex.FlexRows(SCALE, compiled=True)(q, k, v, p)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.double(), reference(q, k, v, positions)[0], atol=2e-5, rtol=1e-5)


def test_a_failing_flex_kernel_falls_back_to_the_dense_mask_for_good() -> None:
    """A fake kernel that raises stands for a GPU image whose Triton cannot compile FlexAttention."""
    def broken_kernel(*args, **kwargs):
        raise RuntimeError("no Triton here")

    att = Attention(SCALE, torch.device("cpu"))
    att.flex = attention_flex.FlexRows(SCALE, compiled=False)
    att.flex.kernel = broken_kernel
    gen = torch.Generator().manual_seed(9)
    positions = row_sets(300, gen)["scattered"]
    q, k, v = tensors(positions.numel(), int(positions[-1]) + 1, gen)
    rows = rows_at(positions)
    assert att.path(rows) == "flex"
    out = att(q, k, v, rows)
    assert att.flex is None and att.path(rows) == "dense"
    torch.testing.assert_close(out.double(), reference(q, k, v, positions)[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_probe_probabilities_from_the_kernels_log_sum_exp_are_the_softmax(device: str) -> None:
    """The probe's scores onto the first N keys (the context, seen by every question row), normalised by
    `with_lse`'s log-sum-exp over all the keys each row sees: the softmax's own probabilities."""
    from kvfuse.fusion.methods import scoring

    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows, keys, n = 30, 500, 400
    q, k, v = tensors(rows, keys, gen, device, dtype)
    _, lse = attention.with_lse(q, k, v, SCALE)
    probs = scoring.probs_from_lse(q, k[:, :, :n], lse, SCALE)
    want = scoring.attention_probs(q, torch.arange(keys - rows, keys, device=device), k, SCALE)[:, :, :n]
    assert probs.dtype == torch.float32 and probs.shape == (H, rows, n)
    tol = dict(atol=1e-3, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(probs, want, **tol)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["anchor", "cacheblend"])
def test_a_fused_prefill_through_flex_equals_the_blocked_kernel(engine, prompt, method: str) -> None:
    """The real model's fused prefill at r = 0.15 with the CUDA path's FlexAttention (run eagerly here)
    in place of the CPU's blocked kernel: the same logits and selection."""
    from kvfuse.fusion import FusionOptions

    options = FusionOptions(method=method, recompute_ratio=0.15)
    blocked = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids, options)
    kept = engine.tf.attention
    flex = Attention(engine.tf.scale, torch.device("cpu"))
    flex.flex = attention_flex.FlexRows(engine.tf.scale, compiled=False)
    engine.tf.attention = flex
    try:
        fused = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids, options)
    finally:
        engine.tf.attention = kept
    assert flex.flex is not None  # it ran, and did not fall back
    assert torch.equal(fused.selected, blocked.selected)
    torch.testing.assert_close(fused.logits, blocked.logits, atol=1e-4, rtol=0)
