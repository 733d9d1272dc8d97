"""DPPOTrainer end to end on the offline tiny model: equivalence with GRPO, no wasted compute, degenerate
batches, the biased modes, metrics, seeds."""

import math

import pytest
import torch
from support.configs import TWO_MICRO_STEPS, cpu_config, float64_settings
from support.models import lora_config
from support.recording import RecordingTrainer, count_logprob_rows
from support.rewards import coarse_reward, constant_reward, random_reward
from support.training import build, losses_of, params_of, train
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.core.pruning import keep_probabilities, pruning_relative_error


def test_keep_rate_one_without_packing_is_exactly_grpo(tmp_path, tiny_model_dir, train_dataset):
    common = dict(max_steps=3, beta=0.05, steps_per_generation=2, gradient_accumulation_steps=2)
    grpo = train(GRPOTrainer, tmp_path / "g", tiny_model_dir, train_dataset, config_cls=GRPOConfig, **common)
    dppo = train(
        DPPOTrainer, tmp_path / "d", tiny_model_dir, train_dataset, completion_keep_rate=1.0, packing=False, **common
    )
    assert losses_of(grpo) == losses_of(dppo)
    for name, p in params_of(grpo).items():
        assert torch.equal(p, params_of(dppo)[name]), name


def assert_every_row_kept_trains_like_grpo(tmp_path, model_dir, dataset, loss_type, ga=2, **dppo_settings):
    """GRPO and DPPO (every row kept) from the same seed: the same losses and parameters, to float tolerance.
    ``ga < 2``: gradient_accumulation_steps below steps_per_generation (two optimizer steps per generation).
    In float64 (with the ``exact_logprobs`` fixture): AdamW's first steps move each parameter by about the
    learning rate times the sign of its gradient, so in float32 the rounding of a gradient near 0 moved a
    parameter by up to 0.65 of the tolerance here, more on another CPU."""
    common = dict(
        max_steps=4, beta=0.05, loss_type=loss_type, steps_per_generation=2, gradient_accumulation_steps=ga,
        num_iterations=2,
    )
    grpo = train(GRPOTrainer, tmp_path / "g", model_dir, dataset, config_cls=GRPOConfig, **common, **float64_settings())
    dppo = train(RecordingTrainer, tmp_path / "d", model_dir, dataset, **dppo_settings, **common, **float64_settings())
    assert next(dppo.model.parameters()).dtype == next(grpo.model.parameters()).dtype == torch.float64
    assert all(bool(r["dppo_keep"].all()) for r in dppo.records)
    assert losses_of(dppo) == pytest.approx(losses_of(grpo), rel=1e-4, abs=1e-6)
    for name, p in params_of(grpo).items():
        torch.testing.assert_close(params_of(dppo)[name], p, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "cispo"])
def test_packing_without_pruning_trains_like_grpo(tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type):
    assert_every_row_kept_trains_like_grpo(
        tmp_path, tiny_model_dir, train_dataset, loss_type, completion_keep_rate=1.0, packing=True
    )


@pytest.mark.parametrize("loss_type,ga", [("grpo", 2), ("dapo", 2), ("luspo", 2), ("dapo", 1), ("grpo", 1)])
def test_pruning_path_with_every_row_kept_matches_grpo(tmp_path, tiny_model_dir, train_dataset, exact_logprobs,
                                                       loss_type, ga):
    """keep_floor=1 makes every pi = 1: the deferred old/ref passes, the kept-row split, the weighted advantages,
    the normalizer rescale and the separate KL term must then reproduce GRPOTrainer step for step, also with
    gradient_accumulation_steps < steps_per_generation (padded micro-batches: TRL's own shuffled split)."""
    assert_every_row_kept_trains_like_grpo(
        tmp_path,
        tiny_model_dir,
        train_dataset,
        loss_type,
        ga=ga,
        completion_keep_rate=0.5,
        keep_floor=1.0,
        packing=False,
    )


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_packed_path_with_every_row_kept_matches_grpo_when_one_step_takes_the_generation(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type
):
    """With packing the micro-batches are token-balanced bins in a random order, not TRL's random split, so the
    equality with GRPO holds where one optimizer step takes the whole generation batch (GA == spg); with GA < spg
    each optimizer step gets a fair random share instead (tests/test_exactness.py)."""
    assert_every_row_kept_trains_like_grpo(
        tmp_path, tiny_model_dir, train_dataset, loss_type, completion_keep_rate=0.5, keep_floor=1.0
    )


