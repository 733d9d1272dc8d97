"""Horvitz-Thompson estimates of TRL's logged means (and of a token quantile) over the full generation batch, from
the kept rows.

No TRL import. TRL logs token means (``sum x * mask / sum mask``) or, for one value per sequence, row means.
On a pruned batch each kept row stands for ``w = 1 / pi`` rows (times its prompt weight), so the estimate of
GRPO's value is ``sum w x mask / sum w mask``: a ratio of two unbiased totals, consistent (not exactly
unbiased). Filler rows (``w = 0``, no loss token) count in neither sum.
"""

from __future__ import annotations

import torch

# TRL's metrics of the vLLM importance-sampling correction, which DPPO rebuilds from the kept rows.
SAMPLING_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def drop_last_entry(metrics: dict, name: str) -> None:
    """Remove the value last appended to ``metrics[name]``, and the key once it holds none (TRL logs the mean of
    each key's values since the last log: a key without values would be a division by zero)."""
    values = metrics.get(name)
    if values:
        values.pop()
    if name in metrics and not metrics[name]:
        del metrics[name]


def weighted_mean_stats(values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[sum w x mask, sum w mask]`` over a micro-batch (to be summed over ranks, then divided): token level
    for ``values`` of shape (B, T); one value per row for shape (B, 1), every row counted as TRL counts it (a row
    with no loss token too; fillers have ``w = 0``)."""
    w = weights.detach().to(torch.float64)
    x = values.detach().to(torch.float64)
    if x.dim() == 2 and x.size(1) == 1:
        return torch.stack([(w * x.squeeze(1)).sum(), w.sum()])
    m = mask.to(torch.float64) * w.unsqueeze(1)
    return torch.stack([(x * m).sum(), m.sum()])


def ratio(stats: torch.Tensor) -> float:
    """``sum / count`` of reduced ``weighted_mean_stats`` (0 when nothing was counted)."""
    return float(stats[0] / stats[1]) if float(stats[1]) > 0 else 0.0


def mean_of_rank_means(stats: torch.Tensor) -> float | None:
    """TRL's multi-rank mean of a per-rank mean (``gather(rank_mean).mean()``): the mean, over the ranks with
    something counted, of each rank's ``sum / count``; None when no rank counted anything.

    Args:
        stats: (P, 2) each rank's reduced ``weighted_mean_stats``.
    """
    counted = stats[:, 1] > 0
    if not bool(counted.any()):
        return None
    return float((stats[counted, 0] / stats[counted, 1]).mean())
