"""Degenerate batches and numerical guards: each scenario trains without exception, NaN or Inf and logs what
happened; HT weights stay bounded by 1 / keep_floor with a finite loss at extreme advantages."""

import math

import pytest
import torch
from support.configs import N_ROWS
from support.oracle import dppo_loss_and_grad, make_trainer, synthetic_batch
from support.recording import RecordingTrainer
from support.rewards import constant_reward, random_reward
from support.training import train

from dppo_trl.core.estimator import horvitz_thompson_weights
from dppo_trl.core.pruning import keep_probabilities


def test_every_completion_truncated_and_masked_still_steps(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(
        RecordingTrainer,
        tmp_path,
        tiny_model_dir,
        train_dataset,
        max_steps=2,
        max_completion_length=1,
        mask_truncated_completions=True,
        beta=0.05,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
    )
    assert all(r["completion_mask"].sum() == 0 for r in trainer.records)  # nothing left to learn from
    assert all(not r["dppo_keep"].any() for r in trainer.records)  # so nothing is kept, even with beta > 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)


def test_weights_are_bounded_and_the_loss_finite_at_a_tiny_floor(tmp_path, tiny_model_dir, train_dataset):
    floor = 1e-4
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, "grpo", 0.05, 1, keep_floor=floor)
    batch = synthetic_batch(trainer)
    batch["advantages"] = torch.tensor([1e4, 1e-6, -3e3, 2e-5, -1e-6, 5e3])
    pi, _ = keep_probabilities(batch["advantages"], 0.5, floor, zero_score_contributes=True)
    assert float(pi.min()) >= floor
    keep = torch.ones(N_ROWS, dtype=torch.bool)
    weights = horvitz_thompson_weights(pi, keep)
    assert float(weights.max()) <= 1 / floor + 1e-6
    loss, grad = dppo_loss_and_grad(trainer, batch, keep, weights)
    assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())


class EmptyFirstCompletion(RecordingTrainer):
    """The first completion of every generation batch is empty: the model stopped at once (only the EOS token,
    which is what a zero-length answer is to TRL: its completion ids always end with the stop token)."""

    def _generate(self, prompts):
        out = list(super()._generate(prompts))
        out[1] = [[self.processing_class.eos_token_id]] + list(out[1][1:])  # completion ids
        out[3] = [""] + list(out[3][1:])  # completion texts
        if out[4] is not None:  # sampler log-probs (vLLM)
            out[4] = [out[4][0][:1]] + list(out[4][1:])
        return tuple(out)


# name: (config overrides, reward, trainer class, check(trainer, logs) of what the logs say happened)
SCENARIOS = {
    "all groups equal reward": (
        {}, constant_reward, RecordingTrainer,
        lambda t, logs: all(h["dppo/kept_fraction"] == 0 and h["dppo/zero_advantage_fraction"] == 1 for h in logs),
    ),
    "exactly one row kept": (
        dict(prune_sampling="topk", completion_keep_rate=1 / 16), random_reward, RecordingTrainer,
        lambda t, logs: all(int(r["dppo_keep"].sum()) == 1 for r in t.records)
        and all(h["dppo/kept_fraction"] == 1 / 16 for h in logs),
    ),
    "a completion of length 0": (
        {}, random_reward, EmptyFirstCompletion,
        lambda t, logs: all(
            r["completion_mask"][0].sum() == 1 and r["completion_ids"][0, 0] == t.processing_class.eos_token_id
            for r in t.records
        ),
    ),
    "every sequence longer than the packing budget": (
        dict(max_packed_tokens=2), random_reward, RecordingTrainer,
        lambda t, logs: all(0 < h["dppo/token_density"] <= 1 for h in logs),
    ),
    "num_iterations > 1 with a reference model": (
        dict(num_iterations=3, beta=0.05), random_reward, RecordingTrainer,
        lambda t, logs: len(t.records) == 1 and all(math.isfinite(h["kl"]) for h in logs),
    ),
    "more micro-steps than kept rows": (
        dict(steps_per_generation=4, gradient_accumulation_steps=4, prune_sampling="topk",
             completion_keep_rate=1 / 32), random_reward, RecordingTrainer,
        lambda t, logs: all(int(r["dppo_keep"].sum()) == 1 for r in t.records),
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_degenerate_batches_train_finitely_and_say_what_happened(tmp_path, tiny_model_dir, train_dataset, name):
    overrides, reward, trainer_cls, check = SCENARIOS[name]
    base = dict(max_steps=3, steps_per_generation=2, gradient_accumulation_steps=2)
    trainer = train(trainer_cls, tmp_path, tiny_model_dir, train_dataset, reward=reward, **{**base, **overrides})
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)
    assert all(bool(p.isfinite().all()) for p in trainer.model.parameters())
    pruning_logs = [h for h in logs if "dppo/kept_fraction" in h]
    assert pruning_logs and check(trainer, pruning_logs)
