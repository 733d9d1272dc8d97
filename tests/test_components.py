"""The components on a fake view (``components.view.SingleProcessView``): no trainer, no TRL. Each one's decisions
follow from what it is given at construction and what its calls pass it."""

import pytest
import torch

from dppo_trl import DPPOConfig
from dppo_trl.adapters.grpo import GRPORewards
from dppo_trl.components.generation_batch import GenerationBatch
from dppo_trl.components.keep_decision import KeepDecision
from dppo_trl.components.view import SingleProcessView

GROUP = 4


def keep_decision(tmp_path, view, **fields):
    config = DPPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=GROUP, report_to=[], **fields)
    rewards = GRPORewards(torch.ones(1), GROUP, config.multi_objective_aggregation)
    return KeepDecision(config, rewards, view, zero_score_contributes=lambda: False)


def scored_batch():
    """Three groups of four rows: the second's rewards all equal (A is 0 there, TRL's float32 A 1e-4)."""
    rewards = torch.tensor([[1.0], [0.0], [2.0], [0.0], [1.0], [1.0], [1.0], [1.0], [0.0], [3.0], [1.0], [1.0]])
    advantages = torch.tensor([0.3, -0.8, 1.4, -0.8, 1e-4, 1e-4, -1e-4, 1e-4, -0.9, 1.6, -0.3, -0.3])
    lengths = torch.arange(12) % 5 + 1
    output = {
        "advantages": advantages,
        "prompt_mask": torch.ones(12, 3, dtype=torch.long),
        "completion_mask": (torch.arange(6)[None] < lengths[:, None]).long(),
    }
    return output, GenerationBatch(rewards_per_func=rewards)


def test_a_group_without_reward_spread_scores_exactly_zero(tmp_path):
    decision = keep_decision(tmp_path, SingleProcessView(), completion_keep_rate=0.5)
    output, batch = scored_batch()
    scores = decision.scores(output["advantages"], batch)
    assert scores[4:8].eq(0).all() and scores[:4].ne(0).all() and torch.equal(scores[8:], output["advantages"][8:])


def test_each_iteration_draws_its_own_mask_weighted_by_one_over_its_keep_probability(tmp_path):
    view = SingleProcessView(base_seed=3, steps_per_generation=2)
    decision = keep_decision(tmp_path, view, completion_keep_rate=0.5, num_iterations=3, steps_per_generation=2)
    output, batch = scored_batch()
    scores = decision.scores(output["advantages"], batch)
    decision.draw(output, batch, scores)
    weights, pi = batch.iteration_weights, batch.keep_probabilities
    assert weights.shape == (3, 12) and pi[4:8].eq(0).all()  # no signal: never kept
    kept = weights > 0
    assert torch.equal(weights[kept], (1 / pi).expand(3, 12)[kept])
    assert torch.equal(batch.keep, kept.any(0))
    assert batch.kept_rows_per_rank == [kept.any(0).nonzero().flatten().tolist()]
    assert batch.row_tokens[:, 1].tolist() == output["completion_mask"].sum(1).tolist()
    # each iteration's draw is the design's at that iteration's seed: the same again, another at another position
    again = keep_decision(tmp_path, view, completion_keep_rate=0.5, num_iterations=3, steps_per_generation=2)
    assert torch.equal(again.decide(scores, batch)[0], kept)
    view.position = 1000
    assert not torch.equal(again.decide(scores, batch)[0], kept)


def test_the_metrics_go_to_the_views_sink_one_entry_per_iteration(tmp_path):
    view = SingleProcessView()
    decision = keep_decision(tmp_path, view, completion_keep_rate=0.5, num_iterations=2)
    output, batch = scored_batch()
    scores = decision.scores(output["advantages"], batch)
    decision.draw(output, batch, scores)
    decision.log_metrics(batch, scores)
    assert view.metrics["dppo/logps_row_fraction"] == [float(batch.keep.float().mean())]
    assert view.metrics["dppo/zero_advantage_fraction"] == [float(torch.tensor(4 / 12, dtype=torch.float32))] * 2
    assert view.metrics["dppo/kept_fraction"] == [float((w > 0).float().mean()) for w in batch.iteration_weights]


