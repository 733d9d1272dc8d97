"""Packing on the architectures users train, against GRPOTrainer in float64 (docs/packing.md, "Which models pack").

A packed row holds several sequences; attention keeps them apart, but two kinds of model read across them:
- hybrid models (Bamba, Qwen3-Next, LFM2, Falcon-H1), whose convolution, state-space and linear-attention layers
  carry a state along the row: each sequence gets its own packed row (packed together, the second sequence of a row
  read the first one's state: gradients 5e-5 to 1.5e-2 off);
- rotary scalings whose frequencies follow a call's longest position (dynamic NTK, longrope): not packed (a packed
  call numbers positions up to its longest sequence, TRL's padded call up to its padded width).
The batch: the exact oracles' synthetic generation batch (completions of 1 to 5 tokens, one left-padded prompt),
every row kept at weight 1, one micro-batch; DPPO's loss and gradient through its own split and passes must be
GRPOTrainer's ``_compute_loss`` on the padded batch."""

import logging

import pytest
import torch
from support.configs import N_ROWS, cpu_config, float64_settings
from support.models import HYBRID_MODELS, LENGTH_DEPENDENT_ROPE, save_tiny_hybrid, save_tiny_rope
from support.oracle import as_float64, dppo_loss_and_grad, flat_gradient, synthetic_batch
from support.rewards import random_reward
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOTrainer
from dppo_trl.core.model_support import length_dependent_rope, sequence_mixing_layers

COMMON = dict(loss_type="dapo", per_device_train_batch_size=N_ROWS, steps_per_generation=1,
              gradient_accumulation_steps=1, num_generations=2, max_completion_length=5)


def trainer(cls, config_cls, tmp_path, model_dir, dataset, **settings):
    """``cls`` on the model in float64 (MoE experts looped: the grouped kernel takes no float64), in train mode,
    ready for one loss call."""
    float64 = float64_settings()
    float64["model_init_kwargs"]["experts_implementation"] = "eager"
    args = cpu_config(tmp_path, cls=config_cls, **COMMON, **float64, **settings)
    built = cls(model_dir, random_reward, args=args, train_dataset=dataset)
    built.model.train()
    built.current_gradient_accumulation_steps = 1
    return built


def grpo_loss_and_grad(grpo, batch):
    grpo.model.zero_grad()
    loss = GRPOTrainer._compute_loss(grpo, grpo.model, batch)
    loss.backward()
    return loss.detach().double(), flat_gradient(grpo.model)


def varied_batch(built):
    """The synthetic batch with its longest row shortened: the padded width (4 prompt + 5 completion columns)
    is one more than any real sequence (row 0's prompt is left-padded), as where a batch's longest prompt and
    longest completion are in different rows."""
    batch = synthetic_batch(built)
    batch["completion_mask"][4, 4:] = 0
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    lengths = batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)
    assert int(lengths.max()) == batch["prompt_ids"].size(1) + batch["completion_ids"].size(1) - 1
    return as_float64(batch)


def assert_dppo_is_grpo(tmp_path, model_dir, dataset, tolerance, **dppo_settings):
    grpo = trainer(GRPOTrainer, GRPOConfig, tmp_path / "g", model_dir, dataset)
    dppo = trainer(DPPOTrainer, None, tmp_path / "d", model_dir, dataset, completion_keep_rate=1.0, **dppo_settings)
    dppo.model.load_state_dict(grpo.model.state_dict())
    batch = varied_batch(grpo)
    grpo_loss, grpo_grad = grpo_loss_and_grad(grpo, batch)
    every_row = torch.ones(N_ROWS, dtype=torch.bool)
    dppo_loss, dppo_grad = dppo_loss_and_grad(dppo, batch, every_row, torch.ones(N_ROWS))
    assert float(grpo_grad.norm()) > 0
    assert abs(float(dppo_loss - grpo_loss)) <= tolerance * max(abs(float(grpo_loss)), 1e-3)
    assert float((dppo_grad - grpo_grad).norm() / grpo_grad.norm()) < tolerance
    return dppo


@pytest.fixture(scope="module", params=sorted(HYBRID_MODELS))
def hybrid_dir(request, tmp_path_factory):
    return request.param, save_tiny_hybrid(tmp_path_factory.mktemp(request.param), request.param)


def test_a_hybrid_model_packs_one_sequence_per_row_and_is_grpo(tmp_path, hybrid_dir, train_dataset, caplog):
    """A row budget of 64 tokens would hold the whole batch in one row. The models compute their norms and
    state-space scans partly in float32, hence 1e-6 (the packed rows were 5e-5 to 1.5e-2 off)."""
    kind, model_dir = hybrid_dir
    with caplog.at_level(logging.WARNING):
        dppo = assert_dppo_is_grpo(tmp_path, model_dir, train_dataset, 1e-6, packing=True, max_packed_tokens=64)
    assert dppo.args.packing and dppo.placement.layout.one_sequence_per_row and not dppo.prefix_sharing.places_units
    assert sum("one sequence in each row" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("rope_type", sorted(LENGTH_DEPENDENT_ROPE))
def test_a_length_dependent_rotary_is_not_packed_and_is_grpo(tmp_path, train_dataset, rope_type, exact_logprobs,
                                                             caplog):
    """Every real sequence is 8 positions or fewer, TRL's padded call has 9: beyond the original context of 8, so
    the frequencies differ where a call is packed."""
    model_dir = save_tiny_rope(tmp_path / "model", rope_type)
    with caplog.at_level(logging.WARNING):
        dppo = assert_dppo_is_grpo(tmp_path, model_dir, train_dataset, 1e-9, packing=True)
    assert not dppo.args.packing
    assert sum("Packing is off" in r.getMessage() for r in caplog.records) == 1


def test_models_of_attention_layers_pack_as_before(tiny_model_dir, tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    for directory in (tiny_model_dir, tiny_moe_dir):
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert sequence_mixing_layers(model, model.config) == []
        assert length_dependent_rope(model.config) is None


def test_the_kinds_of_layer_and_rotary_are_read_from_the_config():
    config = type("Config", (), {"layer_types": ["full_attention", "sliding_attention", "mamba"]})()
    assert sequence_mixing_layers(torch.nn.Linear(2, 2), config) == ["mamba"]
    assert sequence_mixing_layers(torch.nn.Conv1d(2, 2, 3), object()) == ["Conv1d"]
    for parameters, expected in [({"rope_type": "default"}, None), ({"rope_type": "yarn", "factor": 2.0}, None),
                                 ({"rope_type": "dynamic"}, "dynamic"), ({"type": "longrope"}, "longrope"),
                                 ({"full_attention": {"rope_type": "default"},
                                   "sliding_attention": {"rope_type": "dynamic"}}, "dynamic")]:
        assert length_dependent_rope(type("C", (), {"rope_parameters": parameters})()) == expected
