"""Prompt pruning's hooks of ``DPPOTrainer``: the training sampler, the schedule and progress bar that follow data
progress in epoch-based runs, the resume arithmetic, the per-batch prompt decision (weights and token normalizer),
and the sampler's state for checkpoints. The math is in ``dppo_trl.core.prompts`` and ``dppo_trl.core.estimator``.

Reads of the host trainer: ``args``, ``num_generations``, ``num_iterations``, ``shuffle_dataset``,
``train_dataset``, ``loss_type``, ``state.global_step``, ``_metrics``; ``_local``, ``_same_on_every_rank`` and
``_aggregated_rewards`` (the keep decision)."""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from ..core.estimator import prompt_pruning_normalization, prompt_weighted_token_count
from ..core.prompts import PromptPruningSampler
from ..core.seeds import derive_seed
from .generation_batch import GenerationBatch


class DataProgressScheduler:
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


class DataProgressBarCallback(TrainerCallback):
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


class PromptPruning:
    """Mixed into ``DPPOTrainer``; used only while ``prompt_keep_rate < 1``."""

    _prompt_sampler: PromptPruningSampler | None = None
    _prompt_resume: tuple[dict, int] | None = None  # a checkpoint's sampler state, until the sampler exists
    _next_prompt_batch = 0
    _prompts_walked = 0

    def _prompt_pruning_sampler(self, dataset=None) -> PromptPruningSampler:
        """The training sampler (built once; a checkpoint's state loaded into it)."""
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
                accept_seed=derive_seed("prompt_acceptance", base),
                max_epochs=None if self.args.max_steps > 0 else math.ceil(self.args.num_train_epochs),
                score=self.args.prompt_score,
            )
            self._prompt_sampler.skip_units = self._resume_skip_units
            self._prompt_sampler.share = self._same_on_every_rank
            if self._prompt_resume is not None:
                self._prompt_sampler.load_state_dict(*self._prompt_resume)
                self._prompt_resume = None
        return self._prompt_sampler

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

    def _take_prompt_decision(self, inputs, scores, batch: GenerationBatch) -> tuple[torch.Tensor, float]:
        """This generation batch's prompt weights (every rank's rows) and its token normalizer, both as the sampler
        planned them before the epoch's acceptance draw (``estimator.prompt_pruning_normalization``); feeds the
        group's mean |A| and mean loss tokens back to the history. Checks that the batch is the one planned."""
        decision = self._prompt_sampler.pop_decision(self._next_prompt_batch)
        self._next_prompt_batch = decision["number"] + 1
        self._prompts_walked += decision["walked"]
        group = self.num_generations
        rows = [i for i in decision["prompts"] for _ in range(group)]
        mine = rows[self._local(len(inputs))]
        if [self.train_dataset[i]["prompt"] for i in mine] != [x["prompt"] for x in inputs]:
            raise RuntimeError("DPPO prompt sampler and trainer disagree on the generation batch's prompts.")
        loss_tokens = batch.loss_tokens.double()
        normalizer, factors = prompt_pruning_normalization(
            self.loss_type, decision["normalizer"], decision["normalizers"], loss_tokens
        )
        group_scores = scores.abs().view(-1, group).mean(1).tolist()
        group_rewards = self._aggregated_rewards(batch).double().view(-1, group).nanmean(1).tolist()
        self._prompt_sampler.update(
            decision["prompts"], group_scores, loss_tokens.view(-1, group).mean(1).tolist(), group_rewards
        )
        prompt_weights = [w * f for w, f in zip(decision["weights"], factors)]
        weights = torch.tensor(prompt_weights, dtype=torch.float64).repeat_interleave(group)
        metrics = self._metrics["train"]
        metrics["dppo/prompt_keep_rate"].append(decision["accepted_fraction"])
        metrics["dppo/prompt_q_bar"].append(decision["q_bar"])
        metrics["dppo/prompt_weight_max"].append(max(prompt_weights))
        # Its mean over an epoch estimates E[T_B] / D, the scale of the planned normalizer (1 when D is exact).
        planned_weights = torch.tensor(decision["weights"], dtype=torch.float64).repeat_interleave(group)
        metrics["dppo/prompt_token_scale"].append(
            prompt_weighted_token_count(loss_tokens, planned_weights) / max(normalizer, 1.0)
        )
        return weights, normalizer

    def _prompt_pruning_state_dict(self) -> dict | None:
        """The sampler's state and the walk's position, for a checkpoint (None before the sampler exists)."""
        if self._prompt_sampler is None:
            return None
        return {
            "sampler": self._prompt_sampler.state_dict(),
            "next_batch": self._next_prompt_batch,
            "prompts_walked": self._prompts_walked,
        }

    def _load_prompt_pruning_state_dict(self, state: dict) -> None:
        self._next_prompt_batch = state["next_batch"]
        self._prompts_walked = state["prompts_walked"]
        if self._prompt_sampler is not None:
            self._prompt_sampler.load_state_dict(state["sampler"], state["next_batch"])
        else:
            self._prompt_resume = (state["sampler"], state["next_batch"])
