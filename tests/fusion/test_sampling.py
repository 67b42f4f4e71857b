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


def _adjusted_rows() -> list[RowSampling]:
    cpu = torch.device("cpu")
    return [RowSampling.create(0.0, 1.0, None, cpu, logit_bias={"3": -100, "7": 5.0}),
            RowSampling.create(0.9, 0.95, 21, cpu, logit_bias={3: -100}, frequency_penalty=1.5),
            RowSampling.create(0.0, 1.0, None, cpu, presence_penalty=2.0),
            RowSampling.create(1.1, 1.0, 22, cpu)]  # no adjustment beside adjusted rows


def test_biases_and_penalties_are_each_rows_own_and_a_batch_chooses_as_each_row_alone() -> None:
    logits = torch.randn(10, 4, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    logits[:, :, 3] += 50  # every row's favourite, banned for rows 0 and 1...
    logits[:, 2, 3] = float("-inf")
    logits[:, 2, 3] = logits[:, 2].max(dim=-1).values + 1.0  # ...and row 2's by a lead its penalty outweighs
    batch_rows, solo_rows = _adjusted_rows(), _adjusted_rows()
    together = [sampling.choose(step, batch_rows).tolist() for step in logits]
    alone = [[int(sampling.choose(step[i : i + 1], [solo_rows[i]])[0]) for i in range(4)] for step in logits]
    assert together == alone
    assert all(t[0] != 3 and t[1] != 3 for t in together)  # a banned token never appears
    # presence_penalty 2: the model's logit less 2 once a token was used, the greedy choice of those
    assert together[0][2] == 3 and together[1][2] != 3
    used = torch.zeros(VOCAB, dtype=torch.bool)
    for step, t in zip(logits, together, strict=True):
        assert t[2] == int((step[2] - 2.0 * used.float()).argmax())
        used[t[2]] = True
    assert any(t[2] != int(step[2].argmax()) for step, t in zip(logits, together, strict=True))
    # the bias alone, greedy: logits + bias, argmax
    biased = logits[:, 0].clone()
    biased[:, 3] = float("-inf")
    biased[:, 7] += 5.0
    assert [t[0] for t in together] == biased.argmax(dim=-1).tolist()


def test_frequency_penalty_counts_each_use() -> None:
    row = RowSampling.create(0.0, 1.0, None, torch.device("cpu"), frequency_penalty=0.6)
    logits = torch.zeros(1, VOCAB)
    logits[0, :3] = torch.tensor([2.0, 1.5, 0.0])
    picks = [int(sampling.choose(logits, [row])[0]) for _ in range(4)]
    # 2.0 > 1.5; then 1.4 < 1.5; then 1.4 > 0.9; then 0.8 < 0.9
    assert picks == [0, 1, 0, 1] and row.counts[:2].tolist() == [2.0, 2.0]


def test_a_bias_outside_the_vocabulary_is_refused() -> None:
    row = RowSampling.create(0.0, 1.0, None, torch.device("cpu"), logit_bias={VOCAB + 1: 1.0})
    try:
        sampling.choose(torch.zeros(1, VOCAB), [row])
    except ValueError as err:
        assert "outside the vocabulary" in str(err)
    else:
        raise AssertionError("a bias past the vocabulary was accepted")
