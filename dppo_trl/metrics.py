"""Horvitz-Thompson estimates of TRL's logged means over the full generation batch, from the kept rows.

No TRL import. TRL logs token means (``sum x * mask / sum mask``) or, for one value per sequence, row means.
On a pruned batch each kept row stands for ``w = 1 / pi`` rows (times its prompt weight), so the estimate of
GRPO's value is ``sum w x mask / sum w mask``: a ratio of two unbiased totals, consistent (not exactly
unbiased). Filler rows (``w = 0``, no loss token) count in neither sum.
"""

from __future__ import annotations

import torch


def weighted_mean_stats(values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[sum w x mask, sum w mask]`` over a micro-batch (to be summed over ranks, then divided): token level
    for ``values`` of shape (B, T); one value per row for shape (B, 1) (a row with no loss token counts 0)."""
    w = weights.detach().to(torch.float64)
    x = values.detach().to(torch.float64)
    if x.dim() == 2 and x.size(1) == 1:
        present = (mask.sum(-1) > 0).to(torch.float64)
        return torch.stack([(w * present * x.squeeze(1)).sum(), (w * present).sum()])
    m = mask.to(torch.float64) * w.unsqueeze(1)
    return torch.stack([(x * m).sum(), m.sum()])


def ratio(stats: torch.Tensor) -> float:
    """``sum / count`` of reduced ``weighted_mean_stats`` (0 when nothing was counted)."""
    return float(stats[0] / stats[1]) if float(stats[1]) > 0 else 0.0
