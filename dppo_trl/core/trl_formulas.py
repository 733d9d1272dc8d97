"""TRL's formulas that DPPO re-evaluates on its own rows (the kept rows, after pruning). These follow TRL 1.16
(``trl/trainer/grpo_trainer.py``); re-check each on every TRL upgrade (``tests/test_trl_contract.py`` checks the
TRL attributes DPPO reads and writes; the differential tests check the values)."""

from __future__ import annotations

import math

import torch


def adaptive_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """TRL's adaptive entropy controller, one optimizer step: raise the coefficient by ``delta`` (up to ``high``)
    while the window's entropy is at or below ``target``, lower it (down to ``low``) otherwise."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def vllm_importance_sampling_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio ``pi_old / pi_sampler`` for rows whose old-policy log-probs exist
    only after pruning: per token ``(B, T)`` for ``token_*`` modes, per sequence ``(B, 1)`` for ``sequence_*``;
    ``*_truncate`` clamps to ``[clip_min, clip_max]``, ``*_mask`` zeroes ratios outside it. Tokens the sampler
    could not score (NaN) get no correction."""
    log_ratio = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence_"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode in ("token_truncate", "sequence_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("token_mask", "sequence_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(
        f"vllm_importance_sampling_mode={mode!r} is invalid: expected one of "
        "'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask'."
    )
