"""Exact oracle (docs/estimator.md, section 6): over every Poisson mask, every systematic start point (random and
stratified orders) and every outcome of the balanced design's cube walk, the expected
DPPO loss and gradient equal the full-batch loss and gradient, for every TRL loss_type, beta 0 and > 0,
with clipping active, gradient_accumulation_steps equal to and below steps_per_generation. The oracle runs in
float64 (model, log-probs, advantages, weights), so "equal" means to float64 rounding, far from any float32
edge. With everything kept, the loss is GRPOTrainer's own."""

import pytest
import torch
from support.configs import LOSS_TYPES, N_ROWS
from support.marks import slow_unless
from support.oracle import as_float64, assert_exact, dppo_loss_and_grad, expectation, make_trainer, synthetic_batch
from support.outcomes import balanced_outcomes, poisson_outcomes, systematic_outcomes
from trl import GRPOTrainer

from dppo_trl.core.pruning import keep_probabilities, stratified_order


# In the fast lane: GA 1 < spg 3 (the split of a generation batch into several optimizer steps); the rest is slow.
CASES = [slow_unless((spg, ga) == (3, 1), lt, beta, spg, ga)
         for lt in LOSS_TYPES for beta in (0.0, 0.05) for spg, ga in ((1, 1), (3, 3), (3, 1))]


@pytest.mark.parametrize("loss_type,beta,spg,ga", CASES)
def test_expected_loss_and_gradient_equal_the_full_batch(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type, beta, spg, ga
):
    trainer = make_trainer(
        tmp_path, tiny_model_dir, train_dataset, loss_type, beta, spg, float64=True, gradient_accumulation_steps=ga
    )
    batch = as_float64(synthetic_batch(trainer))
    all_rows = torch.ones(N_ROWS, dtype=torch.bool)
    full_loss, full_grad = dppo_loss_and_grad(trainer, batch, all_rows, torch.ones(N_ROWS))
    assert full_grad.abs().sum() > 0

    pi, _ = keep_probabilities(batch["advantages"], 0.5, 0.1, zero_score_contributes=beta != 0.0)
    assert (pi[1] == 0) == (beta == 0.0)  # the zero-advantage row is dropped only when it contributes nothing
    assert ((pi > 0) & (pi < 1)).sum() >= 3  # a genuinely random design

    loss, grad = expectation(trainer, batch, poisson_outcomes(pi))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)

    order = torch.randperm(N_ROWS, generator=torch.Generator().manual_seed(1))
    loss, grad = expectation(trainer, batch, systematic_outcomes(pi, order))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)

    # `stratified`: systematic over rows sorted by group, sign of A and length, the groups in a random order
    lengths, groups = batch["completion_mask"].sum(1), torch.arange(N_ROWS) // trainer.num_generations
    order = stratified_order(batch["advantages"], lengths, groups, torch.Generator().manual_seed(2))
    loss, grad = expectation(trainer, batch, systematic_outcomes(pi, order))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)

    # `balanced`: every leaf of the cube walk over the budget, each group's advantages and the tokens
    loss, grad = expectation(trainer, batch, balanced_outcomes(pi, batch["advantages"], lengths, groups))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_full_batch_loss_is_grpo_trainers_loss(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type, beta
):
    """With one micro-batch and every row kept at weight 1, DPPO's loss and gradient are TRL's own."""
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, beta, spg=1, float64=True)
    batch = as_float64(synthetic_batch(trainer))
    loss, grad = dppo_loss_and_grad(trainer, batch, torch.ones(N_ROWS, dtype=torch.bool), torch.ones(N_ROWS))
    trainer.model.zero_grad()
    trl_loss = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
    trl_loss.backward()
    trl_grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad]).double()
    assert_exact(loss, trl_loss.detach().double())
    assert_exact(grad, trl_grad)


def test_sequence_level_importance_sampling_is_unbiased_too(tmp_path, tiny_model_dir, train_dataset, exact_logprobs):
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        train_dataset,
        "grpo",
        0.05,
        3,
        float64=True,
        importance_sampling_level="sequence",
        use_bias_correction_kl=True,
    )
    batch = as_float64(synthetic_batch(trainer, seed=3))
    full_loss, full_grad = dppo_loss_and_grad(trainer, batch, torch.ones(N_ROWS, dtype=torch.bool), torch.ones(N_ROWS))
    pi, _ = keep_probabilities(batch["advantages"], 0.5, 0.1, zero_score_contributes=True)
    loss, grad = expectation(trainer, batch, poisson_outcomes(pi))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)
