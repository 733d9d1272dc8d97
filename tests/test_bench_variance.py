"""bench_variance: the estimator math against explicit vector arithmetic, and a minimal run of the program."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import bench_variance as bv  # noqa: E402

from dppo_trl.pruning import horvitz_thompson_weights, systematic_sample  # noqa: E402


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
    order = torch.arange(7)
    points = sorted({0.0, 1.0, *(float(x) % 1.0 for x in torch.cumsum(pi, 0))})
    lengths, weights = [], []
    for lo, hi in zip(points, points[1:]):
        if hi - lo > 1e-15:
            keep = systematic_sample(pi, order=order, start=(lo + hi) / 2)
            weights.append(horvitz_thompson_weights(pi, keep))
            lengths.append(hi - lo)
    lengths = torch.tensor(lengths, dtype=torch.float64)
    weights = torch.stack(weights)
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
    return bv.Batch(rewards, advantages, torch.full((16,), 4), torch.arange(3, 19), history, 4)


def test_advantages_compute_and_prompt_renormalization():
    batch = synthetic_batch()
    assert batch.advantages[4:8].tolist() == [0.0] * 4 and batch.scores[12:].tolist() == [0.0] * 4
    torch.testing.assert_close(batch.advantages[:4].sum(), torch.tensor(0.0, dtype=torch.float64))
    every = torch.ones(16, dtype=torch.bool)
    assert bv.padded_tokens(batch) == 16 * (4 + 18)
    assert bv.packed_tokens(batch, every, every) <= bv.padded_tokens(batch)
    assert bv.packed_tokens(batch, every, torch.zeros(16, dtype=torch.bool)) == 0
    prompt_weights = torch.where(torch.arange(16) < 8, 2.0, 0.0).double()
    draw = bv.Draw(prompt_weights, prompt_weights > 0, prompt_weights > 0, prompt_weights, 0)
    z = float(2.0 * batch.completion_tokens[:8].sum())
    total = float(batch.completion_tokens.sum())
    torch.testing.assert_close(bv.effective_weights(draw, batch, "dapo"), prompt_weights * total / z)
    assert bv.effective_weights(draw, batch, "grpo") is draw.weights
    empty = bv.Draw(torch.zeros(16), torch.zeros(16, dtype=torch.bool), torch.zeros(16, dtype=torch.bool),
                    torch.zeros(16, dtype=torch.float64), 0)  # fmt: skip
    assert bv.effective_weights(empty, batch, "dapo").abs().sum() == 0


def test_every_design_draws_weights_only_on_passed_rows():
    batch = synthetic_batch()
    norms = torch.rand(16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * (batch.scores > 0)
    for design in bv.DESIGNS:
        pi = bv.design_probabilities(design, batch, norms)
        first = bv.draw_design(design, batch, torch.Generator().manual_seed(7), pi)
        again = bv.draw_design(design, batch, torch.Generator().manual_seed(7), pi)
        assert torch.equal(first.weights, again.weights) and first.tokens == again.tokens, design
        assert (first.weights[~first.passed] == 0).all() and not (first.passed & ~first.generated).any(), design


def reward_with_spread(completions, prompts=None, answer=None, **kwargs):
    """A reward that varies inside a group even for an untrained model (the structure is under test)."""
    return [float(len(c) % 2) for c in completions]


def test_bench_variance_runs_every_design_and_loss_type(tmp_path, monkeypatch, capsys):
    import dppo_trl.countdown

    monkeypatch.setattr(dppo_trl.countdown, "countdown_reward", reward_with_spread)
    out = tmp_path / "variance.json"
    rows = bv.main(["--checkpoints", "60", "--hidden-size", "32", "--layers", "1", "--batches", "2", "--prompts",
                    "2", "--prune-seeds", "20", "--model-cache", str(tmp_path), "--json", str(out)])  # fmt: skip
    by = {(r["loss_type"], r["design"]): r for r in rows}
    assert set(by) == {(lt, d) for lt in bv.LOSS_TYPES for d in bv.DESIGNS}
    for lt in bv.LOSS_TYPES:
        grpo, packing = by[lt, "grpo"], by[lt, "packing"]
        assert grpo["mse"] > 0 and grpo["efficiency"] == 1.0 and grpo["compute_ratio"] == 1.0
        assert packing["mse"] == grpo["mse"] and packing["compute"] <= grpo["compute"]
        assert by[lt, "oracle@0.5"]["efficiency_to_oracle"] == 1.0
        for design in ("systematic@0.5", "poisson@0.5", "stratified@0.5", "dppo+prompt@0.5"):
            assert by[lt, design]["kept_fraction"] <= 0.6, design
        for design in ("systematic@0.75", "systematic@0.5", "poisson@0.5", "stratified@0.5", "oracle@0.5"):
            assert by[lt, design]["mse_to_batch"] > 0 and by[lt, design]["mse"] >= by[lt, design]["mse_to_batch"]
    assert by["dapo", "zero_variance"]["mse_to_batch"] <= 1e-20 * by["dapo", "grpo"]["mse"]
    saved = json.loads(out.read_text())
    assert all("design" in r for r in saved["results"]) and len(saved["results"]) == len(rows)
    assert {s["design"] for s in saved["summary"]} == set(bv.DESIGNS)
    assert 0.0 <= saved["checkpoints"][0]["zero_variance_share"] < 1.0
    assert not math.isnan(saved["summary"][0]["efficiency"])
    assert "summary, loss_type=dapo" in capsys.readouterr().out
