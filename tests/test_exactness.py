"""Exactly GRPO's objective in the settings users run: a flash-attention stand-in, TRL's default token-mean
loss under prompt pruning, gradient_accumulation_steps < steps_per_generation, TRL's call sizes, equal-reward
groups whose float advantages are not 0, and Horvitz-Thompson-weighted metrics."""

import functools
import math

import pytest
import torch
import varlen_reference
from support.configs import cpu_config, simulated_vllm_config
from support.oracle import (
    dppo_loss_and_grad,
    generation_batch_of,
    make_trainer,
    padded_and_packed_loss_and_grad,
    synthetic_batch,
)
from support.recording import RecordingTrainer, append, recording
from support.sampler import SimulatedVLLM
from support.training import build, train
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOTrainer
from dppo_trl.core.packing import packed_allocation, plan_forward_calls
from dppo_trl.core.estimator import SUPPORTED_LOSS_TYPES, full_batch_normalizer, horvitz_thompson_weights
from dppo_trl.core.pruning import zero_spread_rows
from dppo_trl.components.generation_batch import GenerationBatch

VARLEN = varlen_reference.register()


# ----------------------------------------------------------------- 1. packing under flash semantics
@pytest.mark.parametrize("budget", [None, 12])
def test_packed_logprobs_equal_padded_under_flash_semantics(tmp_path, tiny_model_dir, train_dataset, budget):
    extra = {"model_init_kwargs": {"attn_implementation": VARLEN}}
    if budget is not None:
        extra["max_packed_tokens"] = budget  # several packed rows per call
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, "dapo", 0.05, 1, **extra)
    assert trainer.placement.layout.varlen_attention
    batch = synthetic_batch(trainer)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        lp, ent, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, width, compute_entropy=True
        )
        plp, pent, _ = trainer._packed_logps_and_entropies(trainer.model, ids, mask, width, compute_entropy=True)
    m = batch["completion_mask"].bool()
    # float32 values of about 5 computed through calls of other shapes: 1e-4 is about 200 ulps (1e-5 was 20).
    assert (lp[m] - plp[m]).abs().max() < 1e-4
    assert (ent[m] - pent[m]).abs().max() < 1e-4


@pytest.mark.parametrize("spg,ga,budget", [(1, 1, 16), (1, 1, None), (3, 1, 8)])
def test_packed_update_equals_padded_under_flash_semantics(tmp_path, tiny_model_dir, train_dataset, spg, ga, budget):
    """Several sequences per packed row and several rows in one call (budget 16: 0.1 mixed them, loss 1.62298
    against 1.62393 padded), the default budget (one row per call), and GA < spg."""
    extra = {} if budget is None else {"max_packed_tokens": budget}
    trainer = make_trainer(
        tmp_path, tiny_model_dir, train_dataset, "dapo", 0.0, spg, gradient_accumulation_steps=ga,
        model_init_kwargs={"attn_implementation": VARLEN}, **extra,
    )
    trainer.current_gradient_accumulation_steps = ga
    (loss, grad), (packed_loss, packed_grad) = padded_and_packed_loss_and_grad(trainer)
    assert float(packed_loss) == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(packed_grad, grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()))


def test_flash_semantics_trains_like_sdpa(tmp_path, tiny_model_dir, train_dataset):
    """The same run (packing, pruning, GA < spg) under sdpa and under the flash stand-in: the same losses. Prefix
    sharing off under both (the flash stand-in packs without it, and with GA < spg its plan places rows apart)."""
    common = dict(
        max_steps=2, steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=4,
        completion_keep_rate=0.75, prefix_sharing=False,
    )
    runs = [
        train(DPPOTrainer, tmp_path / attn, tiny_model_dir, train_dataset,
              model_init_kwargs={"attn_implementation": attn}, **common)
        for attn in ("sdpa", VARLEN)
    ]
    losses = [[h["loss"] for h in r.state.log_history if "loss" in h] for r in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)


# ------------------------------------------------------- 2. prompt pruning and the token-mean normalizer
# The expected step per loss type, by enumeration: tests/test_prompt_pruning.py.
NormalizerRecorder = recording(batch_keys=("num_items_in_batch", "completion_mask"), record_prompt_decisions=True)


