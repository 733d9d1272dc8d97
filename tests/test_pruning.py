"""The pure pruning math: keep probabilities, sampling designs, weights, normalizers."""

import dataclasses
import itertools
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.configs import LOSS_TYPES, validation_config
from support.marks import slow_unless
from support.outcomes import poisson_outcomes, systematic_outcomes

from dppo_trl.core import pruning
from dppo_trl.core.cube import cube_outcomes
from dppo_trl.core.estimator import (
    effective_sample_size,
    full_batch_normalizer,
    horvitz_thompson_weights,
    trl_microbatch_normalizer,
)
from dppo_trl.core.pruning import (
    PruneProblem,
    adaptive_keep_rate,
    balancing_variables,
    get_design,
    grouped_order,
    keep_probabilities,
    pruning_relative_error,
    sampling_designs,
    stratified_order,
    topk_mask,
    unbiased_designs,
    zero_variance_mask,
)

scores_strategy = st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 10.0)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(scores=scores_strategy, rate=st.floats(0.05, 1.0), floor=st.floats(0.01, 1.0), zero=st.booleans())
def test_keep_probabilities_meet_the_budget_within_bounds(scores, rate, floor, zero):
    s = torch.tensor(scores, dtype=torch.float64)
    pi, _ = keep_probabilities(s, rate, floor, zero_score_contributes=zero)
    eligible = torch.ones_like(s, dtype=torch.bool) if zero else s > 0
    assert torch.all(pi[~eligible] == 0)
    assert torch.all((pi[eligible] >= floor - 1e-12) & (pi[eligible] <= 1 + 1e-12))
    budget = rate * len(scores)
    e = int(eligible.sum())
    if e == 0:
        return
    if budget >= e:
        assert torch.allclose(pi[eligible], torch.ones(e, dtype=torch.float64))
    elif floor * e >= budget:
        # The floor alone exceeds the budget: keep more, never fewer.
        assert float(pi.sum()) >= budget - 1e-9
    else:
        assert float(pi.sum()) == pytest.approx(budget, rel=1e-9, abs=1e-9)
    # Monotone in the score among the eligible rows.
    order = torch.argsort(s[eligible])
    assert torch.all(torch.diff(pi[eligible][order]) >= -1e-12)


def test_rows_that_contribute_nothing_are_never_kept():
    s = torch.tensor([1.0, 2.0, 0.0, 3.0])
    dead = torch.tensor([False, True, False, False])
    pi, _ = keep_probabilities(s, 0.5, 0.05, zero_score_contributes=True, contributes_nothing=dead)
    assert pi[1] == 0 and pi[2] > 0
    assert float(pi.sum()) == pytest.approx(2.0)


def test_keep_probabilities_proportional_between_the_clips():
    s = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 100.0])
    pi, tau = keep_probabilities(s, keep_rate=0.5, keep_floor=0.05, zero_score_contributes=False)
    assert pi[0] == 0 and pi[5] == 1.0
    assert float(pi.sum()) == pytest.approx(3.0)
    assert pi[1:5].tolist() == pytest.approx((s[1:5] / tau).tolist())
    pi_kl, _ = keep_probabilities(s, keep_rate=0.5, keep_floor=0.05, zero_score_contributes=True)
    assert pi_kl[0] == pytest.approx(0.05)


