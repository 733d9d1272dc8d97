"""bench_variance: the estimator math against explicit vector arithmetic, and a minimal run of the program."""

import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from support.outcomes import systematic_outcomes

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import bench_variance as bv  # noqa: E402

from dppo_trl.core.pruning import adaptive_keep_rate  # noqa: E402


def random_pool(batches=3, rows=6, params=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batches * rows, params, generator=g, dtype=torch.float64)
    c = torch.randn(batches * rows, generator=g, dtype=torch.float64)
    c[2] = 0.0  # a zero-advantage row
    return h, c


def test_squared_errors_match_explicit_vectors():
    h, c = random_pool()
    rows, b = 6, 1
    q = bv.batch_quadratics(h, c, rows)
    g = c[:, None] * h
    full = g.view(3, rows, -1).sum(1)
    mu = full.mean(0)
    weights = torch.rand(5, rows, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    err, noise = bv.squared_errors(weights, q, b)
    estimates = weights @ g[b * rows : (b + 1) * rows]
    torch.testing.assert_close(err, ((estimates - mu) ** 2).sum(1), rtol=1e-12, atol=0)
    torch.testing.assert_close(noise, ((estimates - full[b]) ** 2).sum(1), rtol=1e-12, atol=1e-14)
    block = g[b * rows : (b + 1) * rows]
    torch.testing.assert_close(q.gram[b], block @ block.T, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(q.norms[b], block.norm(dim=1), rtol=1e-12, atol=1e-14)
    assert q.population == pytest.approx(float(mu @ mu), rel=1e-12)
    assert float(q.full[b]) == pytest.approx(float(full[b] @ full[b]), rel=1e-12)
    # The full-weight estimator: the between-batch error only.
    err_full, noise_full = bv.squared_errors(torch.ones(1, rows, dtype=torch.float64), q, b)
    assert float(err_full) == pytest.approx(float(((full[b] - mu) ** 2).sum()), rel=1e-12)
    assert float(noise_full) == 0.0


def test_systematic_ht_over_every_start_point_is_exact():
    """For a fixed order, the keep set is piecewise constant in the start point; averaged over the pieces
    (weighted by length) the HT estimate is the batch gradient, and the quadratic forms give its exact MSE."""
    h, c = random_pool(batches=1, rows=7)
    q = bv.batch_quadratics(h, c, 7)
    g = c[:, None] * h
    pi = torch.tensor([0.3, 0.9, 0.0, 0.55, 0.25, 0.6, 0.4], dtype=torch.float64)
    outcomes = list(systematic_outcomes(pi, torch.arange(7)))
    lengths = torch.tensor([prob for prob, _, _ in outcomes], dtype=torch.float64)
    weights = torch.stack([w for _, _, w in outcomes])
    assert float(lengths.sum()) == pytest.approx(1.0)
    mean_estimate = (lengths[:, None] * (weights @ g)).sum(0)
    torch.testing.assert_close(mean_estimate, g[pi > 0].sum(0), rtol=1e-12, atol=1e-12)
    _, noise = bv.squared_errors(weights, q, 0)
    explicit = ((weights @ g - g.sum(0)) ** 2).sum(1)
    assert float((lengths * noise).sum()) == pytest.approx(float((lengths * explicit).sum()), rel=1e-10)


def test_oracle_probabilities_spend_the_budget_and_cap_at_one():
    norms = torch.tensor([0.0, 1.0, 5.0, 2.0, 0.5, 40.0], dtype=torch.float64)
    cost = torch.tensor([10.0, 20.0, 5.0, 40.0, 8.0, 30.0], dtype=torch.float64)
    pi = bv.oracle_probabilities(norms, cost, budget=50.0)
    assert float((pi * cost).sum()) == pytest.approx(50.0)
    assert pi[0] == 0 and float(pi.max()) <= 1.0 and pi[5] == 1.0
    free = (pi > 0) & (pi < 1)
    ratio = pi[free] / (norms[free] / cost[free].sqrt())
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(ratio[0])))
    assert bv.oracle_probabilities(norms, cost, budget=1e9).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def synthetic_batch():
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0], dtype=torch.float64)
    advantages = bv.group_advantages(rewards, 4)
    history = torch.tensor([0.8, 0.0, 0.5, 0.1], dtype=torch.float64)
    history_tokens = torch.tensor([5.0, 9.0, 12.0, 15.0], dtype=torch.float64)
    return bv.Batch(rewards, advantages, torch.full((16,), 4), torch.arange(3, 19), history, 4, history_tokens)


