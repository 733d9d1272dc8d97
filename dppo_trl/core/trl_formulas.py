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


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's sequence-level importance weight's log (``importance_sampling_level='sequence'``): the mean of each
    row's token log-ratios over its loss tokens.

    Args:
        log_ratio: (B, T) per-token ``log pi - log pi_old``.
        mask: (B, T) the loss tokens.

    Returns:
        (B, 1).
    """
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def k3_kl(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """TRL's per-token KL estimate ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's k3), (B, T)."""
    return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1


def clip_indicators(coef: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float) -> dict:
    """TRL's ``clip_ratio/*`` conditions of the clipped objectives: ``(B, T)`` booleans, the low clip (``coef < 1 -
    eps_low`` and ``A < 0``), the high clip (``coef > 1 + eps_high`` and ``A > 0``), and either."""
    low, high = (coef < 1 - epsilon_low) & (advantages < 0), (coef > 1 + epsilon_high) & (advantages > 0)
    return {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
