"""TRL's logged metrics re-estimated on the kept rows: the loss pass's means (``entropy``, the clip ratios,
``cispo_clip_ratio``, ``vespo/phi_seq_mean``) and the vLLM importance-sampling ratio with its ``sampling/*``
metrics, each a Horvitz-Thompson estimate of GRPO's value (``dppo_trl.core.metrics``).

Reads of the host trainer: ``args``, ``accelerator``, ``loss_type``, ``epsilon_low``, ``epsilon_high``,
``importance_sampling_level``, ``vllm_importance_sampling_mode``, ``vllm_importance_sampling_clip_min``,
``vllm_importance_sampling_clip_max``, ``get_gamma_weights`` (TRL's VESPO weights), ``_metrics``."""

from __future__ import annotations

import math

import torch

from ..core.batch import loss_mask
from ..core.estimator import loss_type_record
from ..core.metrics import SAMPLING_METRICS, drop_last_entry, mean_of_rank_means, ratio, weighted_mean_stats
from ..core.trl_formulas import clip_indicators, sequence_log_ratio, vllm_importance_sampling_ratio


class WeightedMetrics:
    """Mixed into ``DPPOTrainer``."""

    @torch.no_grad()
    def _log_weighted_loss_metrics(self, inputs, advantages, logps, entropies, mask, weight) -> None:
        """Replace TRL's plain means over the kept rows (``entropy``, ``clip_ratio/*_mean``, ``cispo_clip_ratio``,
        ``vespo/phi_seq_mean``) by their Horvitz-Thompson estimates of GRPO's values; the clip conditions are
        TRL's, on the unweighted advantages."""
        old = inputs.get("old_per_token_logps")
        log_ratio = logps.detach() - (logps.detach() if old is None else old)
        log_weights = log_ratio
        if self.importance_sampling_level == "sequence":
            log_weights = sequence_log_ratio(log_ratio, mask)
        coef_1, a = torch.exp(log_weights), (advantages if advantages.dim() > 1 else advantages.unsqueeze(1))
        values = {"entropy": entropies}
        clip_metric = loss_type_record(self.loss_type).clip_metric
        if clip_metric == "ppo":
            values.update(clip_indicators(coef_1, a, self.epsilon_low, self.epsilon_high))
        elif clip_metric == "cispo":
            values["cispo_clip_ratio"] = (coef_1 > self.epsilon_high) & (a > 0)
        elif clip_metric == "vespo":
            args = self.args
            values["vespo/phi_seq_mean"] = self.get_gamma_weights(
                advantages=a,
                log_ratio_per_token=log_ratio,
                mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                k_pos=args.vespo_k_pos,
                lambda_pos=args.vespo_lambda_pos,
                k_neg=args.vespo_k_neg,
                lambda_neg=args.vespo_lambda_neg,
            )
        stats = torch.stack([weighted_mean_stats(v.float(), mask, weight) for v in values.values()])
        stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum").cpu()
        metrics = self._metrics["train"]
        for name, row in zip(values, stats):
            metrics[name][-1] = ratio(row)  # replaces TRL's value of this micro-batch

    def _recompute_vllm_importance_sampling(self, output, rows):
        """TRL built the vLLM IS ratio (and its ``sampling/*`` metrics) from the deferred placeholder: rebuild
        both from the real old-policy log-probs of the forwarded rows. The means follow TRL's definition, the mean
        over ranks of each rank's mean, each rank's (over the rows it generated, wherever they train now) as a
        Horvitz-Thompson weighted mean."""
        mask = loss_mask(output)
        old, sampled, mask = output["old_per_token_logps"][rows], output["sampling_per_token_logps"][rows], mask[rows]
        weight = output["dppo_weight"][rows]
        ratio_ = vllm_importance_sampling_ratio(
            old,
            sampled,
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        output["importance_sampling_ratio"][rows] = ratio_.to(output["importance_sampling_ratio"].dtype)
        scored = mask.bool() & ~torch.isnan(sampled)
        delta = (old - sampled).abs()
        origin = output["dppo_origin_rank"][rows]
        per_rank = torch.stack([
            torch.stack([
                weighted_mean_stats(torch.nan_to_num(delta)[mine], scored[mine], weight[mine]),
                weighted_mean_stats(ratio_[mine], mask[mine], weight[mine]),
            ])
            for mine in (origin == rank for rank in range(self.accelerator.num_processes))
        ])
        per_rank = self.accelerator.reduce(per_rank.to(self.accelerator.device), reduction="sum").cpu()
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
        metrics = self._metrics["train"]
        if means["sampling/importance_sampling_ratio/mean"] is None:  # no kept row on any rank
            for name in SAMPLING_METRICS:
                drop_last_entry(metrics, name)
            return
        for name, value in means.items():  # None: kept rows, but no scored token
            if value is None:
                drop_last_entry(metrics, name)
            else:
                metrics[name][-1] = value
        for name, value in extremes.items():  # infinite: kept rows, but none with a token the sampler scored
            if math.isfinite(value):
                metrics[name][-1] = value
            else:
                drop_last_entry(metrics, name)

    def _gathered_extremes(self, local: dict) -> dict:
        """``{name: (values, "max" | "min")}`` -> ``{name: the max or min over every rank's values}``; a rank
        without values sends the reduction's identity (-inf for a max, +inf for a min)."""
        out = {}
        for name, (values, reduce) in local.items():
            empty = -math.inf if reduce == "max" else math.inf
            value = float(getattr(values, reduce)()) if values.numel() else empty
            gathered = self.accelerator.gather(torch.tensor([value], device=self.accelerator.device))
            out[name] = float(getattr(gathered, reduce)())
        return out
