"""Degenerate batches and numerical guards: everything truncated, extreme advantages at a tiny floor."""

import math

import torch
from conftest import cpu_config, random_reward
from test_trainer import RecordingTrainer
from test_unbiased import N_ROWS, dppo_loss_and_grad, make_trainer, synthetic_batch

from dppo_trl.pruning import horvitz_thompson_weights, keep_probabilities


def test_every_completion_truncated_and_masked_still_steps(tmp_path, tiny_model_dir, train_dataset):
    args = cpu_config(
        tmp_path,
        max_steps=2,
        max_completion_length=1,
        mask_truncated_completions=True,
        beta=0.05,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
    )
    trainer = RecordingTrainer(tiny_model_dir, random_reward, args=args, train_dataset=train_dataset)
    trainer.train()
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