def test_trainer_normalizes_by_the_token_count_fixed_before_the_draw(tmp_path, tiny_model_dir, train_dataset):
    """dapo under the cut: the token count is the candidates' expected one from the probe (G x the sum over every
    candidate of its probe's mean loss tokens), fixed before the acceptance draw, not the accepted batch's own
    count nor its weighted count."""
    trainer = train(NormalizerRecorder, tmp_path, tiny_model_dir, train_dataset.select(range(8)), max_steps=4,
                    prompt_keep_rate=0.5, completion_keep_rate=1.0, loss_type="dapo")
    assert len(trainer.records) == len(trainer.prompt_decisions) == 4
    differs = False
    for record, (weights, count, cut) in zip(trainer.records, trainer.prompt_decisions):
        expected = trainer.num_generations * float(cut.probe.loss_tokens.double().mean(1).sum())
        assert float(record["num_items_in_batch"]) == count == pytest.approx(expected, rel=1e-12)
        tokens = record["completion_mask"].sum(1).double()
        differs |= count not in (float(tokens.sum()), float((tokens * weights).sum()))
    assert differs


@pytest.mark.parametrize("setting", [{"scale_rewards": "batch"}, {"multi_objective_aggregation": "normalize_then_sum"}])
def test_batch_level_reward_statistics_are_refused_with_prompt_pruning(tmp_path, setting):
    with pytest.raises(ValueError, match="prompt_keep_rate"):
        cpu_config(tmp_path, prompt_keep_rate=0.5, **setting)


# ------------------------------------------------------------------ 3. GA < steps_per_generation
@pytest.mark.parametrize("kept", [list(range(16)), [0, 1, 2, 5, 6, 9, 10, 12, 13, 14]])
def test_each_optimizer_step_gets_a_fair_share_of_rows_when_ga_is_below_spg(tmp_path, tiny_model_dir, train_dataset,
                                                                             kept):
    spg, ga, rows, comp = 4, 2, 16, 5
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, "dapo", 0.0, spg, gradient_accumulation_steps=ga,
                           per_device_train_batch_size=rows // spg, num_generations=4, completion_keep_rate=1.0,
                           keep_floor=0.05)
    lengths = torch.tensor([1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 5, 5, 5, 5])  # long-tailed completion lengths
    keep = torch.zeros(rows, dtype=torch.bool)
    keep[kept] = True
    batch = {
        "prompt_ids": torch.full((rows, 2), 11), "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_ids": torch.full((rows, comp), 12),
        "completion_mask": (torch.arange(comp)[None] < lengths[:, None]).long(),
        "advantages": torch.ones(rows), "dppo_weight": keep.float(),
    }
    state = generation_batch_of(batch, keep)
    first_rows, first_long, first_sizes = [], [], set()
    for seed in range(400):
        trainer.args.prune_seed = seed
        split = {**batch, **trainer.placement.trl_split_of_rows(batch, state), "dppo_keep": keep}
        microbatches = trainer.placement.kept_microbatches(split, state)
        real = [mb["completion_mask"].sum(1) for mb in microbatches[:ga]]  # the first optimizer step's rows
        first_rows.append(sum(int((r > 0).sum()) for r in real))
        first_long.append(sum(int((r == comp).sum()) for r in real))
        first_sizes.add(tuple(int((mb["completion_mask"].sum(1) > 0).sum()) for mb in microbatches))
    assert sum(first_rows) / len(first_rows) == pytest.approx(len(kept) / 2, rel=0.05)
    assert sum(first_long) / len(first_long) == pytest.approx(int((lengths[keep] == comp).sum()) / 2, rel=0.1)
    if len(kept) < rows:
        assert len(first_sizes) > 1  # the micro-batches come in a random order, not a fixed one


