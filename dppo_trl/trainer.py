"""``DPPOTrainer``: TRL's ``GRPOTrainer`` with unbiased completion pruning, Dense Prompt Packing and prompt
pruning wired into its hooks.

- ``_generate_and_score_completions``: TRL generates, scores and computes advantages on the FULL groups; the
  old-policy and reference log-prob passes it would run before scoring are only recorded, then run after
  the keep mask is drawn, on the kept rows alone.
- ``_prepare_inputs``: TRL's shuffle, then the kept rows (not TRL's equal split of all rows) make the
  ``steps_per_generation`` micro-batches, balanced by tokens when packing.
- ``_get_per_token_logps_and_entropies``: defers the passes during generation; with packing, runs them
  padding-free (several sequences per row, position_ids restarting per sequence) and unpacks the result
  into TRL's padded ``(B, T)`` layout, so TRL's loss code runs unchanged.
- ``_compute_loss``: TRL's loss with each kept row's advantage scaled by its Horvitz-Thompson weight, rescaled
  to the full-batch normalizer; the KL term (``beta > 0``) is weighted the same way.
- ``_calculate_rewards``: remembers the rewards (for the ``zero_variance`` filter).
- Prompt pruning: ``_get_train_sampler`` (the sampler), ``create_scheduler`` (a schedule, and a progress bar,
  that follow data progress in epoch-based runs), ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``
  (its state).

The math lives in ``dppo_trl.pruning``, ``dppo_trl.packing`` and ``dppo_trl.prompts``; with
``completion_keep_rate=1.0``, ``prompt_keep_rate=1.0`` and ``packing=False`` every hook is TRL's own.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import torch
from datasets import IterableDataset
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict, use_adapter

from .config import DPPOConfig
from .packing import (
    assign_microbatches,
    balance_ranks,
    default_packed_tokens,
    microbatch_row_counts,
    pack_rows,
    packed_allocation,
    packed_layout,
    rank_imbalance,
)
from .prompts import PromptPruningSampler
from .pruning import (
    SEQUENCE_MEAN_LOSS_TYPES,
    effective_sample_size,
    full_batch_normalizer,
    horvitz_thompson_weights,
    keep_probabilities,
    microbatch_sizes,
    poisson_sample,
    systematic_sample,
    topk_mask,
    trl_microbatch_normalizer,
    vllm_importance_sampling_ratio,
    zero_variance_mask,
)


def select_rows(batch: dict, index: torch.Tensor) -> dict:
    """Rows ``index`` of every per-row entry of a TRL batch dict; scalars (0-dim tensors) and None pass through."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            out[key] = value[index.to(value.device)]
        elif isinstance(value, list):
            out[key] = [value[i] for i in index.tolist()]
        else:
            out[key] = value
    return out


