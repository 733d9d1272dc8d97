"""The cube method (Deville and Tille, 2004): a balanced sample whose inclusion probabilities are exactly ``pi``.

Pure math on float64 tensors, no TRL import. Balancing variables are the columns of ``x`` (N x p): a sample ``S``
is balanced on column ``j`` when its Horvitz-Thompson estimate equals the total,
``sum_{n in S} x[n, j] / pi[n] == sum_n x[n, j]``.

The sample is the end of a random walk ``pi(0) = pi, pi(1), ...`` in ``[0, 1]^N``. Each step moves along a
vector ``u`` with ``sum_n x[n, j] u[n] / pi[n] == 0`` for every kept column (so every balancing equation stays
exact), either by ``+l1 u`` or by ``-l2 u`` with probabilities ``l2 / (l1 + l2)`` and ``l1 / (l1 + l2)``: the
step's expectation is the current point (a martingale), so ``E[final] = pi`` and row ``n`` is kept with
probability exactly ``pi[n]``. ``l1`` and ``l2`` are the largest moves that stay in the cube, so each step
decides (sends to 0 or 1) at least one row. The flight phase runs while such a ``u`` exists for all ``p``
columns (at least ``p + 1`` undecided rows); the landing phase then drops the LAST column and flies on, so the
columns are in priority order and the first ones are met the most closely. The walk's randomness is only the
coin of each step, and ``u`` is a fixed function of the current point, so the outcomes form a finite tree that
``cube_outcomes`` enumerates with their probabilities (the exact oracle of the tests).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

DECIDED_TOLERANCE = 1e-12  # a coordinate this close to 0 or 1 is decided (float64 rounding of a step)


def _kernel_vector(constraints: np.ndarray) -> np.ndarray | None:
    """A unit vector ``u`` with ``constraints @ u == 0`` (``constraints``: k x m), or None when the columns are
    linearly independent (no direction keeps every equation)."""
    norms = np.linalg.norm(constraints, axis=1)
    constraints = constraints[norms > 0] / norms[norms > 0, None]
    m = constraints.shape[1]
    if constraints.shape[0] == 0:
        return np.full(m, m**-0.5)
    _, singular, vh = np.linalg.svd(constraints, full_matrices=True)
    rank = int((singular > 1e-10 * singular.max()).sum())
    return vh[-1] if rank < m else None


def _shortest_dependent_prefix(rows: np.ndarray) -> int:
    """The fewest leading rows (of ``rows``: undecided rows x columns) that outnumber the columns they touch, so
    that they are linearly dependent (every row when none do). Rows sorted by group touch few group columns, so
    each step solves a small system."""
    if rows.shape[1] == 0:
        return 1
    touched = np.logical_or.accumulate(rows != 0, axis=0).sum(axis=1)
    enough = np.flatnonzero(np.arange(1, len(rows) + 1) > touched)
    return int(enough[0]) + 1 if enough.size else len(rows)


def scaled_balancing_variables(pi: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """``z = x / pi`` row-wise (0 where ``pi == 0``: such a row is decided from the start), float64."""
    pi_, x_ = pi.detach().to(torch.float64).numpy(), x.detach().to(torch.float64).numpy()
    return np.where(pi_[:, None] > 0, x_ / np.where(pi_ > 0, pi_, 1.0)[:, None], 0.0)


def cube_step(p: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, int] | None:
    """One step from the point ``p``: ``(up, down, q, k)``, the walk moves to ``up`` with probability ``q`` and
    to ``down`` otherwise, ``q * up + (1 - q) * down == p``, and ``z^T up == z^T down == z^T p`` on the first
    ``k`` columns of ``z`` (``scaled_balancing_variables``). ``k`` is the most columns with a kernel vector over
    the undecided rows (found on the shortest leading run of them that must have one): every column in the
    flight, fewer in the landing. Once ``k`` columns fail they fail at every later point (fewer undecided rows),
    so the caller passes ``z[:, :k]`` on. None when every row is decided."""
    undecided = np.flatnonzero((p > DECIDED_TOLERANCE) & (p < 1.0 - DECIDED_TOLERANCE))
    if undecided.size == 0:
        return None
    for k in range(z.shape[1], -1, -1):
        moved = undecided[: _shortest_dependent_prefix(z[undecided, :k])]
        u = _kernel_vector(z[moved, :k].T)
        if u is not None:
            break
    u = np.where(np.abs(u) > 1e-12 * np.abs(u).max(), u, 0.0)
    here = p[moved]
    with np.errstate(divide="ignore"):
        # l1: the largest move along +u inside the cube; l2: along -u.
        l1 = np.where(u > 0, (1.0 - here) / u, np.where(u < 0, here / -u, np.inf)).min()
        l2 = np.where(u > 0, here / u, np.where(u < 0, (1.0 - here) / -u, np.inf)).min()
    up, down = p.copy(), p.copy()
    up[moved], down[moved] = here + l1 * u, here - l2 * u
    for point in (up, down):
        point[point <= DECIDED_TOLERANCE] = 0.0
        point[point >= 1.0 - DECIDED_TOLERANCE] = 1.0
    return up, down, float(l2 / (l1 + l2)), k


def _start(pi: torch.Tensor, x: torch.Tensor, order: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    point = pi.detach().to(torch.float64)[order].numpy().copy()
    return point, scaled_balancing_variables(pi[order], x[order])


def _keep(point: np.ndarray, order: torch.Tensor) -> torch.Tensor:
    keep = torch.zeros(point.size, dtype=torch.bool)
    keep[order] = torch.from_numpy(point > 0.5)
    return keep


def cube_sample(pi: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None,
                order: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """A balanced sample: row ``n`` kept with probability exactly ``pi[n]``, balanced on the columns of ``x`` in
    priority order. Rows are walked in ``order`` (a random permutation from ``generator`` when None)."""
    if order is None:
        order = torch.randperm(pi.numel(), generator=generator)
    point, z = _start(pi, x, order)
    while (step := cube_step(point, z)) is not None:
        up, down, q, k = step
        point, z = (up if float(torch.rand((), generator=generator, dtype=torch.float64)) < q else down), z[:, :k]
    return _keep(point, order)


def cube_outcomes(pi: torch.Tensor, x: torch.Tensor, order: torch.Tensor) -> Iterator[tuple[float, torch.Tensor]]:
    """Every outcome of ``cube_sample(pi, x, order=order)`` with its probability (they sum to 1)."""
    stack = [(1.0, *_start(pi, x, order))]
    while stack:
        prob, point, z = stack.pop()
        step = cube_step(point, z)
        if step is None:
            yield prob, _keep(point, order)
            continue
        up, down, q, k = step
        stack += [(prob * q, up, z[:, :k]), (prob * (1.0 - q), down, z[:, :k])]
