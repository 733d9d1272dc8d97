"""Pure helpers: weighted metric estimates (dppo_trl.core.metrics) and batch-dict operations (dppo_trl.core.batch)."""

import torch

from dppo_trl.core.batch import filler_row, pad_to_width, with_fillers
from dppo_trl.core.metrics import ratio, weighted_mean_stats


def test_weighted_token_mean_counts_each_kept_row_w_times_and_fillers_never():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0], [100.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])  # the last row is a filler: no loss token
    weights = torch.tensor([2.0, 1.0, 0.0])
    stats = weighted_mean_stats(values, mask, weights)
    assert stats.tolist() == [2 * (1 + 3) + 5, 2 * 2 + 1]
    assert ratio(stats) == 13 / 5
    # With every weight 1 it is TRL's masked mean.
    assert ratio(weighted_mean_stats(values, mask, torch.ones(3))) == (1 + 3 + 5) / 3


def test_weighted_sequence_mean_counts_every_row_as_trl_does():
    """One value per row: TRL's global mean counts every row, one without loss tokens too (issue 19); a filler
    (weight 0) counts nowhere."""
    values = torch.tensor([[0.5], [1.5], [9.0], [100.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0]])
    assert ratio(weighted_mean_stats(values, mask, torch.tensor([3.0, 1.0, 1.0, 0.0]))) == (1.5 + 1.5 + 9.0) / 5
    assert ratio(torch.zeros(2)) == 0.0


def test_weighted_totals_are_unbiased_over_poisson_masks():
    """E[sum_kept x / pi] = sum x: the numerator and denominator of every estimate are unbiased totals."""
    import itertools

    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    pi = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    expected = torch.zeros(2, dtype=torch.float64)
    for bits in itertools.product([0, 1], repeat=3):
        keep = torch.tensor(bits, dtype=torch.bool)
        prob = float(torch.where(keep, pi, 1 - pi).prod())
        expected += prob * weighted_mean_stats(values, mask, torch.where(keep, 1 / pi, torch.zeros_like(pi)))
    torch.testing.assert_close(expected, weighted_mean_stats(values, mask, torch.ones(3)), rtol=1e-12, atol=1e-12)


def test_filler_rows_cost_one_token_and_contribute_nothing():
    batch = {
        "prompt_ids": torch.tensor([[0, 4, 5], [6, 7, 8]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[9, 9], [3, 0]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        "advantages": torch.tensor([1.0, -2.0]),
        "importance_sampling_ratio": torch.tensor([[0.5, 2.0], [1.5, 1.0]]),
        "num_items_in_batch": torch.tensor(3),
    }
    filler = filler_row(batch)
    assert filler["prompt_mask"].tolist() == [[0, 0, 1]] and filler["completion_mask"].sum() == 0
    assert filler["advantages"].tolist() == [0.0] and filler["importance_sampling_ratio"].tolist() == [[1.0, 1.0]]
    grown = with_fillers(batch, filler, 4)
    assert grown["prompt_ids"].size(0) == 4 and grown["num_items_in_batch"] is batch["num_items_in_batch"]
    assert with_fillers(batch, filler, 2) is batch


def test_pad_to_width_pads_prompts_left_and_completions_right():
    batch = {
        "prompt_ids": torch.tensor([[4, 5]]),
        "prompt_mask": torch.tensor([[1, 1]]),
        "completion_ids": torch.tensor([[6, 7]]),
        "importance_sampling_ratio": torch.tensor([[0.5, 2.0]]),
        "advantages": torch.tensor([1.0]),
    }
    assert pad_to_width(batch, "prompt_ids", 4, 3, 0, False).tolist() == [[0, 0, 4, 5]]
    assert pad_to_width(batch, "prompt_mask", 4, 3, 0, False).tolist() == [[0, 0, 1, 1]]
    assert pad_to_width(batch, "completion_ids", 4, 3, 0, False).tolist() == [[6, 7, 0]]
    assert pad_to_width(batch, "importance_sampling_ratio", 4, 3, 0, False).tolist() == [[0.5, 2.0, 1.0]]
    assert pad_to_width(batch, "advantages", 4, 3, 0, False).tolist() == [1.0]
    sequence = dict(batch, importance_sampling_ratio=torch.tensor([[0.75]]))
    assert pad_to_width(sequence, "importance_sampling_ratio", 4, 3, 0, True).tolist() == [[0.75]]