def loss_mask(batch: dict) -> torch.Tensor:
    """TRL's loss mask: the completion mask, times the tool mask where there is one."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


class DPPOTrainer(GRPOTrainer):
    """Drop-in replacement of ``GRPOTrainer`` that trains on a random, reweighted subset of each generation
    batch, with the same expected loss and gradient (see ``DPPOConfig`` and ``docs/estimator.md``)."""

    _tag_names = ["trl", "grpo", "dppo"]

    def __init__(self, model, reward_funcs, args: DPPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = DPPOConfig(f"{str(name).split('/')[-1] or 'model'}-DPPO")
        if not isinstance(args, DPPOConfig):
            raise TypeError(
                f"DPPOTrainer needs args of type DPPOConfig, got {type(args).__name__}: build it with "
                "DPPOConfig(...) (it accepts every GRPOConfig field)."
            )
        train_dataset = kwargs.get("train_dataset", pargs[0] if pargs else None)
        if args.prompt_pruning and isinstance(train_dataset, IterableDataset):  # checked before any model loads
            raise ValueError(
                f"prompt_keep_rate={args.prompt_keep_rate!r}: prompt pruning needs a map-style dataset (it keeps a "
                "history per dataset row); a streaming IterableDataset is not supported. Use prompt_keep_rate=1.0."
            )
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        if args.dppo_training_path and self.aux_loss_enabled:
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef!r}: the MoE load-balancing loss is not a sum of "
                "per-row terms and cannot be reweighted; set router_aux_loss_coef=0.0, or completion_keep_rate=1.0 "
                "with packing=False."
            )
        self._prompt_sampler: PromptPruningSampler | None = None
        self._prompt_resume: tuple[dict, int] | None = None
        self._next_prompt_batch = 0
        self._prompts_walked = 0
        self._deferred_logp_calls: list | None = None
        self._captured_logps: list | None = None
        self._last_rewards_per_func: torch.Tensor | None = None
        self._kept_lengths_per_rank: list[list[int]] = []
        attention = getattr(self.accelerator.unwrap_model(self.model).config, "_attn_implementation", None) or ""
        self._varlen_attention = "flash" in attention
        self.add_callback(DPPOSummaryCallback())
        if args.prompt_pruning and args.max_steps <= 0:
            self.add_callback(
                _DataProgressBarCallback(self._grpo_equivalent_steps, lambda: self.callback_handler.callbacks)
            )

    # ------------------------------------------------------------------ hooks
    def _dppo_now(self) -> bool:
        return self.args.dppo_training_path and self.model.training

    def _local(self, rows_per_rank: int) -> slice:
        """This rank's rows of a batch gathered from every rank (TRL's process slice)."""
        index = self.accelerator.process_index
        return slice(index * rows_per_rank, (index + 1) * rows_per_rank)

    def _global_scores(self, output) -> torch.Tensor:
        """Every rank's advantages, gathered (a fixed-size gather), one per row: the advantage itself, or the
        largest |A| of the row where a subclass gives per-token advantages."""
        advantages = self.accelerator.gather(output["advantages"].detach()).float().cpu()
        return advantages.abs().amax(dim=1) if advantages.dim() > 1 else advantages

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        calls = self._deferred_logp_calls
        if calls is not None:
            calls.append(model)
            placeholder = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)
            return placeholder, None, None
        if self.args.packing and self._dppo_now():
            out = self._packed_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, kwargs.get("compute_entropy", False)
            )
        else:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if self._captured_logps is not None:
            self._captured_logps.append(out[0])
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
        keep, weights = self._draw_keep_mask(output, scores)
        if self.args.prompt_pruning:
            weights = weights * self._take_prompt_decision(inputs, output, scores)
        output["dppo_keep"], output["dppo_weight"] = keep, weights
        output = self._balance_ranks(output)
        self._run_deferred_logps(output, calls, output["dppo_keep"])
        output["dppo_weight"] = output["dppo_weight"].to(torch.float32)
        return output

    def _get_train_sampler(self, dataset=None):
        if not self.args.prompt_pruning:
            return super()._get_train_sampler(dataset)
        if self._prompt_sampler is None:
            dataset = self.train_dataset if dataset is None else dataset
            base = self.args.prune_seed if self.args.prune_seed is not None else self.args.seed
            self._prompt_sampler = PromptPruningSampler(
                num_prompts=len(dataset),
                group_size=self.num_generations,
                prompts_per_batch=self.args.generation_batch_size // self.num_generations,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
                keep_rate=self.args.prompt_keep_rate,
                keep_floor=self.args.prompt_keep_floor,
                history_decay=self.args.prompt_history_decay,
                shuffle=self.shuffle_dataset,
                seed=self.args.seed,
                accept_seed=(base * 0xD1B54A32D192ED03 + 0x8CB92BA72F3D8DD7) % 2**63,
                max_epochs=None if self.args.max_steps > 0 else math.ceil(self.args.num_train_epochs),
            )
            self._prompt_sampler.skip_units = self._resume_skip_units
            if self._prompt_resume is not None:
                self._prompt_sampler.load_state_dict(*self._prompt_resume)
                self._prompt_resume = None
        return self._prompt_sampler

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.args.prompt_pruning and self.args.max_steps <= 0 and not isinstance(scheduler, _DataProgressScheduler):
            # Epoch-based: the schedule was planned for GRPO's step count; drive it by data progress instead.
            self.lr_scheduler = scheduler = _DataProgressScheduler(scheduler, self._grpo_equivalent_steps)
        return scheduler

    def _grpo_equivalent_steps(self) -> int:
        """Optimizer steps GRPO would have taken to walk as far through the data as this run has."""
        batches = self._prompts_walked / (self.args.generation_batch_size // self.num_generations)
        steps_per_batch = self.args.steps_per_generation * self.num_iterations / self.args.gradient_accumulation_steps
        return math.floor(batches * steps_per_batch + 1e-9)

    def _resume_skip_units(self) -> int:
        """How many dataloader batches the HF Trainer discards when it resumes (its own arithmetic, on the
        unpruned epoch length that the sampler reports)."""
        if self.args.ignore_data_skip:
            return 0
        units_per_epoch = len(self._prompt_sampler) // self.args.generation_batch_size
        steps_per_epoch = max(math.ceil(units_per_epoch / self.args.gradient_accumulation_steps), 1)
        return (self.state.global_step % steps_per_epoch) * self.args.gradient_accumulation_steps

    def _take_prompt_decision(self, inputs, output, scores) -> torch.Tensor:
        """This generation batch's prompt weights (this rank's rows); feeds the group's mean |A| back to the
        history. Checks that the batch is the one the sampler planned."""
        decision = self._prompt_sampler.pop_decision(self._next_prompt_batch)
        self._next_prompt_batch = decision["number"] + 1
        self._prompts_walked += decision["walked"]
        group = self.num_generations
        rows = [i for i in decision["prompts"] for _ in range(group)]
        local = len(inputs)
        mine = rows[self._local(local)]
        expected = [self.train_dataset[i]["prompt"] for i in mine]
        if expected != [x["prompt"] for x in inputs]:
            raise RuntimeError("DPPO prompt sampler and trainer disagree on the generation batch's prompts.")
        self._prompt_sampler.update(decision["prompts"], scores.abs().view(-1, group).mean(1).tolist())
        weights = torch.tensor([w for w in decision["weights"] for _ in range(group)], dtype=torch.float64)
        metrics = self._metrics["train"]
        metrics["dppo/prompt_keep_rate"].append(decision["accepted_fraction"])
        metrics["dppo/prompt_q_bar"].append(decision["q_bar"])
        metrics["dppo/prompt_weight_max"].append(max(decision["weights"]))
        return weights[self._local(local)].to(output["advantages"].device)

    _PROMPT_STATE_FILE = "dppo_prompt_sampler.json"

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._prompt_sampler is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            with open(os.path.join(folder, self._PROMPT_STATE_FILE), "w") as f:
                json.dump(
                    {
                        "sampler": self._prompt_sampler.state_dict(),
                        "next_batch": self._next_prompt_batch,
                        "prompts_walked": self._prompts_walked,
                    },
                    f,
                )

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, self._PROMPT_STATE_FILE) if checkpoint else None
        if self.args.prompt_pruning and path and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self._next_prompt_batch = state["next_batch"]
            self._prompts_walked = state["prompts_walked"]
            if self._prompt_sampler is not None:
                self._prompt_sampler.load_state_dict(state["sampler"], state["next_batch"])
            else:
                self._prompt_resume = (state["sampler"], state["next_batch"])

    def _prepare_inputs(self, generation_batch):
        if not self._dppo_now():
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            # TRL's own shuffle: it draws from the global RNG exactly as GRPOTrainer does, whatever was pruned.
            batch = shuffle_sequence_dict(batch)
            self._buffered_inputs = self._kept_microbatches(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _compute_loss(self, model, inputs):
        if "dppo_weight" not in inputs:
            return super()._compute_loss(model, inputs)
        inputs = dict(inputs)
        weight = inputs.pop("dppo_weight")
        advantages = inputs["advantages"]
        row_weight = weight.to(advantages.dtype)
        # Every TRL loss_type is positively homogeneous in A per row (clipping, SAPO/VESPO gates depend on
        # sign(A) only), so A * w scales the row's policy term by w exactly, in value and gradient.
        inputs["advantages"] = advantages * (row_weight if advantages.dim() == 1 else row_weight.unsqueeze(1))
        beta, self.beta = self.beta, 0.0
        self._captured_logps = []
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.beta = beta
            captured, self._captured_logps = self._captured_logps, None
        mask = loss_mask(inputs)
        norm_args = dict(
            max_completion_length=self.max_completion_length,
            loss_tokens_in_generation_batch=float(inputs["num_items_in_batch"]),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
            accumulation_steps=self.current_gradient_accumulation_steps,
        )
        full_z = full_batch_normalizer(self.loss_type, self.args.per_device_train_batch_size, **norm_args)
        trl_z = trl_microbatch_normalizer(self.loss_type, mask.size(0), float(mask.sum()), **norm_args)
        loss = loss * (trl_z / full_z)
        if beta != 0.0:
            loss = loss + beta * self._weighted_kl(captured[0], inputs, mask, weight) / full_z
        return loss

    # ------------------------------------------------------------- internals
    def _weighted_kl(self, per_token_logps, inputs, mask, weight) -> torch.Tensor:
        """``sum_n w_n * kl_n`` over the micro-batch (kl_n: TRL's k3 estimator, token mean or sum per row)."""
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
        return (row_kl * w).sum()

    def _prune_seed(self) -> int:
        base = self.args.prune_seed if self.args.prune_seed is not None else self.args.seed
        # One draw per generation batch, indexed by the training position so a resumed run draws the same.
        draw = self.state.global_step * self.args.gradient_accumulation_steps + (
            self._step % self.args.gradient_accumulation_steps
        )
        return (base * 0x9E3779B97F4A7C15 + draw * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**63

    def _draw_keep_mask(self, output, advantages):
        """The global keep decision (identical on every rank), as this rank's (keep, weight) rows. Also records
        every rank's kept sequence lengths, from which each rank derives the common micro-batch row counts."""
        local_rows = output["advantages"].size(0)
        lengths = self.accelerator.gather(output["completion_mask"].sum(1)).cpu()
        prompt_lengths = self.accelerator.gather(output["prompt_mask"].sum(1)).cpu()
        loss_tokens = self.accelerator.gather(loss_mask(output).sum(1)).cpu()
        design, rate = self.args.prune_sampling, self.args.completion_keep_rate
        pi = None
        if not self.args.completion_pruning:  # packing only: every row, weight 1
            keep = torch.ones_like(advantages, dtype=torch.bool)
            weights = keep.double()
        elif design == "topk":
            keep = topk_mask(advantages, rate)
            weights = keep.double()
        elif design == "zero_variance":
            rewards = (self._last_rewards_per_func * self.reward_weights.to(self._last_rewards_per_func.device)).nansum(
                1
            )
            rewards[torch.isnan(self._last_rewards_per_func).all(dim=1)] = torch.nan
            keep = zero_variance_mask(rewards.cpu(), self.num_generations)
            weights = keep.double()
        else:
            # A row with A == 0 contributes exactly zero unless a term without A (the KL) is on; a row without
            # loss tokens (e.g. masked as truncated) contributes nothing at all.
            pi, _ = keep_probabilities(
                advantages,
                rate,
                self.args.keep_floor,
                zero_score_contributes=self.beta != 0.0,
                contributes_nothing=loss_tokens == 0,
            )
            sample = systematic_sample if design == "systematic" else poisson_sample
            keep = sample(pi, torch.Generator().manual_seed(self._prune_seed()))
            weights = horvitz_thompson_weights(pi, keep)

        sequence_lengths = lengths + prompt_lengths
        self.last_global_keep = keep  # the decision of the whole generation batch, the same on every rank
        world = self.accelerator.num_processes
        per_rank = zip(sequence_lengths.view(world, local_rows), keep.view(world, local_rows))
        self._kept_lengths_per_rank = [lengths[kept].tolist() for lengths, kept in per_rank]
        if self.args.completion_pruning:
            self._log_pruning_metrics(keep, weights, pi, advantages, lengths.float(), sequence_lengths.float())
        local = self._local(local_rows)
        device = output["advantages"].device
        return keep[local].to(device), weights[local].to(device)

    def _log_pruning_metrics(self, keep, weights, pi, advantages, lengths, sequence_tokens):
        metrics = self._metrics["train"]
        n = keep.numel()
        kept_tokens = float(lengths[keep].sum())
        total_tokens = float(lengths.sum())
        metrics["dppo/kept_fraction"].append(float(keep.float().mean()))
        metrics["dppo/kept_prompt_fraction"].append(float(keep.view(-1, self.num_generations).any(1).float().mean()))
        metrics["dppo/kept_token_fraction"].append(kept_tokens / total_tokens if total_tokens > 0 else 0.0)
        metrics["dppo/zero_advantage_fraction"].append(float((advantages == 0).float().mean()))
        metrics["dppo/ess"].append(effective_sample_size(weights[keep]))
        metrics["dppo/weight_max"].append(float(weights.max()) if n else 0.0)
        if pi is not None:
            metrics["dppo/expected_keep_fraction"].append(float(pi.sum()) / n)
        # Work of the log-prob and loss passes scales with the sequence tokens they see.
        metrics["dppo/compute_saved"].append(1.0 - float(sequence_tokens[keep].sum()) / float(sequence_tokens.sum()))

    RANK_BALANCE_TOLERANCE = 0.1  # a rank's kept tokens may exceed the mean by this fraction before rows move

    @torch.no_grad()
    def _balance_ranks(self, output) -> dict:
        """Move kept rows between ranks (``balance_ranks`` on the gathered kept lengths, the same plan on every
        rank) so each rank's token load is within ``RANK_BALANCE_TOLERANCE`` of the mean where the rows allow.
        A row that leaves stays in its rank's batch, no longer kept; received rows are appended, kept. Every
        per-row tensor travels (one fixed-size gather per key, padded to the widest rank). Each row's loss term
        is normalized by global constants, so where a row trains does not change the gradient."""
        plan = balance_ranks(self._kept_lengths_per_rank, self.RANK_BALANCE_TOLERANCE)
        length = lambda row: self._kept_lengths_per_rank[row[0]][row[1]]  # noqa: E731
        metrics = self._metrics["train"]
        metrics["dppo/rank_imbalance_before"].append(rank_imbalance([sum(r) for r in self._kept_lengths_per_rank]))
        metrics["dppo/rank_imbalance"].append(rank_imbalance([sum(map(length, rows)) for rows in plan]))
        me, world = self.accelerator.process_index, self.accelerator.num_processes
        outgoing = [sorted((k, dest) for dest in range(world) for src, k in plan[dest] if src == r and dest != r)
                    for r in range(world)]  # fmt: skip
        slots = max(len(rows) for rows in outgoing)
        if slots == 0:
            return output
        local_rows = output["dppo_keep"].size(0)
        kept = output["dppo_keep"].nonzero().flatten()
        widths = torch.tensor([output["prompt_ids"].size(1), output["completion_ids"].size(1)])
        prompt_width, completion_width = self.accelerator.gather(widths.to(self.accelerator.device)).view(-1, 2).amax(0)
        sequence_is = str(self.vllm_importance_sampling_mode).startswith("sequence")
        local_completion_width = output["completion_ids"].size(1)
        leaving = kept[[k for k, _ in outgoing[me]]]
        # Row of the gathered slots that holds each row this rank receives.
        arriving = [src * slots + outgoing[src].index((k, me)) for src, k in plan[me] if src != me]
        out = dict(output)
        for key in sorted(
            k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() and len(v) == local_rows
        ):
            value = output[key]
            fill = 1 if key == "importance_sampling_ratio" else 0
            if key in ("prompt_ids", "completion_ids"):
                fill = self._tokenizer.pad_token_id
            if key.startswith("prompt_") and value.dim() > 1:
                value = torch.nn.functional.pad(value, (int(prompt_width) - value.size(1), 0), value=fill)
            elif (
                value.dim() > 1
                and value.size(1) == local_completion_width
                and not (key == "importance_sampling_ratio" and sequence_is)
            ):
                value = torch.nn.functional.pad(value, (0, int(completion_width) - value.size(1)), value=fill)
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
        """Run the log-prob passes TRL deferred, on the kept rows only; other rows hold zeros. Every rank makes
        the same number of forward calls per pass (one packed call, or as many padded chunks as the fullest
        rank needs), a rank short of rows forwarding one-token fillers, so sharded models (ZeRO-3, FSDP) that
        gather parameters in every forward stay in step."""
        rows = keep.nonzero().flatten()
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        filler_mask = torch.zeros_like(attention_mask[:1])
        filler_mask[:, output["prompt_ids"].size(1) - 1] = 1  # one real token: the last prompt column
        logits_to_keep = output["completion_ids"].size(1)
        if self.args.packing:
            num_calls = 1
        else:
            most = max(len(r) for r in self._kept_lengths_per_rank)
            num_calls = max(1, math.ceil(most / self.args.per_device_train_batch_size))
        groups = torch.tensor_split(rows, num_calls)
        # TRL calls, in order: the old-policy pass (only when it needs one), then the reference pass (beta != 0).
        has_ref = int(self.beta != 0.0)
        names = ["old_per_token_logps"] * (len(calls) - has_ref) + ["ref_per_token_logps"] * has_ref
        for name, model in zip(names, calls):
            full = output[name]
            adapter = contextlib.nullcontext()
            if name == "ref_per_token_logps" and self.ref_model is None:  # the reference is the policy's base/adapter
                unwrapped = self.accelerator.unwrap_model(self.model)
                adapter = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
                model = self.model
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

    def _recompute_vllm_importance_sampling(self, output, rows):
        """TRL built the vLLM IS ratio (and its ``sampling/*`` metrics) from the deferred placeholder: rebuild
        both from the real old-policy log-probs of the forwarded rows."""
        mask = loss_mask(output)
        old, sampled, mask = output["old_per_token_logps"][rows], output["sampling_per_token_logps"][rows], mask[rows]
        ratio = vllm_importance_sampling_ratio(
            old,
            sampled,
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        output["importance_sampling_ratio"][rows] = ratio.to(output["importance_sampling_ratio"].dtype)
        scored = mask.bool() & ~torch.isnan(sampled)
        delta = (old - sampled).abs()[scored]
        ratios = ratio.flatten() if ratio.size(1) == 1 else ratio[mask.bool()]
        values = {
            "sampling/sampling_logp_difference/mean": (delta.mean() if delta.numel() else delta.new_zeros(()), "mean"),
            "sampling/sampling_logp_difference/max": (delta.max() if delta.numel() else delta.new_zeros(()), "max"),
            "sampling/importance_sampling_ratio/min": (ratios.min() if ratios.numel() else ratios.new_zeros(()), "min"),
            "sampling/importance_sampling_ratio/mean": (
                ratios.mean() if ratios.numel() else ratios.new_zeros(()),
                "mean",
            ),
            "sampling/importance_sampling_ratio/max": (ratios.max() if ratios.numel() else ratios.new_zeros(()), "max"),
        }
        for name, (value, reduce) in values.items():
            gathered = self.accelerator.gather(value.float().reshape(1))
            self._metrics["train"][name][-1] = float(getattr(gathered, reduce)())  # replaces TRL's value

    def _logps_of(self, model, input_ids, attention_mask, logits_to_keep, batch_size):
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]

    def _packed_budget(self, padded_width: int) -> int:
        return self.args.max_packed_tokens or default_packed_tokens(
            self.args.per_device_train_batch_size, padded_width, varlen_attention=self._varlen_attention
        )

    def _packed_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy):
        """TRL's per-token log-probs (and entropies) of the completion tokens, computed padding-free: each row's
        real tokens are laid back to back in packed rows (``position_ids`` restart at 0 per sequence, no
        attention mask), scored with pre-shifted labels that never cross a sequence boundary, in one forward
        call; a packed row shorter than the longest ends with filler tokens that form a sequence of their own."""
        real = attention_mask.bool()
        prompt_width = input_ids.size(1) - logits_to_keep
        lengths = real.sum(1).tolist()
        rows = pack_rows(lengths, self._packed_budget(input_ids.size(1)))
        device = input_ids.device
        packed_row, start, used = [0] * len(lengths), [0] * len(lengths), []
        for r, row in enumerate(rows):
            starts, _ = packed_layout(lengths, row)
            for b, offset in zip(row, starts):
                packed_row[b], start[b] = r, offset
            used.append(sum(lengths[b] for b in row))
        width = max(used)
        # Every real token (b, t) goes to packed row packed_row[b], column start[b] + k (k: its rank in row b).
        b, t = real.nonzero(as_tuple=True)
        k = (real.cumsum(1) - 1)[b, t]
        r = torch.tensor(packed_row, device=device)[b]
        c = torch.tensor(start, device=device)[b] + k
        packed_ids = torch.full((len(rows), width), self._tokenizer.pad_token_id, dtype=input_ids.dtype, device=device)
        packed_ids[r, c] = input_ids[b, t]
        # Positions restart at 0 for each sequence; a row's tail of fillers counts on as a sequence of its own.
        position_ids = torch.arange(width, device=device).unsqueeze(0) - torch.tensor(used, device=device)[:, None]
        position_ids = position_ids.clamp(min=0)
        position_ids[r, c] = k
        # Completion token j of row b is predicted at the position before it: labels pre-shifted, never across
        # a sequence boundary.
        completion = t >= prompt_width
        r, c, b, j = r[completion], c[completion], b[completion], (t - prompt_width)[completion]
        labels = torch.full((len(rows), width), -100, dtype=input_ids.dtype, device=device)
        labels[r, c - 1] = packed_ids[r, c]
        with self.accelerator.autocast():
            out = model(input_ids=packed_ids, position_ids=position_ids, shift_labels=labels, fused_lm_head=True)
        logps = torch.zeros(input_ids.size(0), logits_to_keep, device=device)
        logps[b, j] = out.log_probs[r, c - 1].float()
        entropies = None
        if compute_entropy:
            entropies = torch.zeros(input_ids.size(0), logits_to_keep, device=device)
            entropies[b, j] = out.entropy[r, c - 1].float()
        return logps, entropies, None

    def _kept_microbatches(self, batch) -> list[dict]:
        """Split this rank's kept rows (in TRL's shuffled order) into ``steps_per_generation`` micro-batches, by
        tokens (packing) or evenly by rows, with the same row count on every rank in each micro-step; a slot
        with no kept row fills up with zero-weight filler rows of one token."""
        keep = batch.pop("dppo_keep")
        kept = keep.nonzero().flatten()
        spg = self.args.steps_per_generation
        lengths = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
        if self.args.packing:
            bins = [kept[b].tolist() for b in assign_microbatches([lengths[i] for i in kept.tolist()], spg)]
            counts = [microbatch_row_counts(rank_lengths, spg) for rank_lengths in self._kept_lengths_per_rank]
            sizes = [max(1, *column) for column in zip(*counts)]
        else:
            sizes = microbatch_sizes([len(r) for r in self._kept_lengths_per_rank], spg)
            bounds = [sum(sizes[:j]) for j in range(spg + 1)]
            bins = [kept[bounds[j] : bounds[j + 1]].tolist() for j in range(spg)]
        filler = self._filler_row(batch)
        width = batch["prompt_ids"].size(1) + batch["completion_ids"].size(1)
        microbatches, real, allocated, tokens_per_mb = [], 0.0, 0.0, []
        budget = self._packed_budget(width)
        for rows, size in zip(bins, sizes):
            mb = select_rows(batch, torch.tensor(rows, dtype=torch.long))
            if size > len(rows):
                fill = {
                    k: (v.expand(size - len(rows), *v.shape[1:]) if isinstance(v, torch.Tensor) and v.ndim else v)
                    for k, v in filler.items()
                }
                mb = {
                    k: (torch.cat([mb[k], fill[k]]) if isinstance(mb[k], torch.Tensor) and mb[k].ndim else mb[k])
                    for k in mb
                }
            microbatches.append(mb)
            tokens = float(sum(lengths[i] for i in rows))
            tokens_per_mb.append(tokens)
            real += tokens
            fillers = [1] * (size - len(rows))  # a filler row forwards one token
            allocated += (
                packed_allocation([lengths[i] for i in rows] + fillers, budget) if self.args.packing else size * width
            )
        stats = torch.tensor([real, allocated, max(tokens_per_mb), sum(tokens_per_mb) / spg])
        stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum").cpu()
        metrics = self._metrics["train"]
        metrics["dppo/token_density"].append(float(stats[0] / stats[1]) if stats[1] > 0 else 0.0)
        metrics["dppo/microbatch_imbalance"].append(float(stats[2] / stats[3]) if stats[3] > 0 else 1.0)
        return microbatches

    @staticmethod
    def _filler_row(batch) -> dict:
        """A one-row batch that contributes exactly zero and costs one token: no loss token, one prompt token,
        A = 0, weight 0, log-probs 0 and IS ratio 1 (so every TRL term is finite before it is masked)."""
        row = select_rows(batch, torch.zeros(1, dtype=torch.long))
        for key, value in row.items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue
            if key == "prompt_mask":
                value = torch.zeros_like(value)
                value[:, -1] = 1  # prompts are left-padded: the last column is a real token
            elif key == "importance_sampling_ratio":
                value = torch.ones_like(value)
            elif key not in ("prompt_ids", "completion_ids"):
                value = torch.zeros_like(value)
            row[key] = value
        return row


class _DataProgressScheduler:
    """Wraps a step-based LR scheduler so that it follows data progress: each ``step()`` advances it to the
    number of optimizer steps GRPO would have taken to consume the same prompts. A pruned epoch takes fewer
    steps but the schedule still reaches its end with the last epoch."""

    def __init__(self, scheduler, target_steps):
        self.scheduler = scheduler
        self.target_steps = target_steps

    def step(self, *args, **kwargs):
        target = self.target_steps()
        while self.scheduler.last_epoch < target:
            self.scheduler.step()

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class DPPOSummaryCallback(TrainerCallback):
    """Prints one line at the end of training: steps, wall time, reward at the first and last log, and the
    kept fractions of completions and prompts."""

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        logs = [h for h in state.log_history if "reward" in h]
        parts = [
            f"{state.global_step} steps",
            f"{time.perf_counter() - getattr(self, '_start', time.perf_counter()):.0f} s",
        ]
        if logs:
            parts.append(f"reward {logs[0]['reward']:.3f} (first log) -> {logs[-1]['reward']:.3f} (last log)")
        for key, label in (("dppo/kept_fraction", "completions kept"), ("dppo/prompt_keep_rate", "prompts accepted")):
            values = [h[key] for h in state.log_history if key in h]
            if values:
                parts.append(f"{label} {sum(values) / len(values):.3f}")
        print("DPPO summary: " + ", ".join(parts))


class _DataProgressBarCallback(TrainerCallback):
    """Epoch-based runs with prompt pruning: the progress bar (planned for GRPO's step count) shows data
    progress, the steps GRPO would have taken to walk as far through the data, so it ends full."""

    def __init__(self, target_steps, callbacks):
        self.target_steps = target_steps
        self.callbacks = callbacks

    def on_step_end(self, args, state, control, **kwargs):
        from transformers.trainer_callback import ProgressCallback

        for callback in self.callbacks():
            bar = getattr(callback, "training_bar", None) if isinstance(callback, ProgressCallback) else None
            if bar is not None:
                bar.n = min(max(self.target_steps(), state.global_step), bar.total or bar.n)
                bar.refresh()
