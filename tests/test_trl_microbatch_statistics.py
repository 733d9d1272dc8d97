"""TRL's per-micro-batch statistics under DPPO's packing, against GRPOTrainer at steps_per_generation = 2.

TRL takes some terms over each micro-batch of its random split: ``bnpo`` divides by the micro-batch's loss tokens,
the entropy bonus is the micro-batch's token-mean entropy, the entropy filter (``top_entropy_quantile``) cuts at
a quantile of the micro-batch's token entropies. DPPO's packing bins are token-balanced, not a random sample, so
no such statistic may be taken over a bin. DPPO carries each row's TRL micro-batch (TRL's shuffle replayed,
its token count, ``DPPOTrainer._trl_split_of_rows``): ``bnpo`` and the entropy bonus divide each row's term by
its own TRL micro-batch's count, wherever the row trains; under the filter the micro-batches are TRL's split
itself. With every row kept, DPPO's gradients are then GRPOTrainer's, for every loss type and option, here in
float64 with GA == spg (one optimizer step takes the batch) and, under the filter, also with GA < spg."""

import pytest
import torch
from conftest import cpu_config, random_reward
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.core.estimator import SUPPORTED_LOSS_TYPES

OPTIONS = {"plain": {}, "entropy_bonus": dict(entropy_coef=0.1), "entropy_filter": dict(top_entropy_quantile=0.5)}


class OptimizerGradients(TrainerCallback):
    """The flattened float64 gradient of the trainable parameters at each optimizer step."""

    def __init__(self):
        self.model, self.steps = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = [p.grad.flatten() for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        self.steps.append(torch.cat(grads).double())


def optimizer_gradients(cls, config_cls, tmp_path, model_dir, dataset, **settings):
    recorder = OptimizerGradients()
    args = cpu_config(tmp_path, cls=config_cls, max_grad_norm=0.0, steps_per_generation=2, cast_lm_head_to_fp32=False,
                      model_init_kwargs={"dtype": torch.float64}, **settings)  # fmt: skip
    trainer = cls(model_dir, random_reward, args=args, train_dataset=dataset, callbacks=[recorder])
    recorder.model = trainer.model
    trainer.train()
    return trainer, recorder.steps


def assert_grpos_gradients(tmp_path, model_dir, dataset, **settings):
    """DPPO with every row kept (packing on, its default) and GRPO from the same seed: the same gradient at every
    optimizer step, to 1e-6 of its norm (TRL's advantages are float32: scaling them by a row's factor rounds at
    about 3e-8; the statistic over a packing bin instead of TRL's micro-batch was off by 2% to 29%)."""
    _, grpo = optimizer_gradients(GRPOTrainer, GRPOConfig, tmp_path / "g", model_dir, dataset, **settings)
    dppo, steps = optimizer_gradients(DPPOTrainer, DPPOConfig, tmp_path / "d", model_dir, dataset,
                                      completion_keep_rate=1.0, **settings)  # fmt: skip
    assert dppo.args.packing and len(steps) == len(grpo) == settings["max_steps"]
    for g, d in zip(grpo, steps):
        assert float(g.norm()) > 0
        assert float((d - g).norm() / g.norm()) < 1e-6


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_one_step_of_the_generation_batch_is_grpos(tmp_path, tiny_model_dir, train_dataset, exact_logprobs,
                                                   loss_type, option):  # fmt: skip
    """spg = GA = 2: TRL's two micro-batches make one optimizer step."""
    assert_grpos_gradients(tmp_path, tiny_model_dir, train_dataset, loss_type=loss_type, max_steps=1,
                           gradient_accumulation_steps=2, **OPTIONS[option])  # fmt: skip


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_under_the_entropy_filter_each_step_is_grpos_also_with_fewer_accumulation_steps(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type
):
    """GA 1 < spg 2: under the filter DPPO's micro-batches are TRL's, in TRL's order, so each of the two optimizer
    steps of the generation batch takes GRPO's rows (without the filter, a fair random share: test_exactness)."""
    assert_grpos_gradients(tmp_path, tiny_model_dir, train_dataset, loss_type=loss_type, max_steps=2,
                           gradient_accumulation_steps=1, entropy_coef=0.1, top_entropy_quantile=0.5)  # fmt: skip


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