def prefix_sharing(tmp_path, router_loss=False, **fields):
    from transformers import LlamaConfig

    from dppo_trl.components.prefix_sharing import PrefixSharing

    config = DPPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=GROUP, report_to=[],
                        per_device_train_batch_size=8, **fields)
    model_config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    return PrefixSharing(config, model_config, "sdpa", GROUP, router_loss, one_sequence_per_row=False)


def test_a_ranks_units_are_its_groups_whatever_order_it_holds_its_rows_in(tmp_path):
    sharing = prefix_sharing(tmp_path)
    assert sharing.enabled and sharing.places_units
    row_tokens = torch.tensor([[200, 3, 3]] * 4 + [[100, 5, 5]] * 4)  # long prompts: sharing pays
    rows = [6, 1, 4, 2, 0]
    units, lengths, counts = sharing.rank_units(rows, row_tokens)
    assert sorted(sorted(rows[p] for p in unit) for unit in units) == [[0, 1, 2], [4, 6]]
    # each prompt forwarded once (its last token starts each completion's branch: counted per row)
    assert sorted(lengths) == [(100 - 1) + 2 * (5 + 1), (200 - 1) + 3 * (3 + 1)] and sorted(counts) == [2, 3]
    shuffled = [2, 0, 6, 4, 1]
    again = sharing.rank_units(shuffled, row_tokens)[0]
    assert sorted(sorted(shuffled[p] for p in u) for u in again) == sorted(sorted(rows[p] for p in u) for u in units)


def test_prefix_sharing_true_where_it_is_not_exact_is_refused_and_none_turns_it_off(tmp_path):
    with pytest.raises(ValueError, match="prefix_sharing=True is not exact for this model"):
        prefix_sharing(tmp_path, router_loss=True, prefix_sharing=True)
    assert not prefix_sharing(tmp_path, router_loss=True).enabled
    assert not prefix_sharing(tmp_path, packing=False).places_units


def test_trls_means_over_the_kept_rows_become_weighted_estimates_in_the_views_sink():
    from dppo_trl.components.weighted_metrics import PolicyRatioSettings, WeightedMetrics

    view = SingleProcessView()
    names = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    for name in names:
        view.log_metric(name, -1.0)  # TRL's plain means of this micro-batch
    settings = PolicyRatioSettings("dapo", 0.2, 0.2, "token", "token_truncate", None, 2.0)
    metrics = WeightedMetrics(lambda: settings, view)
    entropies = torch.tensor([[1.0, 2.0, 0.0], [4.0, 4.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    logps = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)  # one token's ratio e^-1 < 0.8
    inputs = {"old_per_token_logps": old}
    metrics.log_loss_metrics(inputs, torch.tensor([1.0, -1.0]), logps, entropies, mask, torch.tensor([1.0, 3.0]))
    assert view.metrics["entropy"] == [pytest.approx((1 + 2 + 3 * 12) / (2 + 3 * 3))]
    assert view.metrics["clip_ratio/low_mean"] == [pytest.approx(3 / 11)]  # A < 0 and the ratio under 1 - eps
    assert view.metrics["clip_ratio/high_mean"] == [0.0]


def test_a_sampling_metric_without_an_estimate_is_dropped_not_logged_as_trls():
    from dppo_trl.components.weighted_metrics import PolicyRatioSettings, WeightedMetrics

    view = SingleProcessView()
    for name in ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max",
                 "sampling/sampling_logp_difference/max"):
        view.log_metric(name, 7.0)
    settings = PolicyRatioSettings("dapo", 0.2, 0.2, "token", "token_truncate", None, 2.0)
    output = {
        "old_per_token_logps": torch.zeros(2, 2), "sampling_per_token_logps": torch.full((2, 2), float("nan")),
        "completion_mask": torch.ones(2, 2), "importance_sampling_ratio": torch.ones(2, 2),
        "dppo_weight": torch.tensor([2.0, 0.0]), "dppo_origin_rank": torch.zeros(2, dtype=torch.long),
    }
    WeightedMetrics(lambda: settings, view).recompute_vllm_importance_sampling(output, torch.tensor([0]))
    # the kept row's tokens were never scored by the sampler: no logp difference, a ratio of 1
    assert "sampling/sampling_logp_difference/mean" not in view.metrics
    assert "sampling/sampling_logp_difference/max" not in view.metrics
    assert view.metrics["sampling/importance_sampling_ratio/mean"] == [1.0]


def placement(tmp_path, view, **fields):
    from dppo_trl.components.placement import ModelLayout, RowPlacement

    config = DPPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=GROUP, report_to=[],
                        per_device_train_batch_size=4, prefix_sharing=False, **fields)
    sharing = prefix_sharing(tmp_path, prefix_sharing=False)
    return RowPlacement(config, ModelLayout(packing=config.packing), sharing, view, follow_trl_split=False,
                        per_sequence_ratio=lambda: False, pad_token_id=0, tolerance=0.1)


