"""``GRPOTrainer`` as DPPO needs to know it: how its rewards make advantages. Mirrors TRL 1.16
(``trl/trainer/grpo_trainer.py``, ``_generate_and_score_completions``); ``tests/test_adapter_contract.py`` holds each
copy against TRL's tensors, so a TRL upgrade that changes one fails a named test."""

from __future__ import annotations

import dataclasses

import torch

from ..core.pruning import zero_spread_rows


@dataclasses.dataclass(frozen=True)
class GRPORewards:
    """GRPO's rewards of a generation batch.

    Args:
        weights: (F,) TRL's ``reward_weights``.
        group_size: ``num_generations``.
        aggregation: TRL's ``multi_objective_aggregation``.
    """

    weights: torch.Tensor
    group_size: int
    aggregation: str = "sum_then_normalize"

    def aggregate(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """(N,) TRL's weighted reward sums of (N, F) ``rewards_per_func``, NaN where every function gave None."""
        rewards = (rewards_per_func * self.weights.to(rewards_per_func.device)).nansum(1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards.cpu()

    def zero_advantage_rows(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """(N,) bool: the rows whose advantage is exactly 0 in exact arithmetic (TRL's float32 A can be 1e-4 there):
        under ``sum_then_normalize`` the rows of a group whose weighted reward sums have zero spread; under
        ``normalize_then_sum`` (each function normalized within its group, then summed) those of a group where
        every weighted function has zero spread."""
        if self.aggregation == "sum_then_normalize":
            return zero_spread_rows(self.aggregate(rewards_per_func), self.group_size)
        per_func = rewards_per_func.cpu()
        weighted = [k for k, weight in enumerate(self.weights.tolist()) if weight != 0.0]
        spreads = [zero_spread_rows(per_func[:, k], self.group_size) for k in weighted]
        return torch.stack(spreads, 1).all(1) if spreads else torch.ones(per_func.size(0), dtype=torch.bool)