@pytest.mark.parametrize(
    "use_peft,packing,sharing",
    [(False, False, None), (True, False, None), (False, True, False), (True, True, False), (True, True, None)],
)
def test_pruned_rows_never_reach_a_forward_pass(tmp_path, tiny_model_dir, train_dataset, use_peft, packing, sharing):
    """Only kept rows are forwarded: the old-policy and reference passes once for the rows some iteration keeps
    (num_iterations 2, each iteration its own draw), each iteration's loss pass for its own kept rows; with packing,
    their real tokens (with prefix sharing, fewer: a group's prompt once per call). The speed check, which times
    GRPO's passes once, is off."""
    kwargs = dict(
        max_steps=2,
        beta=0.05,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        per_device_train_batch_size=8,
        num_generations=4,
    )
    peft_config = lora_config() if use_peft else None
    totals = {}
    for name, cls, cfg, extra in [
        ("grpo", GRPOTrainer, GRPOConfig, {}),
        ("dppo", RecordingTrainer, DPPOConfig,
         {"completion_keep_rate": 0.5, "packing": packing, "prefix_sharing": sharing,
          "speed_check": False}),  # it forwards GRPO's rows once, on its timed batch
    ]:
        args = cpu_config(tmp_path / name, cls=cfg, **kwargs, **extra)
        trainer = cls(tiny_model_dir, random_reward, args=args, train_dataset=train_dataset, peft_config=peft_config)
        counter = count_logprob_rows(trainer)
        trainer.train()
        totals[name] = (counter, trainer)
    # GRPO: per generation batch of 16 rows, an old pass, a ref pass and num_iterations=2 loss passes.
    assert totals["grpo"][0]["rows"] == 16 * 4  # 2 optimizer steps x 2 micro-steps = 1 generation batch
    dppo = totals["dppo"][1]
    (record,) = dppo.records
    iterations = record["dppo_iteration_weights"] > 0  # (rows, 2): the rows each iteration keeps
    assert torch.equal(record["dppo_keep"], iterations.any(1))  # the passes' rows: those some iteration keeps
    assert not torch.equal(iterations[:, 0], iterations[:, 1])  # two draws (this seed), not one mask reused
    kept, trained = int(record["dppo_keep"].sum()), int(iterations.sum())
    assert dppo.args.steps_per_generation <= kept < 16  # no filler rows needed here
    assert totals["dppo"][0]["rows"] == kept * 2 + trained  # old + ref once, each iteration's loss pass
    if packing:  # the real tokens of those rows (not the pad token: an EOS that is the pad id), in each pass
        pad = dppo.processing_class.pad_token_id
        completion = (record["completion_ids"] != pad) & record["completion_mask"].bool()
        real = (record["prompt_mask"].sum(1) + completion.sum(1))[:, None]
        expected = int(real[record["dppo_keep"]].sum()) * 2 + int((real * iterations).sum())
        if sharing is False:
            assert totals["dppo"][0]["tokens"] == expected
        else:
            assert totals["dppo"][1].prefix_sharing.enabled and totals["dppo"][0]["tokens"] < expected


