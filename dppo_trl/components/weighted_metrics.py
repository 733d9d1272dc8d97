"""TRL's logged metrics re-estimated on the kept rows: the loss pass's means (``entropy``, the clip ratios,
``cispo_clip_ratio``, ``vespo/phi_seq_mean``) and the vLLM importance-sampling ratio with its ``sampling/*``
metrics, each a Horvitz-Thompson estimate of GRPO's value (``dppo_trl.core.metrics``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..core.batch import loss_mask
from ..core.estimator import loss_type_record
from ..core.metrics import SAMPLING_METRICS, mean_of_rank_means, ratio, weighted_mean_stats
from ..core.trl_formulas import clip_indicators, sequence_log_ratio, vllm_importance_sampling_ratio
from .view import TrainerView


@dataclasses.dataclass(frozen=True)
class PolicyRatioSettings:
    """The TRL trainer's settings of its policy ratio and of the vLLM correction, as it resolved them.

    Args:
        loss_type: TRL's ``loss_type``.
        epsilon_low, epsilon_high: the clip range.
        importance_sampling_level: ``token`` or ``sequence``.
        vllm_mode, vllm_clip_min, vllm_clip_max: the vLLM importance-sampling correction.
        vespo: TRL's ``get_gamma_weights`` keyword arguments of the VESPO loss (``k_pos``, ...).
    """

    loss_type: str
    epsilon_low: float
    epsilon_high: float
    importance_sampling_level: str
    vllm_mode: str
    vllm_clip_min: float | None
    vllm_clip_max: float | None
    vespo: dict = dataclasses.field(default_factory=dict)


class WeightedMetrics:
    """Puts Horvitz-Thompson estimates of GRPO's values in place of TRL's means over the kept rows.

    Args:
        settings: the TRL trainer's ``PolicyRatioSettings`` as they stand at the call (TRL reads its attributes at
            each use; a user may change the vLLM correction's mode between batches).
        view: the trainer (``components.view.TrainerView``).
        gamma_weights: TRL's VESPO weights (``GRPOTrainer.get_gamma_weights``).
    """

    def __init__(self, settings: Callable[[], PolicyRatioSettings], view: TrainerView,
                 gamma_weights: Callable | None = None):
        self.settings, self.view, self.gamma_weights = settings, view, gamma_weights

    @torch.no_grad()
    def log_loss_metrics(self, inputs, advantages, logps, entropies, mask, weight) -> None:
        """Replace TRL's plain means over the kept rows (``entropy``, ``clip_ratio/*_mean``, ``cispo_clip_ratio``,
        ``vespo/phi_seq_mean``) by their Horvitz-Thompson estimates of GRPO's values; the clip conditions are
        TRL's, on the unweighted advantages."""
        s = self.settings()
        old = inputs.get("old_per_token_logps")
        log_ratio = logps.detach() - (logps.detach() if old is None else old)
        log_weights = sequence_log_ratio(log_ratio, mask) if s.importance_sampling_level == "sequence" else log_ratio
        coef_1, a = torch.exp(log_weights), (advantages if advantages.dim() > 1 else advantages.unsqueeze(1))
        values = {"entropy": entropies}
        clip_metric = loss_type_record(s.loss_type).clip_metric
        if clip_metric == "ppo":
            values.update(clip_indicators(coef_1, a, s.epsilon_low, s.epsilon_high))
        elif clip_metric == "cispo":
            values["cispo_clip_ratio"] = (coef_1 > s.epsilon_high) & (a > 0)
        elif clip_metric == "vespo":
            values["vespo/phi_seq_mean"] = self.gamma_weights(
                advantages=a, log_ratio_per_token=log_ratio, mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"), **s.vespo,
            )
        stats = torch.stack([weighted_mean_stats(v.float(), mask, weight) for v in values.values()])
        stats = self.view.reduce_sum(stats.to(self.view.device)).cpu()
        for name, row in zip(values, stats):
            self.view.replace_metric(name, ratio(row))  # TRL's value of this micro-batch

    def recompute_vllm_importance_sampling(self, output: dict, rows: torch.Tensor) -> None:
        """TRL built the vLLM IS ratio (and its ``sampling/*`` metrics) from the deferred placeholder: rebuild
        both from the real old-policy log-probs of the forwarded ``rows``. The means follow TRL's definition, the
        mean over ranks of each rank's mean, each rank's (over the rows it generated, wherever they train now) as
        a Horvitz-Thompson weighted mean. Called on every rank: it gathers."""
        s = self.settings()
        mask = loss_mask(output)
        old, sampled, mask = output["old_per_token_logps"][rows], output["sampling_per_token_logps"][rows], mask[rows]
        weight = output["dppo_weight"][rows]
        ratio_ = vllm_importance_sampling_ratio(old, sampled, mask, s.vllm_mode, s.vllm_clip_min, s.vllm_clip_max)
        output["importance_sampling_ratio"][rows] = ratio_.to(output["importance_sampling_ratio"].dtype)
        scored = mask.bool() & ~torch.isnan(sampled)
        delta = (old - sampled).abs()
        origin = output["dppo_origin_rank"][rows]
        per_rank = torch.stack([
            torch.stack([
                weighted_mean_stats(torch.nan_to_num(delta)[mine], scored[mine], weight[mine]),
                weighted_mean_stats(ratio_[mine], mask[mine], weight[mine]),
            ])
            for mine in (origin == rank for rank in range(self.view.world_size))
        ])
        per_rank = self.view.reduce_sum(per_rank.to(self.view.device)).cpu()
        delta = delta[scored]
        ratios = ratio_.flatten() if ratio_.size(1) == 1 else ratio_[mask.bool()]
        extremes = self._gathered_extremes({
            "sampling/sampling_logp_difference/max": (delta, "max"),
            "sampling/importance_sampling_ratio/min": (ratios, "min"),
            "sampling/importance_sampling_ratio/max": (ratios, "max"),
        })
        means = {
            "sampling/sampling_logp_difference/mean": mean_of_rank_means(per_rank[:, 0]),
            "sampling/importance_sampling_ratio/mean": mean_of_rank_means(per_rank[:, 1]),
        }
        self._replace_sampling_metrics(means, extremes)

    def _replace_sampling_metrics(self, means: dict, extremes: dict) -> None:
        """Put the re-estimated ``sampling/*`` values in place of TRL's; a value without an estimate gets no entry
        (neither TRL's value nor 0)."""
        view = self.view
        if means["sampling/importance_sampling_ratio/mean"] is None:  # no kept row on any rank
            for name in SAMPLING_METRICS:
                view.drop_metric(name)
            return
        # None: kept rows, but no scored token; infinite: kept rows, but none with a token the sampler scored
        values = {**means, **{name: v if math.isfinite(v) else None for name, v in extremes.items()}}
        for name, value in values.items():
            if value is None:
                view.drop_metric(name)
            else:
                view.replace_metric(name, value)

    def _gathered_extremes(self, local: dict) -> dict:
        """``{name: (values, "max" | "min")}`` -> ``{name: the max or min over every rank's values}``; a rank
        without values sends the reduction's identity (-inf for a max, +inf for a min)."""
        out = {}
        for name, (values, reduce) in local.items():
            empty = -math.inf if reduce == "max" else math.inf
            value = float(getattr(values, reduce)()) if values.numel() else empty
            gathered = self.view.gather(torch.tensor([value], device=self.view.device))
            out[name] = float(getattr(gathered, reduce)())
        return out
