"""The cube method (Deville and Tille, 2004): a balanced sample whose inclusion probabilities are exactly ``pi``.

Pure math on float64, no TRL import. Balancing variables are the columns of ``x`` (N x p, dense or a torch sparse
tensor): a sample ``S`` is balanced on column ``j`` when its Horvitz-Thompson estimate equals the total,
``sum_{n in S} x[n, j] / pi[n] == sum_n x[n, j]``.

The sample is the end of a random walk ``pi(0) = pi, pi(1), ...`` in ``[0, 1]^N``. Each step moves along a
vector ``u`` with ``sum_n x[n, j] u[n] / pi[n] == 0`` for every kept column (so every balancing equation stays
exact), either by ``+l1 u`` or by ``-l2 u`` with probabilities ``l2 / (l1 + l2)`` and ``l1 / (l1 + l2)``: the
step's expectation is the current point (a martingale), so ``E[final] = pi`` and row ``n`` is kept with
probability exactly ``pi[n]``. ``l1`` and ``l2`` are the largest moves that stay in the cube, so each step
decides (sends to 0 or 1) at least one row. The flight phase runs while such a ``u`` exists for all ``p``
columns; the landing phase then drops the LAST column and flies on, so the columns are in priority order and
the first ones are met the most closely.

Cost (Chauvet and Tille, 2006, "A fast algorithm for balanced sampling"): each step solves on a small window,
the shortest leading run of the undecided rows (in walk order) that outnumbers the columns it touches, so it
must have a kernel vector; only its rows and those columns are read. A row that is the only undecided one of
some kept column is pinned (every kernel vector is 0 there) and leaves the window until that column is dropped.
With sparse columns (one per group, rows walked by group) the window stays a few rows whatever N, and a draw
costs O(N) steps of O(1) work. ``u`` is a fixed function of the current point (the one kernel vector of the
shortest dependent run, its last entry positive), and the walk's randomness is only the coin of each step, so
the outcomes form a finite tree that ``cube_outcomes`` enumerates with their probabilities (the tests' oracle).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

DECIDED_TOLERANCE = 1e-12  # a coordinate this close to 0 or 1 is decided (float64 rounding of a step)
RANK_TOLERANCE = 1e-10  # a singular value below this fraction of the largest is zero


def _rank(a: np.ndarray) -> tuple[int, np.ndarray]:
    _, singular, vh = np.linalg.svd(a, full_matrices=True)
    return int((singular > RANK_TOLERANCE * singular.max()).sum()) if singular.size else 0, vh


def _kernel_vector(constraints: np.ndarray) -> np.ndarray | None:
    """The unit vector ``u`` with ``constraints @ u == 0`` (``constraints``: k x m, column ``i`` the ``i``-th
    window row) supported on the shortest dependent leading run of columns (there it is unique up to sign), its
    last nonzero entry positive; None when the columns are linearly independent."""
    norms = np.sqrt((constraints * constraints).sum(axis=1))
    constraints = constraints[norms > 0] / norms[norms > 0, None]
    m = constraints.shape[1]
    if constraints.shape[0] == 0:
        return np.eye(m)[0]
    rank, vh = _rank(constraints)
    if rank == m:
        return None
    u = vh[-1]
    if m - rank > 1:  # several directions: the shortest dependent leading run has exactly one
        run = next((j for j in range(1, m) if _rank(constraints[:, :j])[0] < j), m)
        u = np.pad(_rank(constraints[:, :run])[1][-1], (0, m - run))
    u = np.where(np.abs(u) > 1e-12 * np.abs(u).max(), u, 0.0)
    return u if u[np.flatnonzero(u)[-1]] > 0 else -u


@dataclasses.dataclass
class _Walk:
    """The walk's state, rows in walk order. ``z = x / pi`` as CSR lists (``starts``, ``columns``, ``values``;
    columns ascending in a row). Invariants: ``count[c]`` / ``row_sum[c]`` are the number / the sum of the
    undecided rows with ``z[n, c] != 0``; ``pins[n]`` is the number of kept columns (``c < k``) whose only
    undecided row is ``n``; ``front`` holds, ascending, the undecided rows before ``next_row`` with no pin."""

    point: list[float]
    starts: list[int]
    columns: list[int]
    values: list[float]
    k: int
    count: list[int]
    row_sum: list[int]
    pins: list[int]
    front: list[int]
    next_row: int = 0
    undecided: int = 0

    def copy(self) -> _Walk:
        lists = ("point", "count", "row_sum", "pins", "front")
        return dataclasses.replace(self, **{name: list(getattr(self, name)) for name in lists})

    def row(self, n: int) -> tuple[list[int], list[float]]:
        return self.columns[self.starts[n] : self.starts[n + 1]], self.values[self.starts[n] : self.starts[n + 1]]

    def pin(self, c: int, delta: int) -> None:
        """Column ``c`` (kept, one undecided row left) pins (``+1``) or, dropped, unpins (``-1``) its row."""
        n = self.row_sum[c]
        self.pins[n] += delta
        if delta > 0 and self.pins[n] == 1 and n < self.next_row:
            self.front.remove(n)
        elif delta < 0 and self.pins[n] == 0 and n < self.next_row:
            bisect.insort(self.front, n)


def _decided(value: float) -> bool:
    return value <= DECIDED_TOLERANCE or value >= 1.0 - DECIDED_TOLERANCE


def _sparse_z(pi: np.ndarray, x: torch.Tensor, position: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The nonzero entries ``(walk position, column, x / pi)`` of rows with ``pi > 0``, by position then column."""
    x = x.detach()
    if x.layout == torch.strided:
        rows_, cols_ = torch.nonzero(x, as_tuple=True)
        rows, cols, vals = rows_.numpy(), cols_.numpy(), x.to(torch.float64)[rows_, cols_].numpy()
    else:
        coo = x.to_sparse_coo().coalesce()
        (rows, cols), vals = coo.indices().numpy(), coo.values().to(torch.float64).numpy()
    live = (vals != 0) & (pi[rows] > 0)
    rows, cols, vals = position[rows[live]], cols[live], vals[live] / pi[rows[live]]
    by_row = np.lexsort((cols, rows))
    return rows[by_row], cols[by_row], vals[by_row]


