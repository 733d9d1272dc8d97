"""MoE router loss, entropy bonus (static and adaptive) and entropy filter under DPPO: they train at DPPO's
defaults, reproduce GRPOTrainer where every row is kept, and the entropy bonus keeps the estimator unbiased."""

import math

import pytest
import torch
from support.configs import N_ROWS
from support.oracle import as_float64, assert_exact, dppo_loss_and_grad, expectation, make_trainer, synthetic_batch
from support.outcomes import poisson_outcomes
from support.training import build, losses_of, params_of, train
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOTrainer
from dppo_trl.core.pruning import keep_probabilities

TRL_LOSS_METRICS = ("policy_loss", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean")


EVERY_ROW_KEPT = dict(completion_keep_rate=0.5, keep_floor=1.0, packing=False)


def assert_every_row_kept_is_grpo(tmp_path, model_dir, dataset, dppo_settings=EVERY_ROW_KEPT, **settings):
    """One optimizer step per generation batch (spg = GA = 1), every row that can contribute kept (keep_floor=1)
    on the padded path: DPPO's separately added terms (KL, entropy bonus, router loss) and its weighted metrics
    must give GRPOTrainer's losses, metrics and parameters."""
    common = dict(max_steps=3, steps_per_generation=1, gradient_accumulation_steps=1, **settings)
    grpo = train(GRPOTrainer, tmp_path / "g", model_dir, dataset, config_cls=GRPOConfig, **common)
    dppo = train(DPPOTrainer, tmp_path / "d", model_dir, dataset, **dppo_settings, **common)
    # A loss near 0 is a sum of O(1) per-token terms of both signs: float32 summation order alone moves it by
    # ~1e-6, so the absolute tolerance is 1e-5 (the parameters, O(1), are compared at 1e-4 relative).
    assert losses_of(dppo) == pytest.approx(losses_of(grpo), rel=1e-4, abs=1e-5)
    for key in TRL_LOSS_METRICS:  # logged by GRPOTrainer: logged by DPPO too, the same values
        logged = [[h[key] for h in t.state.log_history if key in h] for t in (grpo, dppo)]
        assert logged[1] == pytest.approx(logged[0], rel=1e-4, abs=1e-6), key
    for name, p in params_of(grpo).items():
        torch.testing.assert_close(params_of(dppo)[name], p, rtol=1e-4, atol=1e-6)
    return grpo, dppo


def test_moe_router_loss_with_every_row_kept_is_grpos(tmp_path, tiny_moe_dir, train_dataset):
    """beta > 0 makes every row eligible (with beta = 0 a zero-advantage row is never forwarded, so the router
    loss, a regularizer of the forwarded tokens, is taken without it: see docs/estimator.md)."""
    grpo, dppo = assert_every_row_kept_is_grpo(tmp_path, tiny_moe_dir, train_dataset, beta=0.05)
    assert dppo.aux_loss_enabled and any("aux_loss" in h for h in dppo.state.log_history)


@pytest.mark.parametrize("packing", [True, False])
def test_moe_trains_at_dppos_defaults(tmp_path, tiny_moe_dir, train_dataset, packing):
    trainer = build(DPPOTrainer, tmp_path, tiny_moe_dir, train_dataset, max_steps=2, steps_per_generation=2,
                    gradient_accumulation_steps=1, packing=packing)
    before = params_of(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) and math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in logs)
    moved = [name for name, p in params_of(trainer).items() if not torch.equal(p, before[name])]
    assert any("gate" in name for name in moved)  # the router trained: the router loss reached it


@pytest.mark.parametrize(
    "settings",
    [
        dict(entropy_coef=0.01),
        dict(use_adaptive_entropy=True, entropy_target=10.0, entropy_coef=0.0, entropy_coef_delta=0.01),
        dict(top_entropy_quantile=0.5),
        dict(entropy_coef=0.1, top_entropy_quantile=0.3),
        dict(entropy_coef=0.1, top_entropy_quantile=0.5),
    ],
    ids=["bonus", "adaptive", "filter", "bonus+filter0.3", "bonus+filter0.5"],
)
def test_entropy_terms_with_every_row_kept_are_grpos(tmp_path, tiny_model_dir, train_dataset, settings):
    """Also the bonus together with the filter (a mean over the tokens the filter keeps) and ``policy_loss``,
    which TRL logs with the bonus on."""
    grpo, dppo = assert_every_row_kept_is_grpo(tmp_path, tiny_model_dir, train_dataset, **settings)
    if "use_adaptive_entropy" in settings:  # the controller moved, the same way
        coefs = [[h["entropy_coef"] for h in t.state.log_history if "entropy_coef" in h] for t in (grpo, dppo)]
        assert coefs[0] == pytest.approx(coefs[1]) and coefs[1][-1] > 0


@pytest.mark.parametrize("loss_type", ["vespo", "dapo"])
def test_per_sequence_metrics_count_every_row_as_trl(tmp_path, tiny_model_dir, train_dataset, loss_type):
    """``importance_sampling_level="sequence"`` logs one value per row (``vespo/phi_seq_mean``, ``clip_ratio/*``);
    TRL counts every row, also one masked as truncated (no loss token): so does DPPO's weighted mean, on its
    training path (packing) with every row kept."""
    grpo, _ = assert_every_row_kept_is_grpo(
        tmp_path, tiny_model_dir, train_dataset, dict(completion_keep_rate=1.0), loss_type=loss_type,
        importance_sampling_level="sequence", mask_truncated_completions=True,
    )
    key = "vespo/phi_seq_mean" if loss_type == "vespo" else "clip_ratio/region_mean"
    assert any(h.get(key) for h in grpo.state.log_history) or loss_type == "dapo"


