"""Token choice for a batch on the device (kvfuse/fusion/engine/sampling.py): each row's choice is the one it
gets alone (greedy and seeded nucleus rows mixed), a seed repeats its draws, and the draws follow the
temperature-scaled, top-p-truncated distribution."""

from __future__ import annotations

import torch

from kvfuse.fusion.engine import sampling
from kvfuse.fusion.engine.sampling import RowSampling

VOCAB = 500


def _rows() -> list[RowSampling]:
    return [RowSampling.create(0.0, 1.0, None, torch.device("cpu")),
            RowSampling.create(0.8, 0.9, 11, torch.device("cpu")),
            RowSampling.create(1.3, 1.0, 12, torch.device("cpu")),
            RowSampling.create(0.7, 0.5, 11, torch.device("cpu"))]


def test_each_row_of_a_batch_chooses_what_it_chooses_alone() -> None:
    logits = torch.randn(12, 4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    batch_rows, solo_rows = _rows(), _rows()
    together = [sampling.choose(step, batch_rows).tolist() for step in logits]
    alone = [[int(sampling.choose(step[i : i + 1], [solo_rows[i]])[0]) for i in range(4)] for step in logits]
    assert together == alone
    assert together[0][0] == int(logits[0, 0].argmax())  # the greedy row
    assert len({tuple(t[1:]) for t in together}) > 1  # the sampled rows do vary


def test_a_seed_repeats_its_draws_and_another_seed_differs() -> None:
    logits = torch.zeros(1, VOCAB)

    def draws(seed: int) -> list[int]:
        row = RowSampling.create(1.0, 1.0, seed, torch.device("cpu"))
        return [int(sampling.choose(logits, [row])[0]) for _ in range(20)]

    assert draws(3) == draws(3) != draws(4)


def test_draws_follow_the_tempered_top_p_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = (probs.log() * 0.5).view(1, -1)  # at temperature 0.5 these are the probabilities again
    row = RowSampling.create(0.5, 1.0, 7, torch.device("cpu"))
    n = 4000
    counts = torch.bincount(torch.tensor([int(sampling.choose(logits, [row])[0]) for _ in range(n)]), minlength=4)
    torch.testing.assert_close(counts / n, probs, atol=0.03, rtol=0)
    cut = RowSampling.create(0.5, 0.7, 7, torch.device("cpu"))  # 0.5 + 0.3 reaches 0.7: two tokens kept
    counts = torch.bincount(torch.tensor([int(sampling.choose(logits, [cut])[0]) for _ in range(n)]), minlength=4)
    assert counts[2:].sum() == 0
    torch.testing.assert_close(counts[:2] / n, torch.tensor([0.625, 0.375]), atol=0.03, rtol=0)