def _start(pi: torch.Tensor, x: torch.Tensor, order: torch.Tensor) -> _Walk:
    pi_ = pi.detach().to(torch.float64).numpy()
    n, p = pi_.size, int(x.shape[1])
    position = np.empty(n, dtype=np.int64)
    position[order.numpy()] = np.arange(n)
    rows, cols, vals = _sparse_z(pi_, x, position)
    point = pi_[order.numpy()].copy()
    open_ = (point > DECIDED_TOLERANCE) & (point < 1.0 - DECIDED_TOLERANCE)
    point[~open_] = np.where(point[~open_] > 0.5, 1.0, 0.0)
    counted = open_[rows]
    count = np.bincount(cols[counted], minlength=p)
    row_sum = np.bincount(cols[counted], weights=rows[counted], minlength=p).round().astype(np.int64)
    starts = np.searchsorted(rows, np.arange(n + 1))
    walk = _Walk(point.tolist(), starts.tolist(), cols.tolist(), vals.tolist(), p, count.tolist(),
                 row_sum.tolist(), [0] * n, [], undecided=int(open_.sum()))
    for c in np.flatnonzero(count == 1).tolist():
        walk.pin(c, +1)
    return walk


def _window(walk: _Walk) -> list[int]:
    """The shortest leading run of the front (pulling the next open rows in as needed) that outnumbers the kept
    columns it touches (so it has a kernel vector); the whole front when none does."""
    touched: set[int] = set()
    i = 0
    while True:
        if i == len(walk.front):
            while walk.next_row < len(walk.point) and (
                _decided(walk.point[walk.next_row]) or walk.pins[walk.next_row]
            ):
                walk.next_row += 1
            if walk.next_row == len(walk.point):
                return list(walk.front)
            walk.front.append(walk.next_row)
            walk.next_row += 1
        touched.update(c for c in walk.row(walk.front[i])[0] if c < walk.k)
        i += 1
        if i > len(touched):
            return walk.front[:i]