@pytest.mark.parametrize("settings", [dict(entropy_coef=0.01), dict(entropy_coef=0.01, top_entropy_quantile=0.5),
                                      dict(use_adaptive_entropy=True, top_entropy_quantile=0.5)])
def test_entropy_terms_train_at_dppos_defaults(tmp_path, tiny_model_dir, train_dataset, settings):
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=2, steps_per_generation=2,
                    gradient_accumulation_steps=1, **settings)
    assert all(math.isfinite(x) for x in losses_of(trainer)) and len(losses_of(trainer)) == 2


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("spg,ga", [(1, 1), (3, 1)])
def test_entropy_bonus_keeps_the_estimator_unbiased(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type, spg, ga
):
    """Every Poisson mask enumerated, in float64: the expected loss and gradient with the entropy bonus equal the
    full batch's (rows with A = 0 carry entropy, so they stay eligible)."""
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, 0.0, spg, float64=True,
                           gradient_accumulation_steps=ga, entropy_coef=0.05)
    batch = as_float64(synthetic_batch(trainer))
    every_row = torch.ones(N_ROWS, dtype=torch.bool)
    full_loss, full_grad = dppo_loss_and_grad(trainer, batch, every_row, torch.ones(N_ROWS))
    no_bonus = make_trainer(tmp_path / "n", tiny_model_dir, train_dataset, loss_type, 0.0, spg, float64=True,
                            gradient_accumulation_steps=ga)
    no_bonus.model.load_state_dict(trainer.model.state_dict())
    no_bonus_loss, _ = dppo_loss_and_grad(no_bonus, batch, every_row, torch.ones(N_ROWS))
    assert abs(float(full_loss - no_bonus_loss)) > 1e-4  # the bonus is on
    pi, _ = keep_probabilities(batch["advantages"], 0.5, 0.1, zero_score_contributes=True)
    assert pi[1] > 0  # the zero-advantage row is eligible: its entropy counts
    loss, grad = expectation(trainer, batch, poisson_outcomes(pi))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo"])
@pytest.mark.parametrize("bonus", [0.0, 0.05])
def test_the_entropy_filter_keeps_the_estimator_unbiased(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type, bonus
):
    """Every Poisson mask enumerated, in float64, spg 3: with the entropy filter on (and with the entropy bonus over
    the tokens it keeps), the expected loss and gradient equal the full batch's. The filter's quantile is taken
    over every row of TRL's micro-batch, the rows not kept forwarded without gradient, so it does not depend on
    the draw; taken over the kept rows alone the expectation was off."""
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, 0.0, 3, float64=True,
                           top_entropy_quantile=0.5, entropy_coef=bonus)
    batch = as_float64(synthetic_batch(trainer))
    every_row = torch.ones(N_ROWS, dtype=torch.bool)
    full_loss, full_grad = dppo_loss_and_grad(trainer, batch, every_row, torch.ones(N_ROWS))
    pi, _ = keep_probabilities(batch["advantages"], 0.5, 0.1, zero_score_contributes=bonus > 0)
    assert bool((pi < 1).any())
    loss, grad = expectation(trainer, batch, poisson_outcomes(pi))
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)


def test_a_micro_batch_that_kept_no_row_forwards_no_unkept_rows(tmp_path, tiny_model_dir, train_dataset):
    """Under the filter only a micro-batch that trains a kept row needs its unkept rows' entropies: one of fillers
    alone skips their forward (the filter acts on nothing there)."""
    from support.oracle import generation_batch_of

    from dppo_trl.components.generation_batch import UNKEPT_ROWS_KEY

    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, "dapo", 0.0, 3, top_entropy_quantile=0.5)
    batch = synthetic_batch(trainer)
    rows = dict(batch)
    rows.update(trainer.placement.trl_split_of_rows(rows, generation_batch_of(batch, torch.ones(N_ROWS, dtype=torch.bool))))
    first = rows["dppo_trl_microbatch"] == 0
    keep = first.clone()
    keep[first.nonzero()[0]] = False  # one row of micro-batch 0 kept, one not
    rows["dppo_keep"], rows["dppo_weight"] = keep, keep.double()
    microbatches = trainer.placement.kept_microbatches(dict(rows), generation_batch_of(batch, keep))
    assert [UNKEPT_ROWS_KEY in mb for mb in microbatches] == [True, False, False]
    assert microbatches[0][UNKEPT_ROWS_KEY]["prompt_ids"].size(0) == 1


@pytest.mark.parametrize("made", ["bare", "mock"])
def test_entropy_mask_outside_a_loss_computation_is_trls(made):
    """TRL's own unit tests call ``get_high_entropy_mask`` on a trainer built without ``__init__`` and on a
    ``Mock(spec=GRPOTrainer)`` (whose class attributes read as Mocks): DPPOTrainer's reads its state from the
    instance only, so it falls back to TRL's filter in both instead of raising."""
    from unittest.mock import Mock

    def trainer_of(cls):
        trainer = cls.__new__(cls) if made == "bare" else Mock(spec=cls)
        trainer.accelerator = Mock(num_processes=1)
        trainer.accelerator.pad_across_processes.side_effect = lambda x, dim, pad_index: x
        trainer.accelerator.gather.side_effect = lambda x: x
        return trainer

    entropies = torch.tensor([[0.1, 0.5, 0.9, 1.3], [0.2, 0.6, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    expected = GRPOTrainer.get_high_entropy_mask(trainer_of(GRPOTrainer), entropies, mask, 0.5)
    assert torch.equal(DPPOTrainer.get_high_entropy_mask(trainer_of(DPPOTrainer), entropies, mask, 0.5), expected)
    assert 0 < int(expected.sum()) < int(mask.sum())
