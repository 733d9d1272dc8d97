"""Pure math of completion pruning: keep probabilities and sampling designs (the Horvitz-Thompson weights and
the loss normalizers are in ``dppo_trl.core.estimator``).

No TRL import here. Every function works on plain 1-D tensors over the rows of ONE generation batch
(all ranks together), so that every rank, given the same inputs and generator, makes the same decision.

Sampling designs are registered by name (``register_design``); ``prune_sampling`` picks one. Invariant of the
unbiased designs (``stratified``, ``systematic``, ``poisson``, ``balanced``): row ``n`` is kept with probability
exactly ``pi[n]``; a kept row carries the weight ``1 / pi[n]``; a row with ``pi[n] == 0`` is never kept and must
contribute exactly zero to the loss. Then ``E[sum_n keep_n * w_n * l_n] = sum_n l_n`` for any ``l``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cube import cube_sample
from .estimator import SEQUENCE_MEAN_LOSS_TYPES


def keep_probabilities(
    scores: torch.Tensor,
    keep_rate: float,
    keep_floor: float,
    zero_score_contributes: bool,
    contributes_nothing: torch.Tensor | None = None,
    costs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """Keep probabilities ``pi = clip(score / tau, keep_floor, 1)`` with ``sum(pi) == keep_rate * N``; with
    ``costs`` (e.g. each row's tokens) the budget is in cost instead: ``sum(pi * cost) == keep_rate * sum(cost)``.

    Rows with ``score == 0`` get ``pi = 0`` unless ``zero_score_contributes`` (then they count like any row,
    with ``pi = keep_floor``). Rows flagged in ``contributes_nothing`` (e.g. no loss token) always get
    ``pi = 0``. When the budget ``keep_rate * N`` is larger than the number of eligible rows,
    every eligible row is kept (``pi = 1``); when ``keep_floor`` alone exceeds the budget, every eligible row
    gets ``keep_floor``: the design keeps more than the budget, never fewer.

    Returns ``(pi, tau)`` in float64; ``tau`` is ``inf`` when every eligible row sits at the floor and ``0``
    when every eligible row is kept.
    """
    scores = scores.detach().to(torch.float64).abs()
    eligible = torch.ones_like(scores, dtype=torch.bool) if zero_score_contributes else scores > 0
    if contributes_nothing is not None:
        eligible &= ~contributes_nothing.to(torch.bool)
    pi = torch.zeros_like(scores)
    num_eligible = int(eligible.sum())
    if num_eligible == 0:
        return pi, 0.0
    cost = torch.ones_like(scores) if costs is None else costs.detach().to(torch.float64)
    budget = keep_rate * float(cost.sum())
    s, c = scores[eligible], cost[eligible]
    if budget >= float(c.sum()):
        pi[eligible] = 1.0
        return pi, 0.0
    if keep_floor * float(c.sum()) >= budget:
        pi[eligible] = keep_floor
        return pi, math.inf
    positive = s > 0
    cost_positive, cost_zero = float(c[positive].sum()), float(c[~positive].sum())
    if cost_positive + keep_floor * cost_zero <= budget:
        # Even tau -> 0 leaves the budget unmet: keep every positive row, raise the eligible zero-score rows.
        pi_eligible = torch.ones_like(s)
        pi_eligible[~positive] = min(1.0, (budget - cost_positive) / cost_zero)
        pi[eligible] = pi_eligible
        return pi, 0.0

    def total(tau: float) -> float:
        return float((c * torch.clamp(s / tau, min=keep_floor, max=1.0)).sum())

    # total(tau) is continuous and non-increasing: total(lo) >= budget >= total(hi).
    lo, hi = float(s[s > 0].min()) * 1e-3, float(s.max()) / keep_floor
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if total(mid) > budget:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    # Solve exactly on the piece where the clipped sets are those of `hi`: the sum then hits the budget.
    raw = s / hi
    at_one, at_floor = raw >= 1.0, raw <= keep_floor
    middle = ~(at_one | at_floor)
    rest = budget - float(c[at_one].sum()) - keep_floor * float(c[at_floor].sum())
    if middle.any() and rest > 0:
        tau = float((c * s)[middle].sum()) / rest
        # Only accept the exact solution when it leaves the clipped sets unchanged.
        exact = s / tau
        if bool(((exact >= 1.0) == at_one).all() and ((exact <= keep_floor) == at_floor).all()):
            hi = tau
    pi[eligible] = torch.clamp(s / hi, min=keep_floor, max=1.0)
    return pi, hi


def systematic_sample(
    pi: torch.Tensor, generator: torch.Generator | None = None, order: torch.Tensor | None = None, start=None
) -> torch.Tensor:
    """Systematic PPS sampling: keeps row ``n`` with probability exactly ``pi[n]`` and ``floor`` or ``ceil``
    of ``sum(pi)`` rows in all.

    Rows are laid out in ``order`` (a random permutation from ``generator`` when None) as consecutive
    intervals of length ``pi``; the points ``start + k`` (``start ~ U[0, 1)``) pick the rows whose interval
    holds one. An interval of length ``pi <= 1`` holds a point with probability exactly ``pi``.
    """
    n = pi.numel()
    if order is None:
        order = torch.randperm(n, generator=generator)
    if start is None:
        start = float(torch.rand((), generator=generator, dtype=torch.float64))
    p = pi.detach().to(torch.float64)[order]
    upper = torch.cumsum(p, 0)
    lower = upper - p
    # Row holds a point start + k iff ceil(lower - start) < ceil(upper - start), i.e. a new integer is crossed.
    hit = torch.ceil(upper - start) > torch.ceil(lower - start)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order] = hit & (p > 0)
    return keep


def poisson_sample(pi: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Poisson sampling: row ``n`` kept independently with probability ``pi[n]``."""
    u = torch.rand(pi.numel(), generator=generator, dtype=torch.float64)
    return u < pi.detach().to(torch.float64)


def topk_mask(scores: torch.Tensor, keep_rate: float) -> torch.Tensor:
    """CPPO's biased rule: keep the ``ceil(keep_rate * N)`` rows of largest ``|score|`` (ties: lower index)."""
    n = scores.numel()
    k = min(n, math.ceil(keep_rate * n - 1e-9))
    order = sorted(range(n), key=lambda i: (-abs(float(scores[i])), i))
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order[:k]] = True
    return keep