def test_deferred_logprob_passes_equal_trls_on_the_kept_rows(tmp_path, tiny_model_dir, train_dataset):
    args = cpu_config(
        tmp_path,
        beta=0.05,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        completion_keep_rate=0.5,
    )
    trainer = DPPOTrainer(
        tiny_model_dir, random_reward, args=args, train_dataset=train_dataset, peft_config=lora_config()
    )
    with torch.no_grad():  # make the adapter non-trivial so that policy != reference
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    trainer.model.train()
    inputs = [train_dataset[i] for i in range(16)]
    out = trainer._generate_and_score_completions(inputs)
    keep = out["dppo_keep"]
    assert 0 < int(keep.sum()) < 16
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    width = out["completion_ids"].size(1)
    with torch.no_grad():
        policy = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, width)[0]
        with trainer.model.disable_adapter():
            ref = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, width)[0]
    cm = out["completion_mask"][keep].bool()
    assert not torch.allclose(policy[keep][cm], ref[keep][cm], atol=1e-3)
    torch.testing.assert_close(out["old_per_token_logps"][keep][cm], policy[keep][cm], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["ref_per_token_logps"][keep][cm], ref[keep][cm], rtol=1e-5, atol=1e-5)
    assert torch.all(out["old_per_token_logps"][~keep] == 0)  # never computed


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_a_batch_with_nothing_kept_still_steps(tmp_path, tiny_model_dir, train_dataset, loss_type):
    trainer = build(RecordingTrainer, tmp_path, tiny_model_dir, train_dataset, reward=constant_reward, max_steps=2,
                    loss_type=loss_type, **TWO_MICRO_STEPS)
    before = params_of(trainer)
    trainer.train()
    assert all(not r["dppo_keep"].any() for r in trainer.records)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["grad_norm"] == 0.0
        assert h["dppo/kept_fraction"] == 0.0
    for name, p in params_of(trainer).items():
        assert torch.equal(p, before[name]), name


def test_metrics_reach_the_logs(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=1)
    logged = trainer.state.log_history[0]
    for key in [
        "dppo/kept_fraction",
        "dppo/kept_prompt_fraction",
        "dppo/kept_token_fraction",
        "dppo/ess",
        "dppo/weight_max",
        "dppo/token_density",
        "dppo/microbatch_imbalance",
        "dppo/zero_advantage_fraction",
        "dppo/compute_saved",
        "dppo/expected_keep_fraction",
    ]:
        assert key in logged, key
    assert logged["dppo/expected_keep_fraction"] == pytest.approx(0.5)
    assert 0.0 < logged["dppo/kept_fraction"] < 1.0


def test_same_seed_reproduces_masks_and_losses(tmp_path, tiny_model_dir, train_dataset):
    a = train(RecordingTrainer, tmp_path / "a", tiny_model_dir, train_dataset, max_steps=2, prune_seed=5)
    b = train(RecordingTrainer, tmp_path / "b", tiny_model_dir, train_dataset, max_steps=2, prune_seed=5)
    assert [r["dppo_keep"].tolist() for r in a.records] == [r["dppo_keep"].tolist() for r in b.records]
    assert losses_of(a) == losses_of(b)


def test_prune_seed_changes_only_the_masks(tmp_path, tiny_model_dir, train_dataset):
    runs = [
        train(
            RecordingTrainer,
            tmp_path / str(s),
            tiny_model_dir,
            train_dataset,
            max_steps=1,
            prune_seed=s,
            per_device_train_batch_size=16,
            num_generations=4,
            prune_sampling="poisson",
        )
        for s in (1, 2)
    ]
    first = [r.records[0] for r in runs]
    assert torch.equal(first[0]["completion_ids"], first[1]["completion_ids"])
    assert torch.equal(first[0]["advantages"], first[1]["advantages"])
    assert not torch.equal(first[0]["dppo_keep"], first[1]["dppo_keep"])