# ---------------------------------------------------------------------------- 4. TRL's call sizes
def largest_calls(trainer):
    """Tokens allocated by every log-prob forward call (old, reference, loss; not generation) of the policy and
    reference models: TRL's padded calls carry `labels`, packed calls `shift_labels`."""
    sizes = []

    def hook(module, args, kwargs):
        if "labels" in kwargs or "shift_labels" in kwargs:
            sizes.append(kwargs["input_ids"].numel())

    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            model.register_forward_pre_hook(hook, with_kwargs=True)
    return sizes


@pytest.mark.parametrize("keep", [1.0, 0.5])
def test_no_forward_call_is_larger_than_trls(tmp_path, tiny_model_dir, train_dataset, keep):
    common = dict(max_steps=2, beta=0.05, steps_per_generation=4, gradient_accumulation_steps=2,
                  per_device_train_batch_size=4, max_completion_length=8)
    sizes = {}
    runs = [("grpo", GRPOTrainer, GRPOConfig, {}), ("dppo", DPPOTrainer, None, {"completion_keep_rate": keep})]
    for name, cls, cfg, extra in runs:
        trainer = build(cls, tmp_path / name, tiny_model_dir, train_dataset, config_cls=cfg, **common, **extra)
        sizes[name] = largest_calls(trainer)
        trainer.train()
    assert max(sizes["dppo"]) <= max(sizes["grpo"])


def test_forward_call_plans_stay_within_the_call_budget():
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 40, (), generator=generator))
        width = int(torch.randint(4, 60, (), generator=generator))
        lengths = torch.randint(1, width + 1, (n,), generator=generator).tolist()
        per_call = int(torch.randint(1, 6, (), generator=generator))
        for row_budget in (width, per_call * width, 5):
            calls = plan_forward_calls(lengths, per_call, row_budget, per_call * width)
            assert sorted(i for c in calls for i in c) == list(range(n))
            assert len(calls) <= max(1, math.ceil(n / per_call))  # never more calls than TRL's chunking
            for c in calls:
                assert packed_allocation([lengths[i] for i in c], row_budget, per_call * width) <= per_call * width
            shuffled = [lengths[i] for i in torch.randperm(n, generator=generator).tolist()]
            assert len(plan_forward_calls(shuffled, per_call, row_budget, per_call * width)) == len(calls)


# ------------------------------------------------------------- 5. equal rewards score exactly zero
def non_dyadic_constant_reward(prompts, completions, **kwargs):
    """Every completion of a prompt gets the same reward, 0.1 or 1/3 (not exact in binary floating point)."""
    return [0.1 if len(p) % 2 else 1.0 / 3.0 for p in prompts]


def test_equal_non_dyadic_rewards_keep_nothing_and_log_zero_advantage(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(RecordingTrainer, tmp_path, tiny_model_dir, train_dataset, reward=non_dyadic_constant_reward,
                    max_steps=2, num_generations=8, per_device_train_batch_size=16)
    assert any(bool((r["advantages"] != 0).any()) for r in trainer.records)  # TRL's float A is not exactly 0
    assert all(not r["dppo_keep"].any() for r in trainer.records)
    logs = [h for h in trainer.state.log_history if "dppo/zero_advantage_fraction" in h]
    assert logs and all(h["dppo/zero_advantage_fraction"] == 1.0 and h["dppo/kept_fraction"] == 0.0 for h in logs)


def test_zero_spread_rows_are_decided_from_rewards():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1 / 3, 1 / 3, 0.5, float("nan"), 0.7, 0.7])
    assert zero_spread_rows(rewards, 3).tolist() == [True] * 3 + [False] * 3 + [True] * 3


