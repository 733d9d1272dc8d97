"""Exact oracle (DESIGN.md section 6): over every Poisson mask, every systematic start point (random and
stratified orders) and every outcome of the balanced design's cube walk, the expected
DPPO loss and gradient equal the full-batch loss and gradient, for every TRL loss_type, beta 0 and > 0,
with clipping active, gradient_accumulation_steps equal to and below steps_per_generation. The oracle runs in
float64 (model, log-probs, advantages, weights), so "equal" means to float64 rounding, far from any float32
edge. With everything kept, the loss is GRPOTrainer's own."""

import itertools

import pytest
import torch
from conftest import cpu_config, random_reward
from trl import GRPOTrainer

from dppo_trl import DPPOTrainer
from dppo_trl.core.cube import cube_outcomes
from dppo_trl.core.estimator import horvitz_thompson_weights
from dppo_trl.core.pruning import (
    PruneProblem,
    balancing_variables,
    grouped_order,
    keep_probabilities,
    stratified_order,
    systematic_sample,
)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"]
N_ROWS = 6


def make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, beta, spg, float64=False, **extra):
    """A DPPOTrainer on the tiny model in train mode; ``float64``: the model in float64 (and TRL's float32 LM
    head cast off), for exact oracles."""
    if float64:
        extra["cast_lm_head_to_fp32"] = False
    settings = dict(
        loss_type=loss_type,
        beta=beta,
        per_device_train_batch_size=N_ROWS // spg,
        steps_per_generation=spg,
        gradient_accumulation_steps=extra.pop("gradient_accumulation_steps", spg),
        num_generations=2,
        max_completion_length=5,
        epsilon=0.2,
        completion_keep_rate=0.5,
        keep_floor=0.1,
    )
    args = cpu_config(tmp_path, **{**settings, **extra})
    trainer = DPPOTrainer(tiny_model_dir, random_reward, args=args, train_dataset=train_dataset)
    if float64:
        trainer.model.double()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def synthetic_batch(trainer, seed=0):
    """A generation batch as TRL's `_generate_and_score_completions` returns it, with old and reference
    log-probs away from the current policy (so clipping is active) and one zero-advantage row."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    pad = trainer.processing_class.pad_token_id
    prompt_len, comp_len = 4, 5
    prompt_ids = torch.randint(10, vocab, (N_ROWS, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, 0], prompt_mask[0, 0] = pad, 0  # left padding
    completion_ids = torch.randint(10, vocab, (N_ROWS, comp_len), generator=g)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])
    completion_mask = (torch.arange(comp_len)[None, :] < lengths[:, None]).long()
    completion_ids[completion_mask == 0] = pad
    advantages = torch.tensor([1.3, 0.0, -0.7, 0.2, -1.6, 0.9])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logps = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, input_ids, attention, comp_len)[
            0
        ]
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": logps + 0.5 * torch.randn(logps.shape, generator=g),
        "ref_per_token_logps": logps + 0.3 * torch.randn(logps.shape, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def dppo_loss_and_grad(trainer, batch, keep, weights):
    """Total loss and gradient of one generation batch through DPPOTrainer's own split and loss (TRL's split of
    the rows, whose micro-batch token counts ``bnpo`` and the entropy bonus divide by, drawn before the mask)."""
    b = dict(batch)
    b.update(trainer._trl_split_of_rows(b))
    b["dppo_keep"] = keep
    b["dppo_weight"] = weights.to(batch["advantages"].dtype)
    lengths = batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)
    trainer._kept_lengths_per_rank = [lengths[keep].tolist()]
    trainer.model.zero_grad()
    total = 0.0
    for mb in trainer._kept_microbatches(b):
        loss = trainer._compute_loss(trainer.model, mb)
        loss.backward()
        total += loss.item()
    grad = torch.cat(
        [
            p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
            for p in trainer.model.parameters()
            if p.requires_grad
        ]
    )
    return torch.tensor(total, dtype=torch.float64), grad.double()


def expectation(trainer, batch, outcomes):
    loss, grad, total_prob = 0.0, 0.0, 0.0
    for prob, keep, weights in outcomes:
        value, g = dppo_loss_and_grad(trainer, batch, keep, weights)
        loss, grad, total_prob = loss + prob * value, grad + prob * g, total_prob + prob
    assert total_prob == pytest.approx(1.0)
    return loss, grad


def poisson_outcomes(pi):
    for bits in itertools.product([False, True], repeat=len(pi)):
        keep = torch.tensor(bits)
        prob = float(torch.where(keep, pi, 1 - pi).prod())
        if prob > 0:
            yield prob, keep, horvitz_thompson_weights(pi, keep)


def systematic_outcomes(pi, order):
    cuts = sorted({0.0, 1.0, *[float(c) % 1.0 for c in torch.cumsum(pi[order], 0)]})
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi - lo > 1e-15:
            keep = systematic_sample(pi, order=order, start=0.5 * (lo + hi))
            yield hi - lo, keep, horvitz_thompson_weights(pi, keep)


def balanced_outcomes(pi, advantages, lengths, groups, seed=3):
    problem = PruneProblem(advantages, lengths, groups, None, keep_rate=0.5, keep_floor=0.1)
    g = torch.Generator().manual_seed(seed)
    x = balancing_variables(pi, problem, g)
    merged = {}  # leaves with the same kept rows: one loss pass
    for prob, keep in cube_outcomes(pi, x, grouped_order(groups, g)):
        merged[tuple(keep.tolist())] = merged.get(tuple(keep.tolist()), 0.0) + prob
    for rows, prob in merged.items():
        keep = torch.tensor(rows)
        yield prob, keep, horvitz_thompson_weights(pi, keep)


def float64(batch):
    """The batch's floating tensors in float64."""
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def assert_exact(value, reference):
    """Equal to float64 rounding: relative 1e-9 of the largest entry (float32 rounding would be ~1e-7)."""
    scale = float(reference.abs().max()) if reference.numel() > 1 else abs(float(reference))
    torch.testing.assert_close(value, reference, rtol=1e-9, atol=1e-9 * max(scale, 1e-12))


CASES = [(lt, beta, spg, ga) for lt in LOSS_TYPES for beta in (0.0, 0.05) for spg, ga in ((1, 1), (3, 3), (3, 1))]


@pytest.mark.parametrize("loss_type,beta,spg,ga", CASES)
def test_expected_loss_and_gradient_equal_the_full_batch(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type, beta, spg, ga
):
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, beta, spg, float64=True,
                           gradient_accumulation_steps=ga)  # fmt: skip
    batch = float64(synthetic_batch(trainer))
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
    batch = float64(synthetic_batch(trainer))
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
    batch = float64(synthetic_batch(trainer, seed=3))
    full_loss, full_grad = dppo_loss_and_grad(trainer, batch, torch.ones(N_ROWS, dtype=torch.bool), torch.ones(N_ROWS))
    pi, _ = keep_probabilities(batch["advantages"], 0.5, 0.1, zero_score_contributes=True)
    loss, grad = expectation(trainer, batch, poisson_outcomes(pi))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)