def test_advantages_compute_and_prompt_renormalization():
    batch = synthetic_batch()
    assert batch.advantages[4:8].tolist() == [0.0] * 4 and batch.scores[12:].tolist() == [0.0] * 4
    torch.testing.assert_close(batch.advantages[:4].sum(), torch.tensor(0.0, dtype=torch.float64))
    every = torch.ones(16, dtype=torch.bool)
    assert bv.padded_tokens(batch) == 16 * (4 + 18)
    assert bv.packed_tokens(batch, every, every) <= bv.padded_tokens(batch)
    assert bv.packed_tokens(batch, every, torch.zeros(16, dtype=torch.bool)) == 0
    # dapo under prompt pruning divides by D_b = G x the candidates' history tokens, whatever was accepted.
    total, d = float(batch.completion_tokens.sum()), 4 * (5.0 + 9.0 + 12.0 + 15.0)
    assert bv.prompt_token_normalizer(batch) == d
    for accepted in (torch.arange(16) < 8, torch.arange(16) >= 4):
        prompt_weights = torch.where(accepted, 2.0, 0.0).double()
        draw = bv.Draw(prompt_weights, accepted, accepted, prompt_weights, 0)
        torch.testing.assert_close(bv.effective_weights(draw, batch, "dapo"), prompt_weights * total / d,
                                   rtol=1e-15, atol=0)
        assert bv.effective_weights(draw, batch, "grpo") is draw.weights
    empty = bv.Draw(torch.zeros(16), torch.zeros(16, dtype=torch.bool), torch.zeros(16, dtype=torch.bool),
                    torch.zeros(16, dtype=torch.float64), 0)
    assert bv.effective_weights(empty, batch, "dapo").abs().sum() == 0


def test_prompt_pruning_under_dapo_is_unbiased_for_the_planned_normalizer():
    """Over every acceptance pattern of the synthetic batch (float64), prompt@'s dapo estimate has expectation
    ``N_b / D_b``: the batch gradient times ``T_b / D_b`` (its only bias, the history's length error); the
    prompt-weighted count it used before does not (a ratio estimate)."""
    from dppo_trl import DPPOConfig
    from dppo_trl.core.pruning import keep_probabilities

    batch = synthetic_batch()
    q, _ = keep_probabilities(batch.history, 0.5, DPPOConfig.prompt_keep_floor, zero_score_contributes=True)
    target = float(batch.completion_tokens.sum()) / bv.prompt_token_normalizer(batch)
    expected, ratio = torch.zeros(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64)
    for pattern in itertools.product([False, True], repeat=4):
        prob = math.prod(float(q[j]) if a else 1 - float(q[j]) for j, a in enumerate(pattern))
        rows = torch.tensor(pattern).repeat_interleave(4)
        prompt_weights = torch.where(rows, 1.0 / q.repeat_interleave(4), 0.0)
        expected += prob * bv.effective_weights(bv.Draw(prompt_weights, rows, rows, prompt_weights, 0), batch, "dapo")
        z = float((prompt_weights * batch.completion_tokens.double()).sum())
        ratio += prob * (prompt_weights * float(batch.completion_tokens.sum()) / z if z > 0 else 0.0)
    torch.testing.assert_close(expected, torch.full((16,), target, dtype=torch.float64), rtol=1e-12, atol=0)
    assert float((ratio - 1.0).abs().max()) > 0.05
    exact = bv.draw_design("prompt+exact_lengths@0.5", batch, torch.Generator().manual_seed(0))
    assert exact.prompt_weights is None and bv.effective_weights(exact, batch, "dapo") is exact.weights