@pytest.mark.parametrize("seed", range(5))
def test_systematic_inclusion_probabilities_are_exact(seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(9, generator=g) * torch.randint(0, 2, (9,), generator=g)
    pi, _ = keep_probabilities(s, 0.4, 0.1, zero_score_contributes=False)
    order = torch.randperm(9, generator=g)
    inclusion = torch.zeros(9, dtype=torch.float64)
    total = 0.0
    for prob, keep, _ in systematic_outcomes(pi, order, min_width=0.0):
        inclusion += prob * keep.double()
        total += prob
        assert int(keep.sum()) in (math.floor(float(pi.sum()) + 1e-9), math.ceil(float(pi.sum()) - 1e-9))
    assert total == pytest.approx(1.0)
    assert inclusion.tolist() == pytest.approx(pi.tolist(), abs=1e-9)


def _chi_square_ok(counts, expected, dof):
    stat = float((((counts - expected) ** 2) / expected).sum())
    # 99.9% quantile of chi-square via the Wilson-Hilferty approximation.
    z = 3.09
    q = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < q, stat, q


def signed_problem(keep_rate=0.4, group_size=4):
    """Three groups of 4 with signed advantages (one zero-spread group) and mixed lengths."""
    a = torch.tensor([0.1, -0.2, 0.5, -1.0, 1.5, -2.0, 3.0, -0.05, 0.0, 0.0, 0.0, 0.0]).double()
    costs = torch.tensor([30, 5, 12, 80, 7, 7, 100, 3, 40, 9, 15, 60])
    rewards = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1]).double()
    return PruneProblem(a, costs, torch.arange(12) // group_size, rewards, keep_rate, keep_floor=0.05)


def strata_of(problem):
    """Row masks of each group and of each (group, sign of A) within it."""
    groups, sign = problem.groups, torch.sign(problem.advantages)
    masks = [groups == g for g in torch.unique(groups)]
    return masks + [(groups == g) & (sign == s) for g in torch.unique(groups) for s in (-1, 1)]


@pytest.mark.parametrize("design", ["systematic", "poisson", "stratified", slow_unless(False, "balanced")])
def test_inclusion_frequencies_match_pi(design, monkeypatch):
    problem = signed_problem()
    s = problem.scores
    pi, _ = keep_probabilities(s, 0.4, 0.05, zero_score_contributes=False)
    assert torch.equal(get_design(design)(problem, torch.Generator())[1], pi)
    monkeypatch.setattr(PruneProblem, "keep_probabilities", lambda self: pi)  # the same pi, solved once
    g = torch.Generator().manual_seed(123)
    draws = 4000 if design == "balanced" else 20000  # the cube walk is ~1 ms a draw
    counts = torch.zeros(len(s), dtype=torch.float64)
    sizes = set()
    strata = strata_of(problem)
    for draw in range(draws):
        keep, design_pi = get_design(design)(problem, g)
        counts += keep.double()
        sizes.add(int(keep.sum()))
        if design == "stratified" and draw < 2000:  # each group and each sign in it: its expected count, +-1 row
            for mask in strata:
                expected = float(pi[mask].sum())
                assert math.floor(expected + 1e-9) <= int(keep[mask].sum()) <= math.ceil(expected - 1e-9)
    assert torch.equal(design_pi, pi)
    assert counts[s == 0].sum() == 0
    live = pi > 0
    # Per-row binomial chi-square: (kept, dropped) counts against (pi, 1 - pi).
    expected_keep = draws * pi[live]
    expected_drop = draws * (1 - pi[live])
    cells = torch.cat([counts[live], draws - counts[live]])
    expected = torch.cat([expected_keep, expected_drop])
    nonzero = expected > 0
    ok, stat, q = _chi_square_ok(cells[nonzero], expected[nonzero], dof=int(live.sum()))
    assert ok, f"chi-square {stat:.1f} above the 99.9% quantile {q:.1f}"
    if design != "poisson":
        assert sizes <= {math.floor(float(pi.sum())), math.ceil(float(pi.sum()))}


@pytest.mark.parametrize("seed", range(4))
def test_stratified_is_exact_over_every_start_point_of_every_group_order(seed):
    """For ANY group order the design draws, the start point alone makes each inclusion probability exactly pi;
    every outcome keeps each group's and each sign's expected count up to one row."""
    problem = signed_problem(keep_rate=0.3 + 0.1 * seed)
    pi = problem.keep_probabilities()
    order = stratified_order(problem.advantages, problem.costs, problem.groups, torch.Generator().manual_seed(seed))
    groups = problem.groups[order]
    assert int((groups[1:] != groups[:-1]).sum()) == 2  # three groups, each one run of consecutive rows
    inclusion, total = torch.zeros(12, dtype=torch.float64), 0.0
    for prob, keep, _ in systematic_outcomes(pi, order, min_width=0.0):
        inclusion += prob * keep.double()
        total += prob
        if prob < 1e-12:  # a start point on a breakpoint (rounding of cumsum): probability zero
            continue
        for mask in strata_of(problem):
            expected = float(pi[mask].sum())
            assert math.floor(expected + 1e-9) <= int(keep[mask].sum()) <= math.ceil(expected - 1e-9)
    assert total == pytest.approx(1.0) and inclusion.tolist() == pytest.approx(pi.tolist(), abs=1e-12)
    for g in torch.unique(groups):  # within a group: positive advantages first, then by length, longest first
        rows = order[groups == g]
        keys = [(-int(torch.sign(problem.advantages[r])), -int(problem.costs[r])) for r in rows]
        assert keys == sorted(keys)


@pytest.mark.parametrize("rate,tokens", [(0.3, False), (0.5, False), (0.4, True), (0.6, True)])
def test_balanced_is_exact_over_every_outcome_and_meets_its_budget(rate, tokens):
    """Every outcome of the cube walk, with its probability: row n is kept with probability exactly pi[n]; every
    outcome meets the budget (kept count floor/ceil of sum pi, or kept tokens within one row of the token budget)."""
    problem = dataclasses.replace(signed_problem(keep_rate=rate), budget_in_tokens=tokens)
    pi, costs = problem.keep_probabilities(), problem.costs.double()
    g = torch.Generator().manual_seed(int(rate * 10))
    x = balancing_variables(pi, problem, g)
    order = grouped_order(problem.groups, g)
    assert int((problem.groups[order][1:] != problem.groups[order][:-1]).sum()) == 2  # one run of rows per group
    inclusion, total = torch.zeros(12, dtype=torch.float64), 0.0
    outcomes = list(cube_outcomes(pi, x, order))
    for prob, keep in outcomes:
        inclusion, total = inclusion + prob * keep.double(), total + prob
        if tokens:
            assert abs(float(costs[keep].sum()) - float((pi * costs).sum())) < float(costs[pi > 0].max())
        else:
            assert math.floor(float(pi.sum()) + 1e-9) <= int(keep.sum()) <= math.ceil(float(pi.sum()) - 1e-9)
    assert total == pytest.approx(1.0, abs=1e-12)
    assert inclusion.tolist() == pytest.approx(pi.tolist(), abs=1e-12)
    # the design is this walk: the columns and the order come first from its generator, then its coins
    keep, design_pi = get_design("balanced")(problem, torch.Generator().manual_seed(int(rate * 10)))
    assert torch.equal(design_pi, pi)
    assert any(torch.equal(keep, k) for p, k in outcomes if p > 0)


def test_balanced_keeps_groups_and_tokens_closer_to_their_totals_than_systematic_and_stratified():
    """Eight groups of 8 with continuous rewards, 300 seeded draws each: the mean over draws of
    sum_g |reweighted advantage sum of g - its sum| / sum |A| and the spread of kept tokens (measured 0.06 vs
    0.11 and 0.20; tokens sd 2.4% vs 4.6% and 5.5% of the expected)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(8, 8, generator=g, dtype=torch.float64)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    costs = torch.randint(10, 200, (64,), generator=g).double()
    problem = PruneProblem(advantages, costs, torch.arange(64) // 8, rewards.flatten(), 0.5, keep_floor=0.1)
    pi = problem.keep_probabilities()

    def spread(design):
        imbalance, tokens = [], []
        for seed in range(300):
            keep, _ = get_design(design)(problem, torch.Generator().manual_seed(seed))
            gap = torch.zeros(8, dtype=torch.float64).index_add_(
                0, problem.groups, horvitz_thompson_weights(pi, keep) * advantages - advantages
            )
            imbalance.append(float(gap.abs().sum() / advantages.abs().sum()))
            tokens.append(float(costs[keep].sum()))
        return sum(imbalance) / len(imbalance), statistics.pstdev(tokens)

    balanced, stratified, systematic = spread("balanced"), spread("stratified"), spread("systematic")
    assert balanced[0] < 0.75 * stratified[0] < 0.75 * systematic[0]
    assert balanced[1] < 0.75 * min(stratified[1], systematic[1])


def test_balancing_variables_are_the_budget_then_the_groups_then_the_other_cost():
    problem = signed_problem()
    pi, costs = problem.keep_probabilities(), problem.costs.double()
    x = balancing_variables(pi, problem, torch.Generator().manual_seed(0))
    assert x.shape == (12, 1 + 2 + 1)  # the zero-spread group has no column
    assert torch.equal(x[:, 0], pi) and torch.equal(x[:, -1], pi * costs)
    per_group = x[:, 1:3]
    assert sorted(per_group.sum(0).tolist()) == pytest.approx(sorted([-0.6, 2.45]))  # each group's advantages
    assert ((per_group != 0).sum(1) <= 1).all() and torch.equal(per_group.sum(1), problem.advantages.double())
    tokens_first = balancing_variables(pi, dataclasses.replace(problem, budget_in_tokens=True), torch.Generator())
    assert torch.equal(tokens_first[:, 0], pi * costs) and torch.equal(tokens_first[:, -1], pi)


def test_designs_are_a_registry_with_a_clear_error(monkeypatch):
    assert {"systematic", "poisson", "stratified", "balanced", "topk", "zero_variance"} <= set(sampling_designs())
    assert set(unbiased_designs()) == {"systematic", "poisson", "stratified", "balanced"}
    with pytest.raises(ValueError, match=r"prune_sampling='cube'.*'systematic', 'poisson', 'stratified'"):
        get_design("cube")
    problem = signed_problem()
    keep, pi = get_design("zero_variance")(problem, torch.Generator())
    assert pi is None and keep.tolist() == [True] * 8 + [False] * 4
    keep, pi = get_design("topk")(problem, torch.Generator())
    assert pi is None and torch.equal(keep, topk_mask(problem.scores, 0.4))
    # a new design is one function: DPPOConfig accepts its name, the trainer would call it
    monkeypatch.setitem(
        pruning._DESIGNS, "everything", (lambda p, g: (torch.ones_like(p.scores, dtype=torch.bool), None), False)
    )
    assert validation_config(prune_sampling="everything").prune_sampling == "everything"
    assert "everything" not in unbiased_designs()


def test_exact_unbiasedness_of_horvitz_thompson_over_all_poisson_masks():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, dtype=torch.float64, generator=g)
    s = values.abs()
    s[2] = 0.0
    values[2] = 0.0  # a zero-score row contributes zero
    pi, _ = keep_probabilities(s, 0.5, 0.1, zero_score_contributes=False)
    expectation = 0.0
    for prob, _, weights in poisson_outcomes(pi):  # every mask of probability > 0
        expectation += prob * float((weights * values).sum())
    assert expectation == pytest.approx(float(values.sum()), abs=1e-12)


def test_topk_keeps_exactly_the_largest_abs_scores():
    s = torch.tensor([0.3, -2.0, 0.0, 1.5, -0.1, 0.9, 2.5, -1.0])
    keep = topk_mask(s, 0.5)
    assert keep.tolist() == [False, True, False, True, False, False, True, True]
    assert int(topk_mask(s, 0.01).sum()) == 1
    assert bool(topk_mask(s, 1.0).all())


def test_zero_variance_drops_exactly_equal_reward_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, float("nan"), 0.5])
    keep = zero_variance_mask(rewards, group_size=4)
    assert keep.tolist() == [True] * 4 + [False] * 4 + [False] * 4
    keep = zero_variance_mask(torch.tensor([0.0, 1.0, 2.0, 2.0]), group_size=2)
    assert keep.tolist() == [True, True, False, False]


def test_weights_and_ess():
    pi = torch.tensor([0.5, 0.25, 1.0, 0.0])
    keep = torch.tensor([True, False, True, False])
    w = horvitz_thompson_weights(pi, keep)
    assert w.tolist() == [2.0, 0.0, 1.0, 0.0]
    assert effective_sample_size(torch.tensor([1.0, 1.0, 1.0])) == pytest.approx(3.0)
    assert effective_sample_size(torch.tensor([2.0, 1.0])) == pytest.approx(9 / 5)
    assert effective_sample_size(torch.tensor([])) == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_normalizers_agree_when_nothing_is_pruned(loss_type):
    # With full micro-batches (and, for bnpo, a micro-batch holding its share of tokens) TRL's normalizer is
    # the full-batch one.
    args = dict(
        max_completion_length=16,
        loss_tokens_in_generation_batch=800.0,
        num_processes=2,
        steps_per_generation=4,
        accumulation_steps=2,
    )
    full = full_batch_normalizer(loss_type, 8, **args)
    trl = trl_microbatch_normalizer(loss_type, 8, 100.0, **args)
    assert trl == pytest.approx(full)
    pruned = trl_microbatch_normalizer(loss_type, 3, 30.0, **args)
    assert (pruned == pytest.approx(full)) == (loss_type in ("dapo", "cispo", "vespo"))


def test_unknown_loss_type_is_rejected():
    with pytest.raises(ValueError, match="loss_type"):
        full_batch_normalizer("nope", 1, 1, 1.0, 1, 1, 1)


@pytest.mark.parametrize("rate,floor", [(0.5, 0.05), (0.3, 0.1), (0.8, 0.05), (0.02, 0.05)])
def test_a_token_budget_spends_its_fraction_of_the_tokens(rate, floor):
    g = torch.Generator().manual_seed(int(rate * 100))
    s = torch.rand(24, generator=g, dtype=torch.float64) * torch.randint(0, 2, (24,), generator=g)
    costs = torch.randint(5, 200, (24,), generator=g).double()
    pi, tau = keep_probabilities(s, rate, floor, zero_score_contributes=False, costs=costs)
    live = s > 0
    assert pi[~live].abs().sum() == 0 and float(pi.max()) <= 1.0
    if floor * float(costs[live].sum()) < rate * float(costs.sum()) < float(costs[live].sum()):
        assert float((pi * costs).sum()) == pytest.approx(rate * float(costs.sum()), rel=1e-12)
        middle = live & (pi > floor) & (pi < 1)
        assert pi[middle].tolist() == pytest.approx((s[middle] / tau).tolist(), rel=1e-12)
    # unit costs are the row budget, bit for bit
    rows, _ = keep_probabilities(s, rate, floor, zero_score_contributes=False)
    assert torch.equal(keep_probabilities(s, rate, floor, False, costs=torch.ones(24, dtype=torch.float64))[0], rows)


def test_compute_aware_scores_and_the_token_budget_reach_the_designs():
    base = signed_problem(keep_rate=0.5)
    aware = dataclasses.replace(base, budget_in_tokens=True, length_exponent=-0.5)
    costs = base.costs.double()
    torch.testing.assert_close(aware.scores, base.scores * costs**-0.5, rtol=1e-15, atol=0)
    pi = aware.keep_probabilities()
    assert float((pi * costs).sum()) == pytest.approx(0.5 * float(costs.sum()), rel=1e-12)
    keep, design_pi = get_design("stratified")(aware, torch.Generator().manual_seed(0))
    assert torch.equal(design_pi, pi) and not keep[pi == 0].any()


def test_pruning_relative_error_is_the_relative_sd_of_poisson_sampling_over_orthogonal_gradients():
    """Enumerating every Poisson mask: E ||sum_n (keep_n / pi_n - 1) s_n e_n||^2 / ||sum_n s_n e_n||^2."""
    problem = signed_problem(keep_rate=0.4)
    pi, s = problem.keep_probabilities(), problem.scores
    live = (pi > 0).nonzero().flatten()
    mse = 0.0
    for bits in itertools.product([False, True], repeat=live.numel()):
        keep = torch.zeros(12, dtype=torch.bool)
        keep[live] = torch.tensor(bits)
        prob = float(torch.where(keep, pi, 1 - pi)[live].prod())
        mse += prob * float(((horvitz_thompson_weights(pi, keep) - 1.0)[live] * s[live]).pow(2).sum())
    assert pruning_relative_error(pi, s) == pytest.approx(math.sqrt(mse / float(s[live].pow(2).sum())), rel=1e-12)
    assert pruning_relative_error(torch.zeros(12, dtype=torch.float64), s) == 0.0


def test_adaptive_keep_rate_is_the_smallest_rate_that_meets_the_target():
    g = torch.Generator().manual_seed(0)
    spread = torch.rand(64, generator=g, dtype=torch.float64) + 0.5  # signal in every row: a hard batch
    peaked = torch.where(torch.arange(64) < 4, 10.0, 0.1).double()  # signal in four rows: an easy batch

    def problem(a, rate=0.2):
        return PruneProblem(a, torch.ones(64), torch.arange(64) // 8, None, rate, keep_floor=0.05)

    def error(a, rate):
        return pruning_relative_error(problem(a, rate).keep_probabilities(), a)

    hard, easy = adaptive_keep_rate(problem(spread), 0.3), adaptive_keep_rate(problem(peaked), 0.3)
    assert easy == 0.2 and error(peaked, 0.2) <= 0.3  # already met at completion_keep_rate: prune that much
    assert 0.2 < hard < 1.0 and error(spread, hard) <= 0.3 < error(spread, hard - 2e-3)
    assert adaptive_keep_rate(problem(spread), 1e-9) == pytest.approx(1.0, abs=1e-3)


def test_a_design_name_taken_by_another_function_is_refused_and_the_same_function_again_is_not():
    with pytest.raises(ValueError, match="register_design: the name 'stratified' is taken by dppo_trl.core.pruning"):
        pruning.register_design("stratified", unbiased=True)(lambda problem, generator: (None, None))
    same = pruning.get_design("stratified")
    assert pruning.register_design("stratified", unbiased=True)(same) is same
    assert pruning.get_design("stratified") is same and "stratified" in pruning.unbiased_designs()