def _kernel_on(walk: _Walk, window: list[int]) -> np.ndarray | None:
    """``_kernel_vector`` of the kept columns on the window's rows (only the columns those rows touch)."""
    entries = [(c, j, v) for j, n in enumerate(window) for c, v in zip(*walk.row(n)) if c < walk.k]
    index = {c: i for i, c in enumerate(sorted({c for c, _, _ in entries}))}
    constraints = np.zeros((len(index), len(window)))
    if entries:
        columns, rows, values = zip(*entries)
        constraints[[index[c] for c in columns], list(rows)] = values
    return _kernel_vector(constraints)


def cube_step(walk: _Walk) -> tuple[list[int], list[float], list[float], float] | None:
    """The next step from the walk's point: ``(rows, up, down, q)``, the rows move to ``up`` with probability
    ``q`` and to ``down`` otherwise, ``q * up + (1 - q) * down`` their current values, every kept column's
    balancing sum unchanged. Drops the last kept column (``walk.k -= 1``) while no kernel vector exists over the
    undecided rows (it then fails at every later point too: fewer undecided rows). None when all are decided."""
    while walk.undecided:
        window = _window(walk)
        u = _kernel_on(walk, window) if window else None
        if u is not None:
            break
        walk.k -= 1
        if walk.count[walk.k] == 1:
            walk.pin(walk.k, -1)
    else:
        return None
    moved = np.flatnonzero(u)
    rows, u = [window[j] for j in moved], u[moved].tolist()
    here = [walk.point[n] for n in rows]
    # l1: the largest move along +u inside the cube; l2: along -u.
    l1 = min((1.0 - h) / v if v > 0 else h / -v for h, v in zip(here, u))
    l2 = min(h / v if v > 0 else (1.0 - h) / -v for h, v in zip(here, u))
    up, down = [h + l1 * v for h, v in zip(here, u)], [h - l2 * v for h, v in zip(here, u)]
    return rows, up, down, l2 / (l1 + l2)


def _move(walk: _Walk, rows: list[int], values: list[float]) -> None:
    """Set the rows' values; the decided ones leave the front and the counts, and a kept column left with one
    undecided row pins it."""
    emptied: set[int] = set()
    for n, value in zip(rows, values):
        if not _decided(value):
            walk.point[n] = value
            continue
        walk.point[n], walk.undecided = (1.0 if value > 0.5 else 0.0), walk.undecided - 1
        walk.front.remove(n)
        for c in walk.row(n)[0]:
            walk.count[c] -= 1
            walk.row_sum[c] -= n
            emptied.add(c)
    for c in sorted(emptied):
        if walk.count[c] == 1 and c < walk.k:
            walk.pin(c, +1)


def _keep(walk: _Walk, order: torch.Tensor) -> torch.Tensor:
    keep = torch.zeros(len(walk.point), dtype=torch.bool)
    keep[order] = torch.tensor(walk.point) > 0.5
    return keep


def _coins(generator: torch.Generator | None, chunk: int) -> Iterator[float]:
    """Uniform coins from ``generator``, drawn ``chunk`` at a time (a draw has at most one step per open row)."""
    while True:
        yield from torch.rand(max(chunk, 1), generator=generator, dtype=torch.float64).tolist()


def cube_sample(pi: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None,
                order: torch.Tensor | None = None) -> torch.Tensor:
    """A balanced sample: row ``n`` kept with probability exactly ``pi[n]``, balanced on the columns of ``x`` in
    priority order. Rows are walked in ``order`` (a random permutation from ``generator`` when None)."""
    if order is None:
        order = torch.randperm(pi.numel(), generator=generator)
    walk = _start(pi, x, order)
    coins = _coins(generator, walk.undecided)
    while (step := cube_step(walk)) is not None:
        rows, up, down, q = step
        _move(walk, rows, up if next(coins) < q else down)
    return _keep(walk, order)


def cube_outcomes(pi: torch.Tensor, x: torch.Tensor, order: torch.Tensor) -> Iterator[tuple[float, torch.Tensor]]:
    """Every outcome of ``cube_sample(pi, x, order=order)`` with its probability (they sum to 1)."""
    stack = [(1.0, _start(pi, x, order))]
    while stack:
        prob, walk = stack.pop()
        step = cube_step(walk)
        if step is None:
            yield prob, _keep(walk, order)
            continue
        rows, up, down, q = step
        for branch, values in ((prob * q, up), (prob * (1.0 - q), down)):
            _move(child := walk.copy(), rows, values)
            stack.append((branch, child))
