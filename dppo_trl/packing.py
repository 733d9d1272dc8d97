"""Dense Prompt Packing: pure planning of token-balanced micro-batches and padding-free packed rows.

No TRL import. Lengths are token counts of whole sequences (prompt + completion, padding excluded).

- ``assign_microbatches``: every row to exactly one of ``num_microbatches`` bins, none empty when there are
  at least as many rows, balanced by tokens with LPT (longest first, into the least-loaded bin). Graham's
  bound: the fullest bin holds at most ``4/3 - 1/(3m)`` times the optimum, and never more than
  ``total / m + (1 - 1/m) * longest``.
- ``pack_rows``: one bin's sequences into as few packed rows of at most ``budget`` tokens as first-fit
  decreasing needs, balanced by LPT; a sequence longer than the budget gets a row of its own (never dropped
  or cut).
- ``packed_layout``: where each sequence's tokens sit in the packed rows, and the ``position_ids`` that
  restart at 0 for each sequence (transformers derives the block-diagonal causal mask from them).
- ``balance_ranks``: which rank trains which kept row, moving as few rows as it can from the most to the least
  loaded rank until every rank's token load is within a tolerance of the mean (or no move helps).
"""

from __future__ import annotations

import heapq


def _lpt_order(lengths: list[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def assign_microbatches(lengths: list[int], num_microbatches: int) -> list[list[int]]:
    """Indices of the rows in each of ``num_microbatches`` bins (LPT; ties: fewer rows, then lower bin).

    Deterministic, and the bins' (row count, token load) profile depends only on the multiset of lengths,
    so every rank can compute every other rank's profile from the gathered lengths alone.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r} must be >= 1")
    bins: list[list[int]] = [[] for _ in range(num_microbatches)]
    heap = [(0, 0, b) for b in range(num_microbatches)]  # (load, rows, bin): the least loaded bin on top
    for i in _lpt_order(lengths):
        load, rows, target = heapq.heappop(heap)
        bins[target].append(i)
        heapq.heappush(heap, (load + lengths[i], rows + 1, target))
    return bins


def microbatch_row_counts(lengths: list[int], num_microbatches: int) -> list[int]:
    """Rows in each bin of ``assign_microbatches(lengths, num_microbatches)``."""
    return [len(b) for b in assign_microbatches(lengths, num_microbatches)]


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions (into ``lengths``) of the sequences of each packed row: as few rows as first-fit decreasing
    needs, each holding at most ``budget`` tokens unless it is a single sequence longer than the budget, and
    the sequences then spread over those rows by LPT when that keeps within the budget, so the rows are about
    equally long (their longest sets the width of the forward call)."""
    if budget < 1:
        raise ValueError(f"budget={budget!r} must be >= 1")
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in _lpt_order(lengths):
        for r, load in enumerate(loads):
            if load + lengths[i] <= budget:
                rows[r].append(i)
                loads[r] += lengths[i]
                break
        else:
            rows.append([i])
            loads.append(lengths[i])
    balanced = assign_microbatches(lengths, len(rows)) if rows else rows
    if all(len(row) == 1 or sum(lengths[i] for i in row) <= budget for row in balanced):
        return balanced
    return rows


def packed_allocation(lengths: list[int], budget: int) -> int:
    """Tokens one forward call allocates for ``pack_rows(lengths, budget)``: rows x the longest packed row."""
    rows = pack_rows(lengths, budget)
    return len(rows) * max((sum(lengths[i] for i in row) for row in rows), default=0)


def packed_layout(lengths: list[int], row: list[int]) -> tuple[list[int], list[int]]:
    """For one packed row: the start offset of each of its sequences and the row's ``position_ids``."""
    starts, position_ids, offset = [], [], 0
    for i in row:
        starts.append(offset)
        position_ids.extend(range(lengths[i]))
        offset += lengths[i]
    return starts, position_ids


def default_packed_tokens(rows_per_microbatch: int, longest_sequence: int, varlen_attention: bool) -> int:
    """The default budget of one packed row. With a variable-length attention kernel (flash attention), whose
    cost is per sequence, one padded micro-batch's worth (``rows x longest``): fewest forward calls, no more
    memory than TRL's padded micro-batch. Otherwise (sdpa, eager: a dense block-diagonal mask, cost quadratic
    in the packed row) the longest sequence: a packed row never costs more than one padded row."""
    return max(1, rows_per_microbatch * longest_sequence if varlen_attention else longest_sequence)


def rank_imbalance(loads: list[float]) -> float:
    """Largest load over the mean load (1.0 when balanced or empty)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def balance_ranks(lengths_per_rank: list[list[int]], tolerance: float = 0.1) -> list[list[tuple[int, int]]]:
    """For each rank, the rows ``(source rank, index into its lengths)`` it trains.

    Every rank starts with its own rows. While the most loaded rank holds more than ``(1 + tolerance)`` times
    the mean load, one of its rows moves to the least loaded rank: the row whose length is closest to half
    their gap, among those shorter than the gap (so the larger of the two loads strictly falls). It stops
    when within tolerance or when no row can move; the sum of squared loads falls with every move, so it
    ends. Deterministic (ties: lower rank, then lower index): every rank computes the same assignment from
    the gathered lengths, without communication. Rows keep their order on their rank; received rows follow.
    """
    held = [[(r, i) for i in range(len(lengths))] for r, lengths in enumerate(lengths_per_rank)]
    loads = [sum(lengths) for lengths in lengths_per_rank]
    if len(loads) < 2:
        return held
    mean = sum(loads) / len(loads)
    length = lambda row: lengths_per_rank[row[0]][row[1]]  # noqa: E731
    while True:
        heavy = max(range(len(loads)), key=lambda r: (loads[r], -r))
        light = min(range(len(loads)), key=lambda r: (loads[r], r))
        if loads[heavy] <= (1.0 + tolerance) * mean:
            return held
        gap = loads[heavy] - loads[light]
        movable = [k for k, row in enumerate(held[heavy]) if 0 < length(row) < gap]
        if not movable:
            return held
        k = min(movable, key=lambda k: (abs(2 * length(held[heavy][k]) - gap), held[heavy][k]))
        row = held[heavy].pop(k)
        held[light].append(row)
        loads[heavy] -= length(row)
        loads[light] += length(row)
