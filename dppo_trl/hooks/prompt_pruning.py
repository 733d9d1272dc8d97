"""Prompt pruning's hooks of ``DPPOTrainer``: the training sampler, the schedule and resume arithmetic that follow
data progress, the per-batch prompt decision (weights and token normalizer), and the sampler's state in
checkpoints. The math is in ``dppo_trl.core.prompts`` and ``dppo_trl.core.estimator``; this mixin only wires it into the HF
Trainer's and TRL's hooks."""

from __future__ import annotations

import json
import math
import os

import torch

from .callbacks import DataProgressScheduler
from ..core.estimator import prompt_pruning_normalization, prompt_weighted_token_count
from ..core.prompts import PromptPruningSampler
from ..core.seeds import derive_seed


class PromptPruningHooks:
    """Mixed into ``DPPOTrainer`` (before ``GRPOTrainer``): every hook falls through to TRL's when
    ``prompt_keep_rate == 1``."""

    _prompt_sampler: PromptPruningSampler | None = None
    _prompt_resume: tuple[dict, int] | None = None
    _next_prompt_batch = 0
    _prompts_walked = 0

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
                accept_seed=derive_seed("prompt_acceptance", base),
                max_epochs=None if self.args.max_steps > 0 else math.ceil(self.args.num_train_epochs),
            )
            self._prompt_sampler.skip_units = self._resume_skip_units
            self._prompt_sampler.share = self._same_on_every_rank
            if self._prompt_resume is not None:
                self._prompt_sampler.load_state_dict(*self._prompt_resume)
                self._prompt_resume = None
        return self._prompt_sampler

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.args.prompt_pruning and self.args.max_steps <= 0 and not isinstance(scheduler, DataProgressScheduler):
            # Epoch-based: the schedule was planned for GRPO's step count; drive it by data progress instead.
            self.lr_scheduler = scheduler = DataProgressScheduler(scheduler, self._grpo_equivalent_steps)
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

    def _take_prompt_decision(self, inputs, scores) -> tuple[torch.Tensor, float]:
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
        loss_tokens = self._row_tokens[:, 2].double()
        normalizer, factors = prompt_pruning_normalization(
            self.loss_type, decision["normalizer"], decision["normalizers"], loss_tokens
        )
        self._prompt_sampler.update(decision["prompts"], scores.abs().view(-1, group).mean(1).tolist(),
                                    loss_tokens.view(-1, group).mean(1).tolist())  # fmt: skip
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