# ------------------------------------------------------------------------ 6. weighted metrics
@pytest.mark.parametrize("packing", [False, True])
def test_logged_metrics_are_horvitz_thompson_estimates(tmp_path, tiny_model_dir, train_dataset, packing):
    """One micro-batch of kept rows with weights 1/pi: TRL's token means become sum(w x m) / sum(w m)."""
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, "dapo", 0.0, 1, packing=packing)
    batch = synthetic_batch(trainer, seed=4)
    pi = torch.tensor([0.9, 0.0, 0.6, 0.3, 0.8, 0.5], dtype=torch.float64)
    keep = torch.tensor([True, False, True, True, False, True])
    weights = horvitz_thompson_weights(pi, keep)
    trainer._metrics["train"].clear()
    dppo_loss_and_grad(trainer, batch, keep, weights)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, batch["completion_ids"].size(1), compute_entropy=True
        )
    m = batch["completion_mask"].double() * weights[:, None]
    coef = torch.exp(logps.double() - batch["old_per_token_logps"].double())
    adv = batch["advantages"].double()[:, None]
    expected = {
        "entropy": entropies.double(),
        "clip_ratio/low_mean": ((coef < 0.8) & (adv < 0)).double(),
        "clip_ratio/high_mean": ((coef > 1.2) & (adv > 0)).double(),
    }
    unweighted = batch["completion_mask"].double() * keep.double()[:, None]
    for name, values in expected.items():
        [logged] = trainer._metrics["train"][name]
        assert logged == pytest.approx(float((values * m).sum() / m.sum()), rel=1e-5, abs=1e-6), name
    plain = {k: float((v * unweighted).sum() / unweighted.sum()) for k, v in expected.items()}
    assert max(abs(trainer._metrics["train"][k][0] - plain[k]) for k in plain) > 1e-2  # weighting matters here


def test_ess_and_weight_max_include_the_prompt_weights(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset.select(range(4)), max_steps=6,
                    prompt_keep_rate=0.5, completion_keep_rate=1.0)
    logs = [h for h in trainer.state.log_history if "dppo/prompt_weight_max" in h]
    assert logs and any(h["dppo/prompt_weight_max"] > 1 for h in logs)
    for h in logs:
        assert h["dppo/weight_max"] == pytest.approx(h["dppo/prompt_weight_max"])


def test_weight_max_is_the_largest_completion_times_prompt_weight(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(RecordingTrainer, tmp_path, tiny_model_dir, train_dataset.select(range(4)), max_steps=6,
                    prompt_keep_rate=0.5, completion_keep_rate=0.5)
    logs = [h for h in trainer.state.log_history if "dppo/weight_max" in h]
    assert len(logs) == len(trainer.records) == 6 and any(h["dppo/prompt_weight_max"] > 1 for h in logs)
    for h, r in zip(logs, trainer.records):
        assert h["dppo/weight_max"] == pytest.approx(float(r["dppo_weight"].max()), rel=1e-6)


SAMPLING_RECORD = ("importance_sampling_ratio", "old_per_token_logps", "sampling_per_token_logps", "completion_mask",
                   "dppo_keep", "dppo_weight")
WeightedSamplingRecorder = recording(DPPOTrainer, SimulatedVLLM, batch_keys=SAMPLING_RECORD, batch_dtype=torch.float64)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_sampling_means_are_horvitz_thompson_weighted(tmp_path, tiny_model_dir, train_dataset, mode):
    args = simulated_vllm_config(tmp_path, mode, max_steps=2, completion_keep_rate=0.5)
    trainer = train(WeightedSamplingRecorder, tmp_path, tiny_model_dir, train_dataset, args=args)
    logs = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    assert len(logs) == len(trainer.records) == 2
    for h, r in zip(logs, trainer.records):
        keep, w, m = r["dppo_keep"].bool(), r["dppo_weight"], r["completion_mask"]
        assert 0 < int(keep.sum()) < keep.numel() and len(set(w[keep].tolist())) > 1  # weights that differ
        ratio = r["importance_sampling_ratio"]
        wm = (m * w[:, None])[keep]
        if ratio.size(1) == 1:
            present = (m.sum(1) > 0).double()
            want = float((w * present * ratio[:, 0])[keep].sum() / (w * present)[keep].sum())
        else:
            want = float((ratio[keep] * wm).sum() / wm.sum())
        delta = (r["old_per_token_logps"] - r["sampling_per_token_logps"]).abs()
        assert h["sampling/importance_sampling_ratio/mean"] == pytest.approx(want, rel=1e-5)
        assert h["sampling/sampling_logp_difference/mean"] == pytest.approx(float((delta[keep] * wm).sum() / wm.sum()),
                                                                             rel=1e-5)