def zero_variance_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO-style filter: drop every row of a group whose (non-NaN) rewards are all equal."""
    groups = rewards.detach().to(torch.float64).view(-1, group_size)
    finite = ~torch.isnan(groups)
    high = torch.where(finite, groups, torch.full_like(groups, -math.inf)).amax(dim=1)
    low = torch.where(finite, groups, torch.full_like(groups, math.inf)).amin(dim=1)
    varied = finite.sum(dim=1) > 0
    varied &= high > low
    return varied.repeat_interleave(group_size)


def zero_spread_rows(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rows of the groups whose (non-NaN) rewards are all equal: their advantage is exactly 0 in exact
    arithmetic (TRL's float32 value can be 1e-4), so they score exactly 0."""
    return ~zero_variance_mask(rewards, group_size)


def default_length_exponent(loss_type: str) -> float:
    """``score_length_exponent``'s default: -0.5 for the per-sequence means (a row's gradient is a token mean,
    ``||g|| ~ |A| / sqrt(L)``), 0 for the token sums (``||g|| ~ |A| sqrt(L)``); the best of each measured by
    ``make bench-variance`` (``docs/benchmarks.md``)."""
    return -0.5 if loss_type in SEQUENCE_MEAN_LOSS_TYPES else 0.0


@dataclass(frozen=True)
class PruneProblem:
    """What a sampling design sees of one generation batch (every rank's rows, in order): the signed advantages
    (exactly 0 on zero-spread groups), each row's tokens, its group, the aggregated rewards, and the budget."""

    advantages: torch.Tensor
    costs: torch.Tensor
    groups: torch.Tensor
    rewards: torch.Tensor | None  # None where no rewards were computed (a batch scored outside training)
    keep_rate: float
    keep_floor: float
    zero_score_contributes: bool = False
    contributes_nothing: torch.Tensor | None = None
    budget_in_tokens: bool = False  # keep_rate is a fraction of the batch's tokens (costs), not of its rows
    length_exponent: float = 0.0  # scores |A| * cost ** length_exponent

    @property
    def scores(self) -> torch.Tensor:
        scores = self.advantages.detach().to(torch.float64).abs()
        if self.length_exponent != 0.0:
            scores = scores * self.costs.to(torch.float64).clamp(min=1.0) ** self.length_exponent
        return scores

    def keep_probabilities(self) -> torch.Tensor:
        """``keep_probabilities`` of the scores at this budget (float64), solved once per problem (the problem is
        frozen; callers must not modify the returned tensor)."""
        if "_pi" in self.__dict__:
            return self.__dict__["_pi"]
        pi, _ = keep_probabilities(self.scores, self.keep_rate, self.keep_floor, self.zero_score_contributes,
                                   self.contributes_nothing, self.costs if self.budget_in_tokens else None)
        object.__setattr__(self, "_pi", pi)
        return pi