def padded_rows(lengths: list[tuple[int, int]], prompt_width=4, completion_width=5, seed=0):
    """TRL's padded rows: prompts left-padded, completions right-padded, token ids drawn in [1, 50)."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    prompt_ids = torch.randint(1, 50, (n, prompt_width), generator=g)
    completion_ids = torch.randint(1, 50, (n, completion_width), generator=g)
    prompt_mask = torch.stack([(torch.arange(prompt_width) >= prompt_width - p).long() for p, _ in lengths])
    completion_mask = torch.stack([(torch.arange(completion_width) < c).long() for _, c in lengths])
    return {"prompt_ids": prompt_ids * prompt_mask, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids * completion_mask, "completion_mask": completion_mask}


def test_a_packed_call_puts_each_completion_token_back_where_trl_has_it(tmp_path):
    rows = padded_rows([(4, 5), (2, 1), (3, 3), (1, 5), (4, 2)])
    call = placement(tmp_path, SingleProcessView()).packed_call(
        torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1),
        torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1), 5, torch.float32,
    )
    assert call.model_inputs["input_ids"].numel() < 5 * 9  # padding-free: fewer positions than TRL's padded call
    # the packed labels, unpacked, are the completion tokens: each log-prob lands on its token
    labels = call.unpacked(call.model_inputs["shift_labels"].double(), torch.float64)
    assert torch.equal(labels.long() * rows["completion_mask"], rows["completion_ids"])


def test_the_kept_rows_fill_the_microbatches_once_each_the_rest_zero_weight_fillers(tmp_path):
    from dppo_trl.components.generation_batch import GenerationBatch

    view = SingleProcessView(steps_per_generation=2)
    rows = padded_rows([(4, 5), (2, 1), (3, 3), (1, 5), (4, 2), (2, 2), (3, 1), (1, 1)])
    keep = torch.tensor([True, False, True, True, False, True, True, False])
    rows.update(advantages=torch.arange(8.0) + 1, dppo_keep=keep, dppo_weight=keep.double() * 2)
    lengths = rows["prompt_mask"].sum(1) + rows["completion_mask"].sum(1)
    batch = GenerationBatch(row_tokens=torch.stack([rows["prompt_mask"].sum(1), rows["completion_mask"].sum(1),
                                                    rows["completion_mask"].sum(1)], 1),
                            kept_rows_per_rank=[keep.nonzero().flatten().tolist()])
    placer = placement(tmp_path, view, steps_per_generation=2, packing=True)
    rows.update(placer.trl_split_of_rows(rows, batch))
    microbatches = placer.kept_microbatches(rows, batch)
    assert len(microbatches) == 2 and batch.kept_lengths_per_rank == [lengths[keep].tolist()]
    trained = torch.cat([mb["advantages"][mb["dppo_weight"] > 0] for mb in microbatches])
    assert sorted(trained.tolist()) == rows["advantages"][keep].tolist()  # each kept row once, none other
    fillers = torch.cat([mb["completion_mask"][mb["dppo_weight"] == 0].sum(1) for mb in microbatches])
    assert (fillers == 0).all()  # a filler has no loss token
    assert len(view.metrics["dppo/token_density"]) == 1 and 0 < view.metrics["dppo/token_density"][0] <= 1
    again = placer.kept_microbatches(rows, batch)  # the plan is the seed's: the same again
    assert all(torch.equal(a["advantages"], b["advantages"]) for a, b in zip(microbatches, again))


def test_the_cut_accepts_every_candidate_until_it_knows_them_then_m_of_p_weighted_one_over_pi(tmp_path):
    from dppo_trl.components.generation_batch import GenerationBatch
    from dppo_trl.components.prompt_cut import PromptCutter

    config = DPPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=GROUP, report_to=[],
                        prompt_keep_rate=0.5, prompt_probe_generations=0, prompt_score="ema")
    view = SingleProcessView()
    cutter = PromptCutter(config, GRPORewards(torch.ones(1), GROUP), view)
    keys = ["a", "b", "c", "d"]
    first = cutter.decide(keys, None, candidates_per_rank=4)
    assert first.accepted.all() and first.normalizer is None and cutter.state_dict() is not None
    rewards = torch.tensor([[0.0], [1.0], [0.0], [1.0]] * 2 + [[1.0]] * 8)  # a, b spread; c, d flat
    batch = GenerationBatch(rewards_per_func=rewards, row_tokens=torch.tensor([[3, 5, 5]] * 16), cut=first)
    scores = torch.tensor([1.0, -1.0, 1.0, -1.0] * 2 + [0.0] * 8)
    weights, normalizer = cutter.take_decision(scores, batch)
    assert torch.equal(weights, torch.ones(16, dtype=torch.float64)) and normalizer is None
    assert view.metrics["dppo/prompt_accepted_fraction"] == [1.0] and view.metrics["dppo/prompt_flat_fraction"] == [0.5]
    second = cutter.decide(keys, None, candidates_per_rank=4)
    assert int(second.accepted.sum()) == 2 and float(second.pi.sum()) == pytest.approx(2.0)
    assert second.normalizer == pytest.approx(4 * 4 * 5)  # GRPO's count, every candidate's group: fixed before


def test_the_audit_ledger_counts_compares_and_alarms_on_a_consistent_shortfall(tmp_path):
    from dppo_trl.components.audit import COUNTED, PRUNED, AuditLedger

    config = DPPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=GROUP, report_to=[], audit_every=1,
                        completion_keep_rate=0.5)
    view = SingleProcessView()
    ledger = AuditLedger(config, view, iterations=1, speed_refusal=None)
    assert ledger.plan(index=0, batches=10) == COUNTED
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    for i in range(12):  # DPPO's gradient 30% short of GRPO's along it, every time: a bias
        ledger.count(PRUNED)
        ledger.record_comparison((0.7 + 0.01 * (i % 3 - 1)) * g, g, PRUNED, model_error=0.1)
    records = ledger.records
    assert records["audits"] == 12 and records["projection"] == pytest.approx([-0.3 + 0.01 * (i % 3 - 1)
                                                                               for i in range(12)])
    assert records["alarm_at"] is not None and "BIAS ALARM" in ledger.summary()
    assert view.metrics["dppo/audit_noise_to_signal"][0] == pytest.approx(0.31 / 0.1)
    restored = AuditLedger(config, SingleProcessView(), iterations=1, speed_refusal=None)
    restored.load_state_dict(ledger.state_dict())  # a resumed run goes on with the statistic
    assert restored.records == records and restored.summary() == ledger.summary()