def test_topk_keeps_the_largest_advantages_unweighted(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(
        RecordingTrainer,
        tmp_path,
        tiny_model_dir,
        train_dataset,
        max_steps=2,
        prune_sampling="topk",
        completion_keep_rate=0.25,
    )
    for r in trainer.records:
        keep, adv = r["dppo_keep"], r["advantages"].abs()
        assert int(keep.sum()) == 2
        assert adv[keep].min() >= adv[~keep].max()
        assert torch.all(r["dppo_weight"][keep] == 1.0)


def test_zero_variance_drops_exactly_the_equal_reward_groups(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(
        RecordingTrainer,
        tmp_path,
        tiny_model_dir,
        train_dataset,
        reward=coarse_reward,
        max_steps=3,
        prune_sampling="zero_variance",
    )
    seen_dropped = False
    for r in trainer.records:
        groups_keep = r["dppo_keep"].view(-1, 4)
        varied = r["advantages"].view(-1, 4).abs().amax(1) > 0
        assert torch.equal(groups_keep.all(1), varied) and torch.equal(groups_keep.any(1), varied)
        assert torch.all(r["dppo_weight"][r["dppo_keep"]] == 1.0)
        seen_dropped |= bool((~varied).any())
    assert seen_dropped


def test_stratified_keeps_each_groups_and_signs_expected_count(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(
        RecordingTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=3, per_device_train_batch_size=16,
        prune_sampling="stratified", completion_keep_rate=0.5,
    )
    for r in trainer.records:
        keep, weight, adv = r["dppo_keep"], r["dppo_weight"].double(), r["advantages"]
        pi = torch.where(keep, 1.0 / weight.clamp(min=1e-12), 0.0)
        expected_pi, _ = keep_probabilities(adv, 0.5, trainer.args.keep_floor, zero_score_contributes=False)
        torch.testing.assert_close(pi[keep], expected_pi[keep], rtol=1e-6, atol=0)  # weights are 1 / pi
        groups = torch.arange(keep.numel()) // 4
        for g in range(int(groups.max()) + 1):
            for rows in (groups == g, (groups == g) & (adv > 0), (groups == g) & (adv < 0)):
                total = float(expected_pi[rows].sum())
                assert math.floor(total + 1e-6) <= int(keep[rows].sum()) <= math.ceil(total - 1e-6)


def test_balanced_under_trls_defaults_meets_the_token_budget_with_1_over_pi_weights(
    tmp_path, tiny_model_dir, train_dataset
):
    """dapo, beta 0, gradient_accumulation_steps < steps_per_generation: weights are 1 / pi, and the kept
    tokens are within one row of the token budget in every generation batch."""
    trainer = train(
        RecordingTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=4, loss_type="dapo", beta=0.0,
        steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=4,
        prune_sampling="balanced", keep_budget="tokens", completion_keep_rate=0.5,
    )
    assert len(trainer.records) == 2
    for r in trainer.records:
        keep, weight = r["dppo_keep"], r["dppo_weight"].double()
        tokens = (r["prompt_mask"].sum(1) + r["completion_mask"].sum(1)).double()
        floor = trainer.args.keep_floor
        pi, _ = keep_probabilities(r["advantages"], 0.5, floor, zero_score_contributes=False, costs=tokens)
        assert not keep[pi == 0].any()
        torch.testing.assert_close(weight[keep], 1.0 / pi[keep], rtol=1e-5, atol=0)
        assert abs(float(tokens[keep].sum()) - float((pi * tokens).sum())) < float(tokens.max())


def test_an_adaptive_keep_rate_meets_its_error_target_with_1_over_pi_weights(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(
        RecordingTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=2, completion_keep_rate=0.2,
        adaptive_keep_error=0.4, per_device_train_batch_size=16,
    )
    logged = [entry for entry in trainer.state.log_history if "dppo/keep_rate" in entry]  # one batch per step
    rates, errors = [e["dppo/keep_rate"] for e in logged], [e["dppo/pruning_error"] for e in logged]
    assert len(rates) == len(trainer.records) == 2 and all(0.2 <= r <= 1.0 for r in rates)
    assert any(r > 0.2 for r in rates)  # these batches need more than completion_keep_rate to meet 0.4
    for r, rate, error in zip(trainer.records, rates, errors):
        keep, weight, scores = r["dppo_keep"], r["dppo_weight"].double(), r["advantages"].double().abs()
        pi, _ = keep_probabilities(scores, rate, trainer.args.keep_floor, zero_score_contributes=False)
        torch.testing.assert_close(weight[keep], 1.0 / pi[keep], rtol=1e-5, atol=0)
        assert error <= 0.4 and error == pytest.approx(pruning_relative_error(pi, scores), rel=1e-5)
        if rate > 0.2:  # raised: 1e-3 below it the error is above the target
            lower, _ = keep_probabilities(scores, rate - 2e-3, trainer.args.keep_floor, zero_score_contributes=False)
            assert pruning_relative_error(lower, scores) > 0.4


def test_a_token_budget_and_compute_aware_scores_set_the_weights(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(
        RecordingTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=2, keep_budget="tokens",
        score_length_exponent=-0.5, per_device_train_batch_size=16,
    )
    for r in trainer.records:
        keep, weight = r["dppo_keep"], r["dppo_weight"].double()
        tokens = (r["prompt_mask"].sum(1) + r["completion_mask"].sum(1)).double()
        scores = r["advantages"].double().abs() * tokens**-0.5
        pi, _ = keep_probabilities(scores, 0.5, trainer.args.keep_floor, zero_score_contributes=False, costs=tokens)
        assert keep.any() and not keep[pi == 0].any()
        torch.testing.assert_close(weight[keep], 1.0 / pi[keep], rtol=1e-5, atol=0)


def test_rows_without_loss_tokens_are_never_kept(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(
        RecordingTrainer,
        tmp_path,
        tiny_model_dir,
        train_dataset,
        max_steps=2,
        beta=0.05,
        mask_truncated_completions=True,
        completion_keep_rate=0.9,
    )
    dead_seen = False
    for r in trainer.records:
        dead = r["completion_mask"].sum(1) == 0
        dead_seen |= bool(dead.any())
        assert not (r["dppo_keep"] & dead).any()
    assert dead_seen


def test_a_grpo_config_is_taken_with_dppos_defaults(tmp_path, tiny_model_dir, train_dataset):
    grpo_args = cpu_config(
        tmp_path, cls=GRPOConfig, steps_per_generation=2, gradient_accumulation_steps=1, loss_type="bnpo", beta=0.05
    )
    trainer = DPPOTrainer(tiny_model_dir, random_reward, args=grpo_args, train_dataset=train_dataset)
    assert isinstance(trainer.args, DPPOConfig)
    taken = ("loss_type", "beta", "steps_per_generation", "generation_batch_size", "per_device_train_batch_size",
             "learning_rate", "output_dir", "num_generations", "max_completion_length")
    for name in taken:
        assert getattr(trainer.args, name) == getattr(grpo_args, name), name
    defaults = {f.name: f.default for f in DPPOConfig.__dataclass_fields__.values()}
    for name in ("completion_keep_rate", "keep_floor", "prune_sampling", "packing", "prompt_keep_rate"):
        assert getattr(trainer.args, name) == defaults[name], name
    trainer.train()
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_init_mirrors_grpo_trainers_signature():
    import inspect

    ours = list(inspect.signature(DPPOTrainer.__init__).parameters.values())
    theirs = list(inspect.signature(GRPOTrainer.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


def test_no_reward_source_fails_as_grpo_does(tmp_path, tiny_model_dir, train_dataset):
    errors = []
    for cls, cfg in ((GRPOTrainer, GRPOConfig), (DPPOTrainer, DPPOConfig)):
        with pytest.raises(Exception) as raised:
            cls(tiny_model_dir, args=cpu_config(tmp_path / cls.__name__, cls=cfg), train_dataset=train_dataset)
        errors.append(raised)
    assert errors[0].type is errors[1].type and "reward" in str(errors[1].value).lower()


def no_reward(completions, **kwargs):
    return [None] * len(completions)


def test_summary_line_survives_rewards_that_are_all_none(tmp_path, tiny_model_dir, train_dataset, capsys):
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, reward=no_reward, max_steps=2)
    assert trainer.state.global_step == 2
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPPO summary:")]
    assert line and "2 steps" in line[0]