def pruning_relative_error(pi: torch.Tensor, scores: torch.Tensor) -> float:
    """The pruning noise of the Horvitz-Thompson estimate relative to the full batch's gradient, if the rows'
    gradients were orthogonal with norms proportional to ``scores``: ``sqrt(sum (1/pi - 1) s^2 / sum s^2)`` over
    the rows that can be kept (``pi > 0``); the exact relative standard deviation under Poisson sampling, 0 when
    nothing scores."""
    live = pi > 0
    s2 = scores.detach().to(torch.float64)[live] ** 2
    total = float(s2.sum())
    return math.sqrt(float(((1.0 / pi[live].to(torch.float64) - 1.0) * s2).sum()) / total) if total > 0 else 0.0


def adaptive_keep_rate(problem: PruneProblem, target: float, tolerance: float = 1e-3) -> float:
    """The smallest keep rate from ``problem.keep_rate`` up to 1 whose keep probabilities have
    ``pruning_relative_error <= target`` (the error falls as the rate rises: every ``pi`` rises), to ``tolerance``
    (the returned rate meets the target; at rate 1 every eligible row is kept and the error is 0)."""

    def error(rate: float) -> float:
        return pruning_relative_error(dataclasses.replace(problem, keep_rate=rate).keep_probabilities(), problem.scores)

    low, high = problem.keep_rate, 1.0
    if error(low) <= target:
        return low
    while high - low > tolerance:
        middle = 0.5 * (low + high)
        low, high = (low, middle) if error(middle) <= target else (middle, high)
    return high


Design = Callable[[PruneProblem, torch.Generator], tuple[torch.Tensor, "torch.Tensor | None"]]
_DESIGNS: dict[str, tuple[Design, bool]] = {}


def refuse_taken_name(registry: str, name: str, taken: Callable | None, fn: Callable, registered) -> None:
    """Every registry's one check: ``name`` held by another function than ``fn`` is refused; the same function
    again (the same module and name: a reloaded module) is not."""
    if taken is not None and (taken.__module__, taken.__qualname__) != (fn.__module__, fn.__qualname__):
        raise ValueError(
            f"{registry}: the name {name!r} is taken by {taken.__module__}.{taken.__qualname__}; "
            f"choose another name (registered: {list(registered)})."
        )


def register_design(name: str, unbiased: bool):
    """Register ``fn(problem, generator) -> (keep, pi)`` as the sampling design ``name``. An unbiased design keeps
    row ``n`` with probability exactly ``pi[n]`` (its rows then carry ``1 / pi``); a biased one returns
    ``pi=None`` and its kept rows carry weight 1. A taken name is refused, unless it is the same function again
    (the same module and name: a reloaded module)."""

    def decorate(fn: Design) -> Design:
        refuse_taken_name("register_design", name, _DESIGNS.get(name, (None,))[0], fn, _DESIGNS)
        _DESIGNS[name] = (fn, unbiased)
        return fn

    return decorate


def sampling_designs() -> tuple[str, ...]:
    return tuple(_DESIGNS)


def unbiased_designs() -> tuple[str, ...]:
    return tuple(name for name, (_, unbiased) in _DESIGNS.items() if unbiased)


def get_design(name: str) -> Design:
    if not isinstance(name, str) or name not in _DESIGNS:
        raise ValueError(f"prune_sampling={name!r} is invalid: it must be one of {list(_DESIGNS)}.")
    return _DESIGNS[name][0]


@register_design("systematic", unbiased=True)
def _systematic(problem: PruneProblem, generator: torch.Generator):
    pi = problem.keep_probabilities()
    return systematic_sample(pi, generator), pi


@register_design("poisson", unbiased=True)
def _poisson(problem: PruneProblem, generator: torch.Generator):
    pi = problem.keep_probabilities()
    return poisson_sample(pi, generator), pi


