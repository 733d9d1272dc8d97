"""TRL's per-micro-batch statistics under DPPO's packing, against GRPOTrainer at steps_per_generation = 2.

TRL takes some terms over each micro-batch of its random split: ``bnpo`` divides by the micro-batch's loss tokens,
the entropy bonus is the micro-batch's token-mean entropy, the entropy filter (``top_entropy_quantile``) cuts at
a quantile of the micro-batch's token entropies. DPPO's packing bins are token-balanced, not a random sample, so
no such statistic may be taken over a bin. DPPO carries each row's TRL micro-batch (TRL's shuffle replayed,
its token count, ``RowPlacement.trl_split_of_rows``): ``bnpo`` and the entropy bonus divide each row's term by
its own TRL micro-batch's count, wherever the row trains; under the filter the micro-batches are TRL's split
itself. With every row kept, DPPO's gradients are then GRPOTrainer's, for every loss type and option, here in
float64 with GA == spg (one optimizer step takes the batch) and, under the filter, also with GA < spg."""

import pytest
import torch
from support.configs import float64_settings
from support.marks import FAST_LOSS_TYPES, slow_unless
from support.training import train_with_gradients
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.core.estimator import SUPPORTED_LOSS_TYPES

OPTIONS = {"plain": {}, "entropy_bonus": dict(entropy_coef=0.1), "entropy_filter": dict(top_entropy_quantile=0.5)}


def optimizer_gradients(cls, config_cls, tmp_path, model_dir, dataset, **settings):
    """(trainer, its flat float64 gradient at each optimizer step) of a float64 run, steps_per_generation 2."""
    return train_with_gradients(cls, tmp_path, model_dir, dataset, missing_as_zeros=False, config_cls=config_cls,
                                steps_per_generation=2, **float64_settings(), **settings)


def assert_grpos_gradients(tmp_path, model_dir, dataset, **settings):
    """DPPO with every row kept (packing on, its default) and GRPO from the same seed: the same gradient at every
    optimizer step, to 1e-6 of its norm (TRL's advantages are float32: scaling them by a row's factor rounds at
    about 3e-8; the statistic over a packing bin instead of TRL's micro-batch was off by 2% to 29%)."""
    _, grpo = optimizer_gradients(GRPOTrainer, GRPOConfig, tmp_path / "g", model_dir, dataset, **settings)
    dppo, steps = optimizer_gradients(DPPOTrainer, DPPOConfig, tmp_path / "d", model_dir, dataset,
                                      completion_keep_rate=1.0, **settings)
    assert dppo.args.packing and len(steps) == len(grpo) == settings["max_steps"]
    for g, d in zip(grpo, steps):
        assert float(g.norm()) > 0
        assert float((d - g).norm() / g.norm()) < 1e-6


@pytest.mark.parametrize("loss_type,option", [slow_unless(loss_type in FAST_LOSS_TYPES, loss_type, option)
                                              for option in OPTIONS for loss_type in SUPPORTED_LOSS_TYPES])
def test_one_step_of_the_generation_batch_is_grpos(tmp_path, tiny_model_dir, train_dataset, exact_logprobs,
                                                   loss_type, option):
    """spg = GA = 2: TRL's two micro-batches make one optimizer step."""
    assert_grpos_gradients(tmp_path, tiny_model_dir, train_dataset, loss_type=loss_type, max_steps=1,
                           gradient_accumulation_steps=2, **OPTIONS[option])


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_under_the_entropy_filter_each_step_is_grpos_also_with_fewer_accumulation_steps(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type
):
    """GA 1 < spg 2: under the filter DPPO's micro-batches are TRL's, in TRL's order, so each of the two optimizer
    steps of the generation batch takes GRPO's rows (without the filter, a fair random share: test_exactness)."""
    assert_grpos_gradients(tmp_path, tiny_model_dir, train_dataset, loss_type=loss_type, max_steps=2,
                           gradient_accumulation_steps=1, entropy_coef=0.1, top_entropy_quantile=0.5)


def test_trl_split_of_rows_is_trls_shuffle_and_split():
    """The replayed split puts each row where TRL's ``shuffle_sequence_dict`` + ``split_tensor_dict`` put it, and
    draws nothing from the RNG."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from dppo_trl.core.batch import microbatch_token_counts, trl_microbatch_of_rows

    rows, steps = 12, 3
    batch = {"row": torch.arange(rows), "tokens": torch.arange(rows) % 5 + 1}
    torch.manual_seed(7)
    state = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]):
        microbatch = trl_microbatch_of_rows(torch.randperm(rows), steps)
    assert torch.equal(torch.get_rng_state(), state)
    chunks = split_tensor_dict(shuffle_sequence_dict(batch), steps)
    counts = microbatch_token_counts(microbatch, batch["tokens"], steps)
    for j, chunk in enumerate(chunks):
        assert sorted(chunk["row"].tolist()) == (microbatch == j).nonzero().flatten().tolist()
        assert (counts[chunk["row"]] == float(chunk["tokens"].sum())).all()
    assert torch.equal(trl_microbatch_of_rows(torch.tensor([2, 0, 1]), 2), torch.tensor([1, -1, 0]))


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
@pytest.mark.parametrize("ga", [2, 1])
def test_under_the_entropy_filter_dropping_only_rows_without_signal_is_grpos(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type, ga
):
    """``keep_floor=1``: every row with a signal kept at weight 1, only zero-advantage rows dropped, so each step
    must be GRPO's. TRL takes the filter's quantile over every loss token of its micro-batch, the dropped rows'
    too: DPPO forwards them without gradient for it (a quantile taken without them was off by 4% here)."""
    settings = dict(loss_type=loss_type, max_steps=3, gradient_accumulation_steps=ga, top_entropy_quantile=0.5)
    _, grpo = optimizer_gradients(GRPOTrainer, GRPOConfig, tmp_path / "g", tiny_model_dir, train_dataset, **settings)
    dppo, steps = optimizer_gradients(DPPOTrainer, DPPOConfig, tmp_path / "d", tiny_model_dir, train_dataset,
                                      completion_keep_rate=0.5, keep_floor=1.0, **settings)
    dropped = [h["dppo/kept_fraction"] for h in dppo.state.log_history if "dppo/kept_fraction" in h]
    assert min(dropped) < 1.0  # rows were dropped
    for g, d in zip(grpo, steps):
        assert float(g.norm()) > 0
        assert float((d - g).norm() / g.norm()) < 1e-6


@pytest.mark.parametrize("option", [{}, dict(off_policy_mask_threshold=0.0)], ids=["plain", "off_policy_mask"])
def test_deferred_log_probs_keep_the_models_dtype(tmp_path, tiny_model_dir, train_dataset, exact_logprobs, option):
    """num_iterations 2 (TRL runs the old-policy pass), every row kept, float64: the deferred old log-probs are
    stored in the model's dtype, so each step is GRPO's to float64 rounding (in float32 placeholders: 1.5e-7 off,
    and the off-policy mask at threshold 0 decided on rounding)."""
    settings = dict(max_steps=2, gradient_accumulation_steps=2, num_iterations=2, **option)
    _, grpo = optimizer_gradients(GRPOTrainer, GRPOConfig, tmp_path / "g", tiny_model_dir, train_dataset, **settings)
    dppo, steps = optimizer_gradients(DPPOTrainer, DPPOConfig, tmp_path / "d", tiny_model_dir, train_dataset,
                                      completion_keep_rate=1.0, **settings)
    assert len(steps) == len(grpo) == 2
    for g, d in zip(grpo, steps):
        assert float(g.norm()) > 0
        assert float((d - g).norm() / g.norm()) < 1e-10
