"""``DPPOTrainer``: TRL's ``GRPOTrainer`` with unbiased completion pruning, Dense Prompt Packing and prompt
pruning wired into its hooks.

- ``_generate_and_score_completions``: TRL generates, scores and computes advantages on the FULL groups; the
  old-policy and reference log-prob passes it would run before scoring are only recorded, then run after
  the keep mask is drawn, on the kept rows alone.
- ``_prepare_inputs``: TRL's shuffle, then the kept rows (not TRL's equal split of all rows) make the
  ``steps_per_generation`` micro-batches, balanced by tokens when packing (TRL's own split under the entropy
  filter); each row carries its micro-batch of TRL's split, whose token count ``bnpo`` and the entropy bonus
  divide by, so no statistic is taken over a packing bin.
- ``_get_per_token_logps_and_entropies``: defers the passes during generation; with packing, runs them
  padding-free (several sequences per row, position_ids restarting per sequence) and unpacks the result
  into TRL's padded ``(B, T)`` layout, so TRL's loss code runs unchanged.
- ``_compute_loss``: TRL's loss with each kept row's advantage scaled by its Horvitz-Thompson weight, rescaled
  to the full-batch normalizer; the KL term (``beta > 0``) and the entropy bonus are weighted the same way and
  added beside it, with the MoE router loss of the forwarded rows; TRL's logged means become weighted ones.
- ``get_high_entropy_mask``: the entropy filter's quantile, weighted.
- ``_calculate_rewards``: remembers the rewards (rows whose A is 0 in exact arithmetic score 0; the
  ``zero_variance`` filter).
- Prompt pruning: ``dppo_trl.hooks.prompt_pruning`` (the sampler, the schedule and progress bar that follow data
  progress in epoch-based runs, the sampler's state in checkpoints).
- The gradient audit (``audit_every``): ``dppo_trl.hooks.audit`` (GRPO's and DPPO's gradients of an audited
  generation batch at the same parameters, sketched and compared, training untouched).

The math lives in ``dppo_trl.core.pruning``, ``dppo_trl.core.packing``, ``dppo_trl.core.prompts``, ``dppo_trl.core.metrics``,
``dppo_trl.core.audit`` and ``dppo_trl.core.batch``; with
``completion_keep_rate=1.0``, ``prompt_keep_rate=1.0`` and ``packing=False`` every hook is TRL's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from accelerate.utils import broadcast_object_list
from datasets import IterableDataset
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict, use_adapter

from .hooks.audit import GradientAuditHooks
from .core.batch import (
    filler_row,
    loss_mask,
    microbatch_token_counts,
    pad_to_width,
    select_rows,
    trl_microbatch_of_rows,
    with_fillers,
)
from .hooks.callbacks import DataProgressBarCallback, DPPOSummaryCallback
from .config import DPPOConfig, as_dppo_config
from .core.estimator import (
    SEQUENCE_MEAN_LOSS_TYPES,
    effective_sample_size,
    full_batch_normalizer,
    horvitz_thompson_weights,
    trl_microbatch_normalizer,
    trl_microbatch_token_scale,
)
from .core.metrics import (
    SAMPLING_METRICS,
    drop_last_entry,
    mean_of_rank_means,
    ratio,
    weighted_mean_stats,
    weighted_quantile,
)
from .core.packing import (
    balance_ranks,
    default_packed_tokens,
    exchange_plan,
    is_varlen_attention,
    microbatch_plan,
    pack_call,
    packed_allocation,
    packed_inputs,
    plan_calls_per_rank,
    rank_imbalance,
    varlen_kwargs,
)
from .core.seeds import derive_seed
from .core.trl_formulas import adaptive_entropy_coef, vllm_importance_sampling_ratio
from .hooks.prompt_pruning import PromptPruningHooks
from .core.pruning import (
    PruneProblem,
    adaptive_keep_rate,
    get_design,
    pruning_relative_error,
    unbiased_designs,
    zero_spread_rows,
)


class DPPOTrainer(GradientAuditHooks, PromptPruningHooks, GRPOTrainer):
    """Drop-in replacement of ``GRPOTrainer`` that trains on a random, reweighted subset of each generation
    batch, with the same expected loss and gradient (see ``DPPOConfig`` and ``docs/estimator.md``)."""

    _tag_names = ["trl", "grpo", "dppo"]

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: DPPOConfig | GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        """``GRPOTrainer.__init__``'s parameters, names, order and defaults; a ``GRPOConfig`` is taken as the
        ``DPPOConfig`` with DPPO's defaults."""
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = DPPOConfig(f"{str(name).split('/')[-1] or 'model'}-DPPO")
        args = as_dppo_config(args)
        if args.prompt_pruning and isinstance(train_dataset, IterableDataset):  # checked before any model loads
            raise ValueError(
                f"prompt_keep_rate={args.prompt_keep_rate!r}: prompt pruning needs a map-style dataset (it keeps a "
                "history per dataset row); a streaming IterableDataset is not supported. Use prompt_keep_rate=1.0."
            )
        super().__init__(
            model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, reward_processing_classes=reward_processing_classes,
            callbacks=callbacks, optimizers=optimizers, quantization_config=quantization_config,
            peft_config=peft_config, tools=tools, rollout_func=rollout_func, environment_factory=environment_factory,
        )  # fmt: skip
        self._setup_dppo()

    def _setup_dppo(self) -> None:
        """DPPO's per-run state and callbacks, once TRL has built the trainer."""
        self._deferred_logp_calls: list | None = None
        self._captured_logps: list | None = None
        self._compute_aux_loss = False  # the MoE router loss of the loss pass, computed beside TRL's
        self._last_entropy_mask: torch.Tensor | None = None
        self._loss_row_weights: torch.Tensor | None = None  # rows' weights while DPPO's loss runs (entropy filter)
        self._trl_split_rng_state: torch.Tensor | None = None  # the CPU RNG state TRL's split was replayed from
        self._last_rewards_per_func: torch.Tensor | None = None
        self._kept_lengths_per_rank: list[list[int]] = []
        self._widths_per_rank: list[int] = []
        self._row_tokens: torch.Tensor | None = None
        self._padded_widths: torch.Tensor | None = None
        attention = getattr(self.accelerator.unwrap_model(self.model).config, "_attn_implementation", None) or ""
        self._varlen_attention = is_varlen_attention(attention)
        self.add_callback(DPPOSummaryCallback(self._audit_summary))
        if self.args.audit_every and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError(
                f"audit_every={self.args.audit_every!r} is not supported with DeepSpeed or FSDP yet (the audit takes "
                "gradients of the unsharded parameters); set audit_every=0."
            )
        if self.args.prompt_pruning and self.args.max_steps <= 0:
            self.add_callback(
                DataProgressBarCallback(self._grpo_equivalent_steps, lambda: self.callback_handler.callbacks)
            )

    # ------------------------------------------------------------------ hooks
    def _dppo_now(self) -> bool:
        return self.args.dppo_training_path and self.model.training and not self._in_grpo_reference

    def _local(self, rows_per_rank: int) -> slice:
        """This rank's rows of a batch gathered from every rank (TRL's process slice)."""
        index = self.accelerator.process_index
        return slice(index * rows_per_rank, (index + 1) * rows_per_rank)

    def _global_scores(self, output) -> torch.Tensor:
        """Every rank's advantages, gathered (a fixed-size gather), one per row: the advantage itself, or the
        largest |A| of the row where a subclass gives per-token advantages. A row whose A is 0 in exact
        arithmetic scores exactly 0 (TRL's float32 A can be 1e-4 there): under ``sum_then_normalize`` the rows of a
        group whose weighted reward sums have zero spread; under ``normalize_then_sum`` (each reward function
        normalized within its group, then summed; the batch mean of that sum is exactly 0) those of a group where
        every weighted reward function has zero spread."""
        advantages = self.accelerator.gather(output["advantages"].detach()).float().cpu()
        scores = advantages.abs().amax(dim=1) if advantages.dim() > 1 else advantages
        return torch.where(self._zero_advantage_rows(), 0.0, scores)

    def _zero_advantage_rows(self) -> torch.Tensor:
        """The rows (all ranks) whose advantage is exactly 0 in exact arithmetic, decided from the rewards."""
        if self.args.multi_objective_aggregation == "sum_then_normalize":
            return zero_spread_rows(self._aggregated_rewards(), self.num_generations)
        per_func = self._last_rewards_per_func.cpu()
        weighted = [k for k, weight in enumerate(self.reward_weights.tolist()) if weight != 0.0]
        spreads = [zero_spread_rows(per_func[:, k], self.num_generations) for k in weighted]
        return torch.stack(spreads, 1).all(1) if spreads else torch.ones(per_func.size(0), dtype=torch.bool)

    def _aggregated_rewards(self) -> torch.Tensor:
        """The generation batch's weighted reward sums (all ranks), NaN where every reward function gave None."""
        per_func = self._last_rewards_per_func
        rewards = (per_func * self.reward_weights.to(per_func.device)).nansum(1)
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
        return rewards.cpu()

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        calls = self._deferred_logp_calls
        if calls is not None:
            calls.append(model)
            placeholder = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)
            return placeholder, None, None
        if self._captured_logps is not None and self._compute_aux_loss:
            kwargs["compute_aux_loss"] = True
        if self.args.packing and self._dppo_now():
            out = self._packed_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, kwargs.get("compute_entropy", False),
                kwargs.get("compute_aux_loss", False),
            )  # fmt: skip
        else:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if self._captured_logps is not None:
            self._captured_logps.append(out)
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if not self._dppo_now():
            return super()._generate_and_score_completions(inputs)
        self._deferred_logp_calls = []
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            calls, self._deferred_logp_calls = self._deferred_logp_calls, None
        if any(key in output for key in ("pixel_values", "num_images")):
            raise NotImplementedError(
                "DPPO's training path (completion or prompt pruning, packing) does not support multimodal batches "
                "yet; set completion_keep_rate=1.0, prompt_keep_rate=1.0 and packing=False."
            )
        scores = self._global_scores(output)
        keep, weights, pi = self._draw_keep_mask(output, scores)
        if self.args.prompt_pruning:
            prompt_weights, count = self._take_prompt_decision(inputs, scores)
            weights = weights * prompt_weights
            # A token count fixed before this batch's acceptance draw (estimator.prompt_pruning_normalization).
            output["num_items_in_batch"] = torch.tensor(count, device=output["advantages"].device)
        if self.args.completion_pruning or self.args.prompt_pruning:
            self._log_pruning_metrics(output, keep, weights, pi, scores)
        local, device = self._local(output["advantages"].size(0)), output["advantages"].device
        output["dppo_keep"], output["dppo_weight"] = keep[local].to(device), weights[local].to(device)
        audit_rows = dict(output) if self._audit_this_batch() else None  # this rank's rows before any exchange
        output.update(self._trl_split_of_rows(output))
        output = self._balance_ranks(output)
        self._run_deferred_logps(output, calls, output["dppo_keep"])
        if audit_rows is not None:
            self._build_grpo_reference(audit_rows, calls, output)
        output["dppo_weight"] = output["dppo_weight"].to(torch.float32)
        return output

    def _prepare_inputs(self, generation_batch):
        if not self._dppo_now():
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            # TRL's own shuffle (which rows land in which micro-batch is DPPO's plan; the rows' TRL split was
            # replayed before the deferred passes, from self._trl_split_rng_state).
            batch = shuffle_sequence_dict(batch)
            self._buffered_inputs = self._kept_microbatches(batch)
            self._audit_generation_batch(self._trl_split_rng_state)  # nothing unless this batch is audited
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _compute_loss(self, model, inputs):
        if "dppo_weight" not in inputs:
            return super()._compute_loss(model, inputs)
        inputs = dict(inputs)
        weight = inputs.pop("dppo_weight")
        norm_args = self._normalizer_args(inputs)
        full_z = full_batch_normalizer(self.loss_type, self.args.per_device_train_batch_size, **norm_args)
        per_microbatch = self._trl_microbatch_scale(inputs.pop("dppo_trl_microbatch_tokens"), norm_args)
        policy_weight = weight * per_microbatch if self.loss_type == "bnpo" else weight
        advantages = inputs["advantages"]
        row_weight = policy_weight.to(advantages.dtype)
        # Every TRL loss_type is positively homogeneous in A per row (clipping, SAPO/VESPO gates depend on
        # sign(A) only), so A * w scales the row's policy term by w exactly, in value and gradient.
        inputs["advantages"] = advantages * (row_weight if advantages.dim() == 1 else row_weight.unsqueeze(1))
        # TRL's KL, entropy bonus and router loss are normalized per micro-batch: they are added below instead.
        beta, self.beta = self.beta, 0.0
        bonus, self._entropy_bonus_enabled = self._entropy_bonus_enabled, False
        self._compute_aux_loss, self.aux_loss_enabled = self.aux_loss_enabled, False
        self._captured_logps, self._loss_row_weights, self._last_entropy_mask = [], weight, None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = beta, bonus, self._compute_aux_loss
            captured, self._captured_logps, self._loss_row_weights = self._captured_logps, None, None
        mask = loss_mask(inputs)
        trl_z = trl_microbatch_normalizer(self.loss_type, mask.size(0), float(mask.sum()), **norm_args)
        loss = loss * (trl_z / full_z)
        logps, entropies, aux_loss = captured[0]
        if beta != 0.0:
            loss = loss + beta * self._weighted_kl(logps, inputs, mask, weight, policy_weight) / full_z
        if bonus:
            self._log_policy_loss(loss)
            tokens = full_batch_normalizer("dapo", 1, **norm_args)
            loss = loss - self._weighted_entropy_bonus(entropies, mask, weight, per_microbatch / tokens)
        if self.aux_loss_enabled:  # a regularizer of the rows forwarded, as GRPO's is of its micro-batch
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps
            self._metrics["train"]["aux_loss"].append(self.accelerator.gather(aux_loss.detach()).mean().item())
        self._log_weighted_loss_metrics(inputs, advantages, logps, entropies, mask, weight)
        return loss

    def _normalizer_args(self, inputs) -> dict:
        """What ``full_batch_normalizer`` and ``trl_microbatch_normalizer`` need beyond the loss type and rows."""
        return dict(
            max_completion_length=self.max_completion_length,
            loss_tokens_in_generation_batch=float(inputs["num_items_in_batch"]),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
            accumulation_steps=self.current_gradient_accumulation_steps,
        )

    def _trl_microbatch_scale(self, trl_microbatch_tokens, norm_args) -> torch.Tensor:
        """Per row, the factor that turns the token normalizer of a full-batch-mean micro-batch into the one of the
        row's own micro-batch in TRL's random split (``estimator.trl_microbatch_token_scale``): what ``bnpo`` and
        the entropy bonus divide by in TRL. 1 under prompt pruning, whose token count is planned (the batch GRPO
        would have drawn is never generated)."""
        if self.args.prompt_pruning:
            return torch.ones_like(trl_microbatch_tokens)
        mean = full_batch_normalizer("dapo", 1, **norm_args) / norm_args["accumulation_steps"]
        return trl_microbatch_token_scale(trl_microbatch_tokens, mean)

    def _log_policy_loss(self, loss) -> None:
        """TRL's ``policy_loss`` metric (the loss before the entropy bonus, on TRL's scale: before the division by
        the accumulation steps for the row- and micro-batch-normalized loss types), here the Horvitz-Thompson
        estimate of GRPO's."""
        scale = 1 if self.loss_type in ("cispo", "dapo", "vespo") else self.current_gradient_accumulation_steps
        policy_loss = (loss.detach() * scale).reshape(1)
        self._metrics["train"]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())

    def _weighted_entropy_bonus(self, entropies, mask, weight, per_row_normalizer) -> torch.Tensor:
        """TRL's entropy bonus ``coef x`` token-mean entropy over the tokens it acts on, in TRL's micro-batches, as
        a Horvitz-Thompson sum over the kept rows: each row's tokens over the loss tokens of the row's micro-batch
        in TRL's split (``1 / per_row_normalizer``, counted before the keep draw, so unbiased); under the entropy
        filter (where micro-batches are TRL's split) over the weighted count of this micro-batch's filtered tokens,
        TRL's count when every row is kept (a ratio estimate under pruning). The adaptive controller (TRL's rule
        and state) measures the weighted window entropy."""
        effective = mask if self._last_entropy_mask is None else mask * self._last_entropy_mask
        weighted = effective * weight.to(entropies.dtype).unsqueeze(1)
        if self._last_entropy_mask is None:
            normalized = weighted * per_row_normalizer.to(entropies.dtype).unsqueeze(1)
        else:
            count = max(float(weighted.detach().sum()), 1.0)  # TRL clamps its count at 1 too
            normalized = weighted / (count * self.current_gradient_accumulation_steps)
        apply_coef = self.entropy_coef
        if self.use_adaptive_entropy:  # the coefficient of the previous step's end, for the whole window
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            stats = torch.stack([(entropies * weighted).sum(), weighted.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (total[0] / total[1].clamp(min=1e-12)).item()
                a = self.args
                self.entropy_coef = adaptive_entropy_coef(
                    self.entropy_coef,
                    world,
                    a.entropy_target,
                    a.entropy_coef_delta,
                    a.entropy_coef_min,
                    a.entropy_coef_max,
                )
                self._last_world_entropy, self._entropy_window_stats = world, None
        if self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(self.entropy_coef)
        return apply_coef * (entropies * normalized).sum()

    def get_high_entropy_mask(self, entropies, mask, threshold):
        """TRL's entropy filter; while DPPO's loss runs on this trainer, the quantile is the Horvitz-Thompson-
        weighted quantile of the kept tokens (``metrics.weighted_quantile``, gathered over ranks). The micro-batch
        holds the kept rows of TRL's own micro-batch (``_microbatches_follow_trl_split``), so with every row kept
        it is TRL's quantile, and under pruning a consistent estimate of it. DPPO's state is read from the
        instance only: anything else (TRL's own tests call this on a ``Mock(spec=GRPOTrainer)``) gets TRL's."""
        weight = self.__dict__.get("_loss_row_weights")
        if weight is None:
            return super().get_high_entropy_mask(entropies, mask, threshold)
        real = mask.bool()
        row_weights = weight.unsqueeze(1).expand_as(entropies)[real].float()
        pairs = torch.stack([entropies[real].detach().float(), row_weights], 1)
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(pairs, dim=0, pad_index=-1.0))
        gathered = gathered[gathered[:, 0] >= 0]  # entropies are >= 0: -1 marks padding across ranks
        gathered = gathered[gathered[:, 1] > 0]
        if gathered.numel() == 0:
            self._last_entropy_mask = torch.zeros_like(real)
        else:
            cut = weighted_quantile(gathered[:, 0], gathered[:, 1], threshold).to(entropies.dtype)
            self._last_entropy_mask = (entropies * mask >= cut) & real
        return self._last_entropy_mask

    _CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

    @torch.no_grad()
    def _log_weighted_loss_metrics(self, inputs, advantages, logps, entropies, mask, weight) -> None:
        """Replace TRL's plain means over the kept rows (``entropy``, ``clip_ratio/*_mean``, ``cispo_clip_ratio``,
        ``vespo/phi_seq_mean``) by their Horvitz-Thompson estimates of GRPO's values (``dppo_trl.core.metrics``);
        the clip conditions are TRL's, on the unweighted advantages."""
        old = inputs.get("old_per_token_logps")
        log_ratio = logps.detach() - (logps.detach() if old is None else old)
        log_weights = log_ratio
        if self.importance_sampling_level == "sequence":
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1, a = torch.exp(log_weights), (advantages if advantages.dim() > 1 else advantages.unsqueeze(1))
        values = {"entropy": entropies}
        if self.loss_type in self._CLIPPED_LOSS_TYPES:
            low, high = (coef_1 < 1 - self.epsilon_low) & (a < 0), (coef_1 > 1 + self.epsilon_high) & (a > 0)
            values.update(
                {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
            )
        elif self.loss_type == "cispo":
            values["cispo_clip_ratio"] = (coef_1 > self.epsilon_high) & (a > 0)
        elif self.loss_type == "vespo":
            a_ = self.args
            values["vespo/phi_seq_mean"] = self.get_gamma_weights(
                advantages=a, log_ratio_per_token=log_ratio, mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"), k_pos=a_.vespo_k_pos,
                lambda_pos=a_.vespo_lambda_pos, k_neg=a_.vespo_k_neg, lambda_neg=a_.vespo_lambda_neg,
            )  # fmt: skip
        stats = torch.stack([weighted_mean_stats(v.float(), mask, weight) for v in values.values()])
        stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum").cpu()
        metrics = self._metrics["train"]
        for name, row in zip(values, stats):
            metrics[name][-1] = ratio(row)  # replaces TRL's value of this micro-batch

    # ------------------------------------------------------------- internals
    def _weighted_kl(self, per_token_logps, inputs, mask, weight, loss_weight) -> torch.Tensor:
        """``sum_n loss_weight_n * kl_n`` over the micro-batch (kl_n: TRL's k3 estimator, token mean or sum per
        row; ``loss_weight``: the row weights ``weight`` times, under ``bnpo``, the TRL micro-batch scale); TRL's
        ``kl`` metric weighted by ``weight``."""
        # Masked positions (fillers, padding) get ref = logp there, hence kl = 0: no overflow times a zero mask.
        ref = torch.where(mask.bool(), inputs["ref_per_token_logps"], per_token_logps.detach())
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if self.args.use_bias_correction_kl:
            old = inputs.get("old_per_token_logps")
            log_ratio = per_token_logps - (per_token_logps.detach() if old is None else old)
            if self.importance_sampling_level == "sequence":
                log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            per_token_kl = per_token_kl * torch.exp(log_ratio)
        row_kl = (per_token_kl * mask).sum(-1)
        if self.loss_type in SEQUENCE_MEAN_LOSS_TYPES:
            row_kl = row_kl / mask.sum(-1).clamp(min=1.0)
        w = weight.to(row_kl.dtype)
        # TRL's "kl" metric: the token mean, here the Horvitz-Thompson (weighted) estimate of the full batch's.
        stats = torch.stack([(per_token_kl.detach() * mask * w.unsqueeze(1)).sum(), (mask * w.unsqueeze(1)).sum()])
        stats = self.accelerator.reduce(stats, reduction="sum")
        self._metrics["train"]["kl"].append((stats[0] / stats[1].clamp(min=1e-12)).item())
        return (row_kl * loss_weight.to(row_kl.dtype)).sum()

    def _training_position(self) -> int:
        """Micro-steps taken since the start of training, from the optimizer steps (so a resumed run counts on)."""
        ga = self.args.gradient_accumulation_steps
        return self.state.global_step * ga + self._step % ga

    def _prune_seed(self) -> int:
        base = self.args.prune_seed if self.args.prune_seed is not None else self.args.seed
        # One draw per generation batch, indexed by the training position so a resumed run draws the same.
        draw = self._training_position()
        return derive_seed("keep", base, draw)

    def _plan_seed(self) -> int:
        base = self.args.prune_seed if self.args.prune_seed is not None else self.args.seed
        return derive_seed("microbatch_plan", base, self._training_position())

    def _draw_keep_mask(self, output, scores):
        """The global keep decision, the main process's on every rank (``_same_on_every_rank``): ``(keep, weight,
        pi)`` over every rank's rows (``pi`` None for the deterministic designs). Also records every rank's kept
        sequence lengths, from which each rank derives the common micro-batch row counts and forward calls."""
        local_rows = output["advantages"].size(0)
        self._gather_row_tokens(output)
        lengths = self._row_tokens[:, :2].sum(1)
        loss_tokens = self._row_tokens[:, 2]
        keep, pi, self._prune_summary = self._same_on_every_rank(self._decide_keep(scores, lengths, loss_tokens))
        weights = keep.double() if pi is None else horvitz_thompson_weights(pi, keep)
        self.last_global_keep = keep  # the decision of the whole generation batch, the same on every rank
        world = self.accelerator.num_processes
        per_rank = zip(lengths.view(world, local_rows), keep.view(world, local_rows))
        self._kept_lengths_per_rank = [rank_lengths[kept].tolist() for rank_lengths, kept in per_rank]
        return keep, weights, pi

    def _decide_keep(self, scores, lengths, loss_tokens) -> tuple:
        """``(keep, pi, summary)`` of the generation batch: the design's mask and keep probabilities (``pi`` None
        for the deterministic designs) and ``(keep rate, estimated pruning error)`` (None without ``pi``)."""
        if not self.args.completion_pruning:  # packing only: every row, weight 1
            return torch.ones_like(scores, dtype=torch.bool), None, None
        problem = self._prune_problem(scores, lengths, loss_tokens)
        keep, pi = get_design(self.args.prune_sampling)(problem, torch.Generator().manual_seed(self._prune_seed()))
        summary = None if pi is None else (problem.keep_rate, pruning_relative_error(pi, problem.scores))
        return keep, pi, summary

    def _same_on_every_rank(self, value):
        """The main process's ``value``, sent to every rank (pickled, so bit for bit). Decisions that every rank
        must share (keep mask, prompt acceptance) are taken from it, never from each rank's own floats: the last
        bit of a float can differ between machines, and a design can be sensitive to it (a tie in a sort, a rank
        cut-off of ``balanced``'s SVD)."""
        if self.accelerator.num_processes == 1:
            return value
        return broadcast_object_list([value], from_process=0)[0]

    def _prune_problem(self, scores, lengths, loss_tokens) -> PruneProblem:
        """What the design sees of the generation batch; with ``adaptive_keep_error``, at the batch's own rate."""
        # A row with A == 0 contributes exactly zero unless a term without A (KL, entropy bonus) is on; a row
        # without loss tokens (e.g. masked as truncated) contributes nothing at all.
        problem = PruneProblem(
            advantages=scores,  # signed where TRL's advantages are one per row
            costs=lengths,
            groups=torch.arange(scores.numel()) // self.num_generations,
            rewards=None if self._last_rewards_per_func is None else self._aggregated_rewards(),
            keep_rate=self.args.completion_keep_rate,
            keep_floor=self.args.keep_floor,
            zero_score_contributes=self.beta != 0.0 or self._entropy_bonus_enabled,
            contributes_nothing=loss_tokens == 0,
            budget_in_tokens=self.args.keep_budget == "tokens",
            length_exponent=self.args.length_exponent,
        )
        if self.args.adaptive_keep_error is None or self.args.prune_sampling not in unbiased_designs():
            return problem
        # With adaptive_keep_error_source='audit', the target on the model-based error is scaled by how much the
        # measured error exceeded it on earlier audited batches (never this batch's draw).
        target = self.args.adaptive_keep_error / self._measured_error_scale()
        return dataclasses.replace(problem, keep_rate=adaptive_keep_rate(problem, target))

    def _gather_row_tokens(self, output) -> None:
        """Every rank's per-row token counts (prompt, completion, loss tokens: ``_row_tokens``, one row per row of
        the generation batch) and padded widths (``_padded_widths``: prompt, completion per rank), in two gathers;
        ``_widths_per_rank``: each rank's padded sequence width."""
        counts = [output["prompt_mask"].sum(1), output["completion_mask"].sum(1), loss_mask(output).sum(1)]
        self._row_tokens = self.accelerator.gather(torch.stack([c.long() for c in counts], 1)).cpu()
        widths = torch.tensor([[output["prompt_mask"].size(1), output["completion_mask"].size(1)]])
        self._padded_widths = self.accelerator.gather(widths.to(self.accelerator.device)).cpu()
        self._widths_per_rank = self._padded_widths.sum(1).tolist()

    def _log_pruning_metrics(self, output, keep, weights, pi, scores):
        """The ``dppo/*`` metrics of the global decision (from ``_row_tokens``); ``weights`` include the prompt
        weights."""
        metrics = self._metrics["train"]
        completion = self._row_tokens[:, 1].double()
        sequence = self._row_tokens[:, :2].sum(1).double()
        n = keep.numel()
        metrics["dppo/kept_fraction"].append(float(keep.float().mean()))
        metrics["dppo/kept_prompt_fraction"].append(float(keep.view(-1, self.num_generations).any(1).float().mean()))
        metrics["dppo/kept_token_fraction"].append(float(completion[keep].sum() / completion.sum().clamp(min=1)))
        metrics["dppo/zero_advantage_fraction"].append(float((scores == 0).float().mean()))
        metrics["dppo/ess"].append(effective_sample_size(weights[keep]))
        metrics["dppo/weight_max"].append(float(weights.max()) if n else 0.0)
        if pi is not None:
            metrics["dppo/expected_keep_fraction"].append(float(pi.sum()) / n)
        if self._prune_summary is not None:
            metrics["dppo/keep_rate"].append(self._prune_summary[0])
            metrics["dppo/pruning_error"].append(self._prune_summary[1])
        # Work of the log-prob and loss passes scales with the sequence tokens they see.
        metrics["dppo/compute_saved"].append(1.0 - float(sequence[keep].sum() / sequence.sum().clamp(min=1)))

    @property
    def _microbatches_follow_trl_split(self) -> bool:
        """Whether micro-batch ``j`` holds this rank's kept rows of TRL's micro-batch ``j`` (TRL's random split, in
        its order: no token balancing, no rows moved between ranks). The entropy filter's quantile is a statistic
        of the tokens of one micro-batch at its forward, which only TRL's own split reproduces."""
        return self.top_entropy_quantile < 1.0

    def _trl_split_of_rows(self, output) -> dict:
        """Per-row entries that travel with each row, also to another rank: ``dppo_trl_microbatch``, the micro-batch
        of TRL's split the row would be in (TRL's shuffle replayed from the RNG state it is about to draw from,
        without drawing: GRPO's split wherever nothing draws in between, e.g. dropout in the deferred passes;
        random and independent of the keep draw either way), ``dppo_trl_microbatch_tokens``, that micro-batch's
        loss tokens (every row of it, kept or not), and ``dppo_origin_rank``."""
        rows, device = output["advantages"].size(0), output["advantages"].device
        self._trl_split_rng_state = torch.get_rng_state()  # the audit's GRPO reference shuffles from it too
        with torch.random.fork_rng(devices=[]):
            permutation = torch.randperm(rows)  # shuffle_sequence_dict's draw
        microbatch = trl_microbatch_of_rows(permutation, self.args.steps_per_generation)
        tokens = microbatch_token_counts(microbatch, loss_mask(output).sum(1), self.args.steps_per_generation)
        return {
            "dppo_trl_microbatch": microbatch.to(device),
            "dppo_trl_microbatch_tokens": tokens.to(device, torch.float32),
            "dppo_origin_rank": torch.full((rows,), self.accelerator.process_index, device=device),
        }

    RANK_BALANCE_TOLERANCE = 0.1  # a rank's kept tokens may exceed the mean by this fraction before rows move

    @torch.no_grad()
    def _balance_ranks(self, output) -> dict:
        """Move kept rows between ranks (``balance_ranks`` on the gathered kept lengths, the same plan on every
        rank) so each rank's token load is within ``RANK_BALANCE_TOLERANCE`` of the mean where the rows allow.
        A row that leaves stays in its rank's batch, no longer kept; received rows are appended, kept. Every
        per-row tensor travels (one fixed-size gather per key, padded to the widest rank). Each row's loss term
        is normalized by global constants or by its own TRL micro-batch's count, which travels with it, so where a
        row trains does not change the gradient. No row moves while micro-batches follow TRL's split."""
        tolerance = math.inf if self._microbatches_follow_trl_split else self.RANK_BALANCE_TOLERANCE
        plan = balance_ranks(self._kept_lengths_per_rank, tolerance)
        length = lambda row: self._kept_lengths_per_rank[row[0]][row[1]]  # noqa: E731
        metrics = self._metrics["train"]
        metrics["dppo/rank_imbalance_before"].append(rank_imbalance([sum(r) for r in self._kept_lengths_per_rank]))
        metrics["dppo/rank_imbalance"].append(rank_imbalance([sum(map(length, rows)) for rows in plan]))
        slots, leaving, arriving = exchange_plan(plan, self.accelerator.process_index)
        if slots == 0:
            return output
        local_rows = output["dppo_keep"].size(0)
        widths = self._padded_widths.amax(0).tolist()
        self._widths_per_rank = [sum(widths)] * self.accelerator.num_processes  # every rank pads to the widest
        per_sequence_ratio = str(self.vllm_importance_sampling_mode).startswith("sequence")
        leaving = output["dppo_keep"].nonzero().flatten()[leaving]
        out = dict(output)
        for key in sorted(
            k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() and len(v) == local_rows
        ):
            value = pad_to_width(output, key, *widths, self._tokenizer.pad_token_id, per_sequence_ratio)
            send = value.new_zeros(slots, *value.shape[1:]) if key != "dppo_keep" else value.new_ones(slots)
            send[: len(leaving)] = value[leaving]
            gathered = self.accelerator.gather(send if key != "dppo_keep" else send.long()).to(value.dtype)
            out[key] = torch.cat([value, gathered[arriving]])
        out["dppo_keep"][leaving] = False
        out["dppo_weight"][leaving] = 0.0
        self._kept_lengths_per_rank = [[length(row) for row in rows] for rows in plan]
        return out

    @torch.no_grad()
    def _run_deferred_logps(self, output, calls, keep):
        """Run the log-prob passes TRL deferred, on the kept rows only; other rows hold zeros. Each pass is cut
        into forward calls no larger than TRL's (``per_device_train_batch_size`` padded rows; padding-free
        calls planned by ``plan_forward_calls``), and every rank makes as many calls as the rank that needs the
        most, a rank short of rows forwarding a one-token filler, so sharded models (ZeRO-3, FSDP) that gather
        parameters in every forward stay in step."""
        rows = keep.nonzero().flatten()
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        filler_mask = torch.zeros_like(attention_mask[:1])
        filler_mask[:, output["prompt_ids"].size(1) - 1] = 1  # one real token: the last prompt column
        groups = self._deferred_call_groups(rows)
        logits_to_keep = output["completion_ids"].size(1)
        for name, model in zip(self._deferred_pass_names(calls), calls):
            full = output[name]
            model, adapter = self._deferred_pass_model(name, model)
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), adapter:
                for group in groups:
                    if group.numel():
                        logps = self._logps_of(model, input_ids[group], attention_mask[group], logits_to_keep,
                                               group.numel())  # fmt: skip
                        full[group] = logps.to(full.dtype)
                    else:  # this rank has no row for this call: one filler keeps the call counts equal
                        self._logps_of(model, input_ids[:1], filler_mask, logits_to_keep, 1)
        if "importance_sampling_ratio" in output:  # on every rank: it gathers metrics
            self._recompute_vllm_importance_sampling(output, rows)

    def _deferred_pass_names(self, calls: list) -> list[str]:
        """The output key each deferred call fills. TRL calls, in order: the old-policy pass (only when it needs
        one), then the reference pass (``beta != 0``)."""
        has_ref = int(self.beta != 0.0)
        return ["old_per_token_logps"] * (len(calls) - has_ref) + ["ref_per_token_logps"] * has_ref

    def _deferred_pass_model(self, name: str, model) -> tuple:
        """``(model, context)`` of a deferred pass: TRL's model, or for the reference of a PEFT policy without a
        reference model, the policy inside the adapter context TRL had entered (the base, or the ``ref`` adapter)."""
        if name == "ref_per_token_logps" and self.ref_model is None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            return self.model, use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        return model, contextlib.nullcontext()

    def _deferred_call_groups(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The kept rows of each forward call of a deferred pass, as many calls on every rank (each rank's calls
        planned from the gathered kept lengths and padded widths of every rank)."""
        per_call = self.args.per_device_train_batch_size
        if self.args.packing:
            plans = plan_calls_per_rank(
                self._kept_lengths_per_rank, self._widths_per_rank, per_call, self._packed_budget
            )
            return [rows[torch.tensor(g, dtype=torch.long)] for g in plans[self.accelerator.process_index]]
        num_calls = max(1, max(-(-len(lengths) // per_call) for lengths in self._kept_lengths_per_rank))
        mine = [g for g in torch.tensor_split(rows, num_calls) if g.numel()]
        return mine + [rows[:0]] * (num_calls - len(mine))

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
            torch.stack([weighted_mean_stats(torch.nan_to_num(delta)[mine], scored[mine], weight[mine]),
                         weighted_mean_stats(ratio_[mine], mask[mine], weight[mine])])
            for mine in (origin == rank for rank in range(self.accelerator.num_processes))
        ])  # fmt: skip
        per_rank = self.accelerator.reduce(per_rank.to(self.accelerator.device), reduction="sum").cpu()
        delta = delta[scored]
        ratios = ratio_.flatten() if ratio_.size(1) == 1 else ratio_[mask.bool()]
        extremes = self._gathered_extremes({"sampling/sampling_logp_difference/max": (delta, "max"),
                                            "sampling/importance_sampling_ratio/min": (ratios, "min"),
                                            "sampling/importance_sampling_ratio/max": (ratios, "max")})  # fmt: skip
        metrics = self._metrics["train"]
        means = {"sampling/sampling_logp_difference/mean": mean_of_rank_means(per_rank[:, 0]),
                 "sampling/importance_sampling_ratio/mean": mean_of_rank_means(per_rank[:, 1])}  # fmt: skip
        if means["sampling/importance_sampling_ratio/mean"] is None:  # no kept row on any rank: no estimate, so
            for name in SAMPLING_METRICS:  # no entry (neither TRL's value nor 0)
                drop_last_entry(metrics, name)
            return
        for name, value in means.items():  # replaces TRL's value; None: kept rows, but no scored token
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

    def _logps_of(self, model, input_ids, attention_mask, logits_to_keep, batch_size):
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]

    def _packed_budget(self, padded_width: int) -> int:
        return self.args.max_packed_tokens or default_packed_tokens(
            self.args.per_device_train_batch_size, padded_width, varlen_attention=self._varlen_attention
        )

    def _packed_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux_loss=False
    ):
        """TRL's per-token log-probs (and entropies) of the completion tokens, computed padding-free in one forward
        call (``packed_inputs``: sequences back to back, ``position_ids`` restarting per sequence, pre-shifted
        labels; with a variable-length kernel also ``cu_seq_lens``), allocating no more than TRL's padded call
        of ``per_device_train_batch_size`` rows, and unpacked into TRL's padded ``(B, T)`` layout."""
        lengths = attention_mask.sum(1).tolist()
        call_budget = self.args.per_device_train_batch_size * input_ids.size(1)
        rows = pack_call(lengths, self._packed_budget(input_ids.size(1)), call_budget)
        packed = packed_inputs(input_ids, attention_mask, logits_to_keep, rows, self._tokenizer.pad_token_id)
        r, c, b, j = packed.pop("index")
        if self._varlen_attention:  # flash finds boundaries from position_ids only in a batch of one row
            packed.update(varlen_kwargs(packed["position_ids"]))
        if compute_aux_loss:  # MoE: the router loss over the packed tokens
            packed["output_router_logits"] = True
        with self.accelerator.autocast():
            out = model(**packed, fused_lm_head=True)
        dtype = torch.promote_types(out.log_probs.dtype, torch.float32)
        logps = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device, dtype=dtype)
        logps[b, j] = out.log_probs[r, c - 1].to(dtype)
        entropies = None
        if compute_entropy:
            entropies = torch.zeros_like(logps)
            entropies[b, j] = out.entropy[r, c - 1].to(dtype)
        return logps, entropies, out.aux_loss if compute_aux_loss else None

    def _kept_microbatches(self, batch) -> list[dict]:
        """Split this rank's kept rows (in TRL's shuffled order) into ``steps_per_generation`` micro-batches
        (``microbatch_plan``: by tokens with packing, at most ``per_device_train_batch_size`` rows each where the
        rows allow, or evenly by rows; a fair share of every rank's rows in each optimizer step; or TRL's own
        split, ``_microbatches_follow_trl_split``), with the same row count on every rank in each micro-step; a
        slot with no kept row fills up with zero-weight filler rows of one token."""
        keep, trl_microbatch = batch.pop("dppo_keep"), batch.pop("dppo_trl_microbatch")
        batch.pop("dppo_origin_rank")
        kept = keep.nonzero().flatten()
        lengths = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
        if self._microbatches_follow_trl_split:
            bins, sizes = self._trl_split_bins(trl_microbatch, kept)
        else:
            generator = torch.Generator().manual_seed(self._plan_seed())
            positions, sizes = microbatch_plan(
                [lengths[i] for i in kept.tolist()], self._kept_lengths_per_rank, self.args.steps_per_generation,
                self.args.per_device_train_batch_size, self.args.packing, generator,
            )  # fmt: skip
            bins = [kept[p].tolist() for p in positions]
        filler = filler_row(batch)
        microbatches = [with_fillers(select_rows(batch, torch.tensor(rows, dtype=torch.long)), filler, size)
                        for rows, size in zip(bins, sizes)]  # fmt: skip
        self._log_microbatch_metrics(batch, lengths, bins, sizes)
        return microbatches

    def _trl_split_bins(self, trl_microbatch, kept) -> tuple[list[list[int]], list[int]]:
        """``(bins, sizes)``: bin ``j`` the kept rows of TRL's micro-batch ``j``; ``sizes[j]`` the most any rank has
        there (at least 1)."""
        steps = self.args.steps_per_generation
        of_kept = trl_microbatch[kept].cpu()
        bins = [kept[of_kept == j].tolist() for j in range(steps)]
        counts = torch.tensor([len(rows) for rows in bins], device=self.accelerator.device)
        sizes = self.accelerator.gather(counts).view(-1, steps).amax(0).clamp(min=1).tolist()
        return bins, sizes

    def _log_microbatch_metrics(self, batch, lengths, bins, sizes) -> None:
        """``dppo/token_density`` (real / allocated tokens) and ``dppo/microbatch_imbalance``, over all ranks."""
        width = batch["prompt_ids"].size(1) + batch["completion_ids"].size(1)
        budget, call_budget = self._packed_budget(width), self.args.per_device_train_batch_size * width
        tokens_per_mb = [float(sum(lengths[i] for i in rows)) for rows in bins]
        allocated = 0.0
        for rows, size in zip(bins, sizes):
            fillers = [1] * (size - len(rows))  # a filler row forwards one token
            allocated += (packed_allocation([lengths[i] for i in rows] + fillers, budget, call_budget)
                          if self.args.packing else size * width)  # fmt: skip
        stats = torch.tensor([sum(tokens_per_mb), allocated, max(tokens_per_mb), sum(tokens_per_mb) / len(bins)])
        stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum").cpu()
        metrics = self._metrics["train"]
        metrics["dppo/token_density"].append(float(stats[0] / stats[1]) if stats[1] > 0 else 0.0)
        metrics["dppo/microbatch_imbalance"].append(float(stats[2] / stats[3]) if stats[3] > 0 else 1.0)
