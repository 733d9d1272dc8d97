"""Every outcome of a sampling design with its exact probability, for oracles that take expectations by
enumeration instead of by sampling. Each enumerator yields ``(probability, keep mask, Horvitz-Thompson weights)``."""

import itertools

import torch

from dppo_trl.core.cube import cube_outcomes
from dppo_trl.core.estimator import horvitz_thompson_weights
from dppo_trl.core.pruning import PruneProblem, balancing_variables, grouped_order, systematic_sample


def poisson_outcomes(pi):
    """Every mask of independent keeps with probabilities ``pi`` (``2^n``), those of probability 0 left out."""
    for bits in itertools.product([False, True], repeat=len(pi)):
        keep = torch.tensor(bits)
        prob = float(torch.where(keep, pi, 1 - pi).prod())
        if prob > 0:
            yield prob, keep, horvitz_thompson_weights(pi, keep)


def systematic_outcomes(pi, order, min_width=1e-15):
    """Every outcome of systematic sampling over the rows in ``order``: the start point u ~ U[0, 1) only matters
    through which breakpoints frac(cumsum of pi) it lies between, and each such piece is an outcome with its
    width as probability (pieces no wider than ``min_width``, float rounding of the cumsum, are left out)."""
    cuts = sorted({0.0, 1.0, *[float(c) % 1.0 for c in torch.cumsum(pi.to(torch.float64)[order], 0)]})
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi - lo > min_width:
            keep = systematic_sample(pi, order=order, start=0.5 * (lo + hi))
            yield hi - lo, keep, horvitz_thompson_weights(pi, keep)


def balanced_outcomes(pi, advantages, lengths, groups, seed=3):
    """Every leaf of the balanced design's cube walk (its balancing variables and row order drawn from ``seed``),
    leaves that keep the same rows merged into one outcome (one loss pass each)."""
    problem = PruneProblem(advantages, lengths, groups, None, keep_rate=0.5, keep_floor=0.1)
    g = torch.Generator().manual_seed(seed)
    x = balancing_variables(pi, problem, g)
    merged = {}
    for prob, keep in cube_outcomes(pi, x, grouped_order(groups, g)):
        merged[tuple(keep.tolist())] = merged.get(tuple(keep.tolist()), 0.0) + prob
    for rows, prob in merged.items():
        keep = torch.tensor(rows)
        yield prob, keep, horvitz_thompson_weights(pi, keep)