def test_every_design_draws_weights_only_on_passed_rows():
    batch = synthetic_batch()
    norms = torch.rand(16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * (batch.scores > 0)
    for design in bv.available_designs():
        problems = {}
        spec = bv.parse_design(design)
        pi = bv.oracle_keep_probabilities(spec, batch, norms, problems) if spec.base == "oracle" else None
        first = bv.draw_design(design, batch, torch.Generator().manual_seed(7), problems, pi)
        again = bv.draw_design(design, batch, torch.Generator().manual_seed(7), None, pi)
        assert torch.equal(first.weights, again.weights) and first.tokens == again.tokens, design
        assert (first.weights[~first.passed] == 0).all() and not (first.passed & ~first.generated).any(), design


def test_design_grammar_and_its_errors(capsys):
    assert bv.parse_design("systematic+tokens+g-0.5@0.4") == bv.DesignSpec("systematic", 0.4, True, -0.5)
    assert bv.parse_design("poisson+g0.25@0.3") == bv.DesignSpec("poisson", 0.3, False, 0.25)
    assert bv.parse_design("stratified+tokens@0.4") == bv.DesignSpec("stratified", 0.4, True, 0.0)
    assert bv.parse_design("dppo+prompt@0.5") == bv.DesignSpec("dppo+prompt", 0.5)
    assert bv.parse_design("zero_variance") == bv.DesignSpec("zero_variance")
    assert bv.parse_design("stratified+e0.3@0.25") == bv.DesignSpec("stratified", 0.25, error=0.3)
    assert bv.parse_design("systematic+g0.1+tokens@0.5") == bv.DesignSpec("systematic", 0.5, True, 0.1)
    assert bv.parse_design("grpo").rate is None and bv.parse_design("topk@0.5").rate == 0.5
    for name in bv.unbiased_designs():
        assert bv.parse_design(f"{name}+tokens@0.4") == bv.DesignSpec(name, 0.4, True), name
    bad = ("tokens@0.4", "nope@0.5", "systematic", "grpo@0.5", "systematic@1.5", "systematic@x", "systematic+g@0.5",
           "systematic+g0.1+g0.2@0.5", "systematic+e0@0.5", "systematic+e-1@0.5", "systematic+x@0.5",
           "topk+tokens@0.5", "prompt")
    for design in bad:
        with pytest.raises(ValueError, match="is invalid.*expected .*'systematic'"):
            bv.parse_design(design)
    assert bv.available_designs(("grpo", "nope@0.5", "systematic@0.5")) == ["grpo", "systematic@0.5"]
    assert "'nope@0.5' skipped" in capsys.readouterr().err
    assert all(bv.parse_design(d) for d in bv.available_designs())
    with pytest.raises(SystemExit):
        bv.main(["--designs", "grpo", "tokens@0.4"])
    err = capsys.readouterr().err
    assert (
        "'tokens' is not a registered sampling design" in err
        and "<design>[+tokens][+g<gamma>][+e<target>]@<rate>" in err
    )


def test_batch_problem_is_the_trainers():
    batch = synthetic_batch()
    batch.completion_tokens[5] = 0
    problem = bv.batch_problem(batch, bv.parse_design("poisson+tokens+g0.25@0.4"))
    assert problem.budget_in_tokens and problem.length_exponent == 0.25 and problem.keep_rate == 0.4
    assert torch.equal(problem.costs, (batch.prompt_tokens + batch.completion_tokens).double())
    assert torch.equal(problem.groups, torch.arange(16) // 4) and torch.equal(problem.advantages, batch.advantages)
    assert problem.contributes_nothing.nonzero().flatten().tolist() == [5]
    pi = problem.keep_probabilities()
    assert float((pi * problem.costs).sum()) == pytest.approx(0.4 * float(problem.costs.sum()))
    rows = torch.arange(16) >= 8
    sub = bv.batch_problem(batch, bv.parse_design("systematic@0.5"), rows)
    assert torch.equal(sub.groups, torch.arange(8) // 4) and torch.equal(sub.costs, problem.costs[8:])
    problems = {}
    shared = bv.cached_problem(batch, bv.parse_design("systematic@0.5"), problems)
    bv.batch_draws("stratified@0.5", batch, problems, 3, ("k",), None)
    assert len(problems) == 1 and bv.cached_problem(batch, bv.parse_design("poisson@0.5"), problems) is shared
    adaptive = bv.batch_problem(batch, bv.parse_design("stratified+e0.2@0.25"))
    assert adaptive.keep_rate == adaptive_keep_rate(dataclasses.replace(adaptive, keep_rate=0.25), 0.2)


@pytest.mark.parametrize("variant", ["@0.5", "+tokens@0.4", "+g-0.5@0.5", "+e0.3@0.25"])
def test_registered_unbiased_designs_carry_inverse_pi(variant):
    """Every registered unbiased design, drawn through the benchmark: weight 1 / pi on kept rows, 0 elsewhere,
    and inclusion frequencies that match pi."""
    batch = synthetic_batch()
    for name in bv.unbiased_designs():
        design = name + variant
        problems = {}
        pi = bv.cached_problem(batch, bv.parse_design(design), problems).keep_probabilities()
        assert 0 < float(pi.sum()) < 16 and (pi[batch.scores == 0] == 0).all(), design
        draws = bv.batch_draws(design, batch, problems, 200, (design,), None)
        for d in draws:
            assert not (d.passed & (pi == 0)).any(), design
            torch.testing.assert_close(d.weights, torch.where(d.passed, 1.0 / pi, 0.0), rtol=1e-12, atol=0)
        frequency = torch.stack([d.passed for d in draws]).double().mean(0)
        assert float((frequency - pi).abs().max()) < 0.15, design  # 4 standard deviations


def test_balance_metrics_on_a_tiny_batch():
    batch = synthetic_batch()
    a, total = batch.advantages, float(batch.advantages.abs().sum())
    weights = torch.rand(3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    weights[1] = 1.0
    weights[2] = 0.0
    weights[2, 0] = 2.0  # only row 0 kept: its group is off by |2 A_0 - sum A_g0|, the others by |sum A_g| = 0
    explicit = [sum(abs(float((w[4 * g : 4 * g + 4] * a[4 * g : 4 * g + 4]).sum() - a[4 * g : 4 * g + 4].sum()))
                    for g in range(4)) / total for w in weights]
    imbalance = bv.group_imbalance(weights, batch)
    torch.testing.assert_close(imbalance, torch.tensor(explicit, dtype=torch.float64), rtol=1e-12, atol=0)
    assert float(imbalance[1]) == 0.0 and float(imbalance[0]) > 0
    assert float(imbalance[2]) == pytest.approx(2 * abs(float(a[0])) / total, abs=1e-12)
    zero = bv.Batch(batch.rewards * 0, batch.advantages * 0, batch.prompt_tokens, batch.completion_tokens,
                    batch.history, 4)
    assert bv.group_imbalance(weights, zero).tolist() == [0.0, 0.0, 0.0]
    stats = {}
    for design in ("grpo", "packing", "systematic@0.3", "poisson@0.3", "topk@0.5", "topk@0.25", "dppo+prompt@0.5"):
        draws = [bv.batch_draws(design, batch, {}, 50, (design,), None)]
        w = [torch.stack([bv.effective_weights(d, batch, "dapo") for d in draws[0]])]
        stats[design] = bv.balance_statistics(draws, w, [batch])
        assert all(v >= 0 for v in stats[design].values()), design
    for design in ("grpo", "packing"):
        assert stats[design] == {"kept_rows_sd": 0.0, "kept_tokens_rel_sd": 0.0, "group_imbalance": 0.0}
    assert stats["topk@0.5"]["kept_rows_sd"] == 0.0 and stats["topk@0.5"]["kept_tokens_rel_sd"] == 0.0
    assert stats["topk@0.25"]["group_imbalance"] > 0  # rows 0, 1, 2 and 11 (weight 1): off by |A_3| + |A_11|
    # Systematic keeps floor or ceil of sum(pi) = 4.8 rows (sd 0.4); Poisson's count varies more.
    assert 0.3 < stats["systematic@0.3"]["kept_rows_sd"] <= 0.5 < stats["poisson@0.3"]["kept_rows_sd"]
    assert stats["systematic@0.3"]["group_imbalance"] > 0 and stats["systematic@0.3"]["kept_tokens_rel_sd"] > 0
    assert stats["dppo+prompt@0.5"]["group_imbalance"] > 0
    # kept_tokens_rel_sd by hand: the kept tokens of each draw.
    draws = bv.batch_draws("poisson@0.3", batch, {}, 50, ("poisson@0.3",), None)
    tokens = torch.tensor([float(batch.cost[d.passed].sum()) for d in draws], dtype=torch.float64)
    assert stats["poisson@0.3"]["kept_tokens_rel_sd"] == pytest.approx(float(tokens.std(correction=0) / tokens.mean()))


def _row(checkpoint, loss_type, design, mse, bias=0.1):
    stats = dict(kept_fraction=0.5, compute=100.0, mse=mse, relative_error=1.0, bias=bias, bias_noise=0.1,
                 kept_rows_sd=0.0, kept_tokens_rel_sd=0.0, group_imbalance=0.0)
    return {"checkpoint": checkpoint, "loss_type": loss_type, "design": design, "keep_rate": None, **stats}


def test_merge_replaces_only_the_measured_designs_rows():
    designs = ["grpo", "systematic@0.5", "prompt@0.5", "oracle@0.5"]
    old = [_row(c, lt, d, mse) for c in (1, 2) for lt in ("dapo", "grpo") for d, mse in zip(designs, (4, 2, 8, 1))]
    saved = {"config": {"designs": designs}, "elapsed_s": 9.0, "checkpoints": [{}], "results": bv.add_ratios(old)}
    saved["summary"] = bv.summarize(saved["results"])
    fresh_rows = [_row(c, lt, d, mse, bias) for c in (1, 2) for lt in ("dapo", "grpo")
                  for d, mse, bias in (("grpo", 4, 0.0), ("prompt@0.5", 16, 0.01))]
    fresh = {"config": {"designs": ["grpo", "prompt@0.5"]}, "elapsed_s": 2.0, "results": bv.add_ratios(fresh_rows)}
    merged = bv.merge_results(json.loads(json.dumps(saved)), fresh)
    assert [(r["checkpoint"], r["loss_type"], r["design"]) for r in merged["results"]] == [
        (r["checkpoint"], r["loss_type"], r["design"]) for r in saved["results"]]
    by = {(r["checkpoint"], r["loss_type"], r["design"]): r for r in merged["results"]}
    assert by[1, "dapo", "prompt@0.5"]["mse"] == 16 and by[1, "dapo", "prompt@0.5"]["bias"] == 0.01
    assert by[2, "grpo", "prompt@0.5"]["efficiency"] == 4 / 16
    assert by[2, "grpo", "prompt@0.5"]["efficiency_to_oracle"] == (4 / 16) / 4  # against the kept oracle row
    assert by[1, "dapo", "systematic@0.5"] == saved["results"][1]
    assert {s["design"]: s["mse_ratio"] for s in merged["summary"] if s["loss_type"] == "dapo"}["prompt@0.5"] == 4
    assert merged["config"]["merged"] == [{"designs": ["grpo", "prompt@0.5"], "elapsed_s": 2.0, "same_pools": True}]
    # Another pool (another machine's model cache): refused, or merged keeping the fresh run's own ratios.
    for r in fresh["results"]:
        r["mse"] *= 1.25
    fresh["checkpoints"] = [{"steps": 1}]
    with pytest.raises(SystemExit, match="not the same pools"):
        bv.merge_results(saved, fresh)
    other = bv.merge_results(json.loads(json.dumps(saved)), fresh, new_pools=True)
    by = {(r["checkpoint"], r["loss_type"], r["design"]): r for r in other["results"]}
    assert by[1, "dapo", "grpo"] == saved["results"][0] and by[1, "dapo", "prompt@0.5"]["pool"] == 0
    assert by[1, "dapo", "prompt@0.5"]["efficiency"] == 4 / 16 and by[1, "dapo", "prompt@0.5"]["mse"] == 20
    assert other["config"]["merged"][0]["same_pools"] is False and other["config"]["merged"][0]["checkpoints"]


def reward_with_spread(completions, prompts=None, answer=None, **kwargs):
    """A reward that varies inside a group even for an untrained model (the structure is under test)."""
    return [float(len(c) % 2) for c in completions]


def test_bench_variance_runs_every_design_and_loss_type(tmp_path, monkeypatch, capsys):
    import dppo_trl.tasks.countdown

    monkeypatch.setattr(dppo_trl.tasks.countdown, "countdown_reward", reward_with_spread)
    out = tmp_path / "variance.json"
    rows = bv.main(["--checkpoints", "60", "--hidden-size", "32", "--layers", "1", "--batches", "2", "--prompts",
                    "2", "--prune-seeds", "20", "--model-cache", str(tmp_path), "--json", str(out)])
    by = {(r["loss_type"], r["design"]): r for r in rows}
    designs = bv.default_designs()
    assert {bv.parse_design(d).base for d in designs} >= set(bv.unbiased_designs())
    assert set(by) == {(lt, d) for lt in bv.LOSS_TYPES for d in designs}
    assert {"systematic+tokens@0.4", "systematic+tokens+g-0.5@0.4", "stratified+tokens@0.4"} <= set(designs)
    for lt in bv.LOSS_TYPES:
        grpo, packing = by[lt, "grpo"], by[lt, "packing"]
        assert grpo["mse"] > 0 and grpo["efficiency"] == 1.0 and grpo["compute_ratio"] == 1.0
        assert packing["mse"] == grpo["mse"] and packing["compute"] <= grpo["compute"]
        assert by[lt, "oracle@0.5"]["efficiency_to_oracle"] == 1.0
        for design in ("systematic@0.5", "poisson@0.5", "stratified@0.5", "dppo+prompt@0.5"):
            assert by[lt, design]["kept_fraction"] <= 0.6, design
        for design in ("systematic@0.75", "systematic@0.5", "poisson@0.5", "stratified@0.5", "oracle@0.5"):
            assert by[lt, design]["mse_to_batch"] > 0 and by[lt, design]["mse"] >= by[lt, design]["mse_to_batch"]
        assert by[lt, "grpo"]["group_imbalance"] == 0.0 and by[lt, "grpo"]["kept_rows_sd"] == 0.0
        assert by[lt, "packing"]["kept_tokens_rel_sd"] == 0.0 and by[lt, "topk@0.5"]["kept_rows_sd"] == 0.0
        assert by[lt, "systematic@0.5"]["group_imbalance"] > 0 and by[lt, "systematic@0.5"]["kept_rows_sd"] <= 0.5
        assert all(min(r["kept_rows_sd"], r["kept_tokens_rel_sd"], r["group_imbalance"]) >= 0 for r in rows)
    assert by["dapo", "zero_variance"]["mse_to_batch"] <= 1e-20 * by["dapo", "grpo"]["mse"]
    saved = json.loads(out.read_text())
    assert all("design" in r for r in saved["results"]) and len(saved["results"]) == len(rows)
    assert {s["design"] for s in saved["summary"]} == set(designs) and saved["config"]["designs"] == designs
    assert all(s["group_imbalance"] >= 0 and s["kept_tokens_rel_sd"] >= 0 for s in saved["summary"])
    assert 0.0 <= saved["checkpoints"][0]["zero_variance_share"] < 1.0
    assert not math.isnan(saved["summary"][0]["efficiency"])
    printed = capsys.readouterr().out
    assert "summary, loss_type=dapo" in printed and "imbal." in printed and "systematic+tokens+g-0.5@0.4 " in printed