def random_group_ranks(groups: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``rank[g]``: the position of group ``g`` in a random order of the groups present."""
    group_ids = torch.unique(groups)
    rank = torch.empty(int(group_ids.max()) + 1, dtype=torch.long)
    rank[group_ids] = torch.randperm(group_ids.numel(), generator=generator)
    return rank


def stratified_order(advantages: torch.Tensor, costs: torch.Tensor, groups: torch.Tensor,
                     generator: torch.Generator) -> torch.Tensor:
    """Rows sorted by group (the groups in a random order), then by the sign of the advantage (positive first),
    then by length (longest first): consecutive intervals of ``stratified``'s systematic pass."""
    rank = random_group_ranks(groups, generator)
    sign = torch.sign(advantages.detach()).tolist()
    keys = [(int(rank[g]), -sign[n], -float(c), n) for n, (g, c) in enumerate(zip(groups.tolist(), costs.tolist()))]
    return torch.tensor([key[-1] for key in sorted(keys)], dtype=torch.long)


@register_design("stratified", unbiased=True)
def _stratified(problem: PruneProblem, generator: torch.Generator):
    """Systematic sampling over ``stratified_order``: row ``n`` is kept with probability exactly ``pi[n]`` (a
    random start over any fixed order), and each group, and each sign within it, keeps the sum of its ``pi``
    rounded down or up (its rows are consecutive intervals)."""
    pi = problem.keep_probabilities()
    order = stratified_order(problem.advantages.to(torch.float64), problem.costs, problem.groups, generator)
    return systematic_sample(pi, generator, order=order), pi


def balancing_variables(pi: torch.Tensor, problem: PruneProblem, generator: torch.Generator,
                        sparse: bool = False) -> torch.Tensor:
    """``balanced``'s balancing variables (N x p, columns in priority order): the budget (``pi``: the kept count;
    ``pi * cost`` under a token budget: the kept tokens), each group's advantages (the groups with a nonzero
    one, in a random order: its reweighted advantages sum to the group's), then the other of rows and tokens.
    ``sparse``: the same matrix as a torch sparse COO tensor (3 entries a row, not p: p grows with the groups)."""
    costs = problem.costs.detach().to(torch.float64)
    rows = pi.detach().to(torch.float64)
    tokens = rows * costs
    advantages = problem.advantages.detach().to(torch.float64)
    group_ids = torch.unique(problem.groups[advantages != 0])
    group_ids = group_ids[torch.randperm(group_ids.numel(), generator=generator)]
    column = torch.zeros(int(problem.groups.max()) + 1 if problem.groups.numel() else 0, dtype=torch.long)
    column[group_ids] = torch.arange(1, group_ids.numel() + 1)  # a group's column: 1 + its place in the order
    n, p = pi.numel(), group_ids.numel() + 2
    in_group = torch.nonzero(advantages != 0).flatten()  # the rows with an entry in their group's column
    first, last = (tokens, rows) if problem.budget_in_tokens else (rows, tokens)
    index = torch.cat([torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)]),
                       torch.stack([in_group, column[problem.groups[in_group]]]),
                       torch.stack([torch.arange(n), torch.full((n,), p - 1)])], dim=1)
    values = torch.cat([first, advantages[in_group], last])
    x = torch.sparse_coo_tensor(index, values, (n, p), check_invariants=True).coalesce()
    return x if sparse else x.to_dense()


def grouped_order(groups: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Rows sorted by group, the groups and the rows within each in a random order: ``balanced`` walks them so,
    and each step of its walk then touches few groups' balancing variables (a small system to solve)."""
    rank = random_group_ranks(groups, generator)
    shuffled = torch.randperm(groups.numel(), generator=generator)
    return shuffled[torch.argsort(rank[groups[shuffled]], stable=True)]


@register_design("balanced", unbiased=True)
def _balanced(problem: PruneProblem, generator: torch.Generator):
    """The cube method (``cube.cube_sample``) on ``balancing_variables``: row ``n`` is kept with probability
    exactly ``pi[n]``, and the budget, each group's advantage sum and the other cost are met as closely as
    the landing allows (the first columns the most closely)."""
    pi = problem.keep_probabilities()
    x = balancing_variables(pi, problem, generator, sparse=True)
    return cube_sample(pi, x, generator, order=grouped_order(problem.groups, generator)), pi


@register_design("topk", unbiased=False)
def _topk(problem: PruneProblem, generator: torch.Generator):
    return topk_mask(problem.scores, problem.keep_rate), None


@register_design("zero_variance", unbiased=False)
def _zero_variance(problem: PruneProblem, generator: torch.Generator):
    if problem.rewards is None:
        raise ValueError("prune_sampling='zero_variance' needs the generation batch's rewards")
    group_size = problem.rewards.numel() // max(int(torch.unique(problem.groups).numel()), 1)
    return zero_variance_mask(problem.rewards, group_size), None
