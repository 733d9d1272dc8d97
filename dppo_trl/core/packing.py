"""Dense Prompt Packing: pure planning of token-balanced micro-batches and padding-free packed rows.

No TRL import. Lengths are token counts of whole sequences (prompt + completion, padding excluded).

- ``assign_microbatches``: every row to exactly one of ``num_microbatches`` bins, none empty when there are
  at least as many rows, balanced by tokens with LPT (longest first, into the least-loaded bin). Graham's
  bound: the fullest bin holds at most ``4/3 - 1/(3m)`` times the optimum, and never more than
  ``total / m + (1 - 1/m) * longest``.
- ``pack_rows``: one bin's sequences into as few packed rows of at most ``budget`` tokens as first-fit
  decreasing needs, balanced by LPT; a sequence longer than the budget gets a row of its own (never dropped
  or cut).
- ``balance_ranks``: which rank trains which kept row, moving as few rows as it can from the most to the least
  loaded rank until every rank's token load is within a tolerance of the mean (or no move helps).
- ``pack_call`` / ``plan_forward_calls``: the packed rows of one forward call, and the calls of a pass, each
  allocating no more tokens than TRL's largest call (``rows_per_call x padded width``).
- ``packed_inputs``: the tensors of one packed call (ids, restarting ``position_ids``, pre-shifted labels, and
  where each completion token lands), and ``varlen_kwargs``: the ``cu_seq_lens`` a variable-length attention
  kernel needs to see the sequence boundaries.
- ``exchange_plan``: which slots of a fixed-size all-gather carry the rows that change rank.
"""

from __future__ import annotations

import heapq
import math

import torch

# Attention implementations whose kernel is variable-length (cost per sequence, boundaries from cu_seq_lens):
# every name containing "flash", plus the names registered here (e.g. a CPU reference of flash's semantics).
_VARLEN_ATTENTION: set[str] = set()


def register_varlen_attention(name: str) -> None:
    """Declare ``name`` (an ``attn_implementation``) a variable-length kernel: packed calls then pass
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` and one call may hold a whole micro-batch in one row."""
    _VARLEN_ATTENTION.add(name)


def is_varlen_attention(name: str | None) -> bool:
    """Whether the ``attn_implementation`` ``name`` needs explicit sequence boundaries for packed rows."""
    return bool(name) and ("flash" in name or name in _VARLEN_ATTENTION)


def _lpt_order(lengths: list[int], rows_of: list[int] | None = None) -> list[int]:
    rows_of = rows_of or [1] * len(lengths)
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], -rows_of[i], i))


def assign_microbatches(
    lengths: list[int], num_microbatches: int, max_rows: int | None = None, rows_of: list[int] | None = None
) -> list[list[int]]:
    """Indices of the items in each of ``num_microbatches`` bins (LPT; ties: fewer rows, then lower bin). An item
    is a row, or with ``rows_of`` a unit of ``rows_of[i]`` rows (a segment sharing its prompt, ``core.prefix``).

    With ``max_rows``, a bin takes an item only while it stays within that many rows (the cap is raised to
    ``ceil(rows / bins)`` when it could not hold every row), or, when no bin can, the least loaded one.
    Deterministic, and the bins' (row count, token load) profile depends only on the multiset of
    ``(length, rows)`` pairs, so every rank can compute every other rank's profile from the gathered lengths alone.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r} must be >= 1")
    rows_of = rows_of or [1] * len(lengths)
    cap = math.inf if max_rows is None else max(max_rows, -(-sum(rows_of) // num_microbatches))
    bins: list[list[int]] = [[] for _ in range(num_microbatches)]
    heap = [(0, 0, b) for b in range(num_microbatches)]  # (load, rows, bin): the least loaded bin on top
    for i in _lpt_order(lengths, rows_of):
        popped = [heapq.heappop(heap)]
        while popped[-1][1] + rows_of[i] > cap and heap:
            popped.append(heapq.heappop(heap))
        fits = [entry for entry in popped if entry[1] + rows_of[i] <= cap]
        load, rows, target = fits[0] if fits else popped[0]
        bins[target].append(i)
        for entry in popped:
            heapq.heappush(heap, (load + lengths[i], rows + rows_of[i], target) if entry[2] == target else entry)
    return bins


def microbatch_row_counts(lengths: list[int], num_microbatches: int, max_rows: int | None = None) -> list[int]:
    """Rows in each bin of ``assign_microbatches(lengths, num_microbatches, max_rows)``."""
    return [len(b) for b in assign_microbatches(lengths, num_microbatches, max_rows)]


def microbatch_order(num_microbatches: int, generator: torch.Generator) -> list[int]:
    """A random order of the micro-batches (the same on every rank given the same generator): LPT fills its
    bins longest first, so without it the first optimizer steps of a generation batch would always take the
    bins of the longest sequences when ``gradient_accumulation_steps < steps_per_generation``."""
    return torch.randperm(num_microbatches, generator=generator).tolist()


def even_split(num_rows: int, num_microbatches: int, order: list[int]) -> list[list[int]]:
    """Positions ``0..num_rows-1`` cut into ``num_microbatches`` consecutive bins whose sizes differ by at most
    one, the larger ones at the bins ``order[:extra]`` (``extra = num_rows % num_microbatches``): with
    ``num_rows`` a multiple of ``num_microbatches``, TRL's own equal split of its shuffled batch."""
    base, extra = divmod(num_rows, num_microbatches)
    larger = set(order[:extra])
    sizes = [base + (j in larger) for j in range(num_microbatches)]
    bounds = [sum(sizes[:j]) for j in range(num_microbatches + 1)]
    return [list(range(bounds[j], bounds[j + 1])) for j in range(num_microbatches)]


def microbatch_plan(
    own_lengths: list[int],
    kept_lengths_per_rank: list[list[int]],
    num_microbatches: int,
    max_rows: int,
    packing: bool,
    generator: torch.Generator,
    own_unit_rows: list[int] | None = None,
    unit_rows_per_rank: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """This rank's micro-batches ``(bins, sizes)``: ``bins[j]`` the positions (into ``own_lengths``, this rank's
    kept rows in TRL's shuffled order) of micro-batch ``j``; ``sizes[j]`` its row count, the same on every rank
    (the most rows any rank puts there, at least 1: a rank short of rows fills with zero-weight fillers), from
    ``kept_lengths_per_rank`` (every rank's kept lengths, in any order). Each rank splits its OWN rows, with one
    random order of the micro-batches drawn from ``generator`` (the same on every rank). Packing: LPT bins by
    tokens (``assign_microbatches``), taken in that order. Otherwise an even split of the shuffled rows whose
    larger bins are the first of that order (``even_split``; TRL's split when the rows divide evenly). Either
    way, with ``gradient_accumulation_steps < num_microbatches`` each optimizer step's expected share of a rank's
    kept rows is ``gradient_accumulation_steps / num_microbatches``, whatever the rank kept, and the shuffle makes
    it every row's probability of landing there. Integer arithmetic only: ranks given the same gathered lengths
    and generator agree exactly. With prefix sharing the items are units (``own_unit_rows`` and ``unit_rows_per_rank``:
    each unit's row count; its length is its segment's tokens): ``bins`` then hold unit positions, ``sizes`` rows."""
    order = microbatch_order(num_microbatches, generator)

    def split(lengths: list[int], rows_of: list[int] | None) -> list[list[int]]:
        if packing:
            bins = assign_microbatches(lengths, num_microbatches, max_rows, rows_of)
            return [bins[j] for j in order]
        return even_split(len(lengths), num_microbatches, order)

    rows_per_rank = unit_rows_per_rank or [None] * len(kept_lengths_per_rank)
    counts = [
        [sum(rows_of[i] for i in b) if rows_of else len(b) for b in split(lengths, rows_of)]
        for lengths, rows_of in zip(kept_lengths_per_rank, rows_per_rank)
    ]
    return split(own_lengths, own_unit_rows), [max(1, *column) for column in zip(*counts)]


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


def _allocation(lengths: list[int], rows: list[list[int]]) -> int:
    return len(rows) * max((sum(lengths[i] for i in row) for row in rows), default=0)


def packed_allocation(
    lengths: list[int], budget: int, call_budget: int | None = None, fit_longest: bool = False
) -> int:
    """Tokens one forward call allocates for ``pack_call(lengths, budget, call_budget, fit_longest)``: rows x
    the longest packed row."""
    return _allocation(lengths, pack_call(lengths, budget, call_budget, fit_longest))


def pack_call(
    lengths: list[int], row_budget: int, call_budget: int | None = None, fit_longest: bool = False
) -> list[list[int]]:
    """The packed rows of one forward call: ``pack_rows`` at ``min(row_budget, call_budget)`` (with
    ``fit_longest``, the budget raised to the longest item: a segment sharing its prompt is longer than a row);
    when that allocates more than ``call_budget``, one item per row instead (then ``rows x longest``, which is at
    most TRL's padded call of the same rows when each item is one row); with ``fit_longest``, when that too
    allocates more, all in one row (its real tokens, at most those of TRL's call of the same rows)."""
    if fit_longest and lengths:
        row_budget = max(row_budget, max(lengths))
    if call_budget is None:
        return pack_rows(lengths, row_budget)
    rows = pack_rows(lengths, max(1, min(row_budget, call_budget)))
    if _allocation(lengths, rows) > call_budget and lengths:
        rows = [[i] for i in _lpt_order(lengths)]
        if fit_longest and _allocation(lengths, rows) > call_budget:
            rows = [_lpt_order(lengths)]
    return rows


def plan_forward_calls(
    lengths: list[int], max_rows: int, row_budget: int, call_budget: int, fit_longest: bool = False
) -> list[list[int]]:
    """The sequences of each forward call of a no-grad pass (old-policy, reference): as few calls as keep
    every call's ``pack_call`` allocation within ``call_budget``, trying from ``ceil(tokens / call_budget)``
    calls up to ``ceil(len / max_rows)`` calls of at most ``max_rows`` sequences (which always fits when
    ``call_budget >= max_rows x max(lengths)``, TRL's chunk). At least one call (an empty one when there is
    nothing to forward). The number of calls depends only on the multiset of lengths. ``fit_longest``: as in
    ``pack_call`` (segments sharing their prompt)."""
    if not lengths:
        return [[]]
    most = -(-len(lengths) // max(1, max_rows))
    fewest = min(most, max(1, -(-sum(lengths) // max(1, call_budget))))
    for calls in range(fewest, most + 1):
        groups = assign_microbatches(lengths, calls, None if calls < most else max_rows)
        if calls == most or all(
            packed_allocation([lengths[i] for i in g], row_budget, call_budget, fit_longest)
            <= call_budget
            for g in groups
        ):
            return groups
    return groups  # unreachable: the loop returns at calls == most


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


def plan_calls_per_rank(
    lengths_per_rank: list[list[int]],
    widths_per_rank: list[int],
    rows_per_call: int,
    row_budget,
    items_per_call: int | None = None,
    fit_longest: bool = False,
) -> list[list[list[int]]]:
    """Every rank's forward calls of a deferred pass (``plan_forward_calls``), each rank's planned with its OWN
    padded width (ranks pad their batches separately), then padded with empty calls to the same number on every
    rank: what every rank computes identically from the gathered lengths and widths. ``row_budget``: padded
    width -> row budget; a call allocates at most ``rows_per_call x width`` tokens and holds at most
    ``items_per_call`` items (default ``rows_per_call``; 1 for units of up to ``rows_per_call`` rows)."""
    most = items_per_call or rows_per_call
    plans = [
        [
            g
            for g in plan_forward_calls(lengths, most, row_budget(width), rows_per_call * width, fit_longest)
            if g
        ]
        for lengths, width in zip(lengths_per_rank, widths_per_rank)
    ]
    calls = max(1, max(len(p) for p in plans))
    return [p + [[]] * (calls - len(p)) for p in plans]


def packed_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    rows: list[list[list[int]]],
    pad_id: int,
) -> dict:
    """The tensors of one padding-free call over the padded batch ``input_ids`` (B, W): ``rows[r]`` the segments
    of packed row ``r``, each a list of batch rows whose real prompt tokens are equal (``core.prefix``; a row
    alone is a segment of one). A segment's rows are laid back to back, each after the first without its prompt's
    first ``P - 1`` tokens (forwarded once, by the first row); ``position_ids`` are each row's own (0 at its first
    real token; a row's tail of pad fillers counts on as a sequence of its own); ``shift_labels`` pre-shifted so
    that no position predicts across a row. ``index`` = (packed row, packed column, batch row, completion column)
    of every completion token, where its log-prob is read (at column - 1) and written back in TRL's
    ``(B, logits_to_keep)`` layout; ``layout`` = (segment ids, branch ids) of every column, for
    ``core.prefix.prefix_attention_mask``."""
    real = attention_mask.bool()
    device = input_ids.device
    lengths = real.sum(1).tolist()
    prompt_lengths = real[:, : input_ids.size(1) - logits_to_keep].sum(1).tolist()
    batch = len(lengths)
    packed_row, base, skip, shared, segment_of, branch_of = ([0] * batch for _ in range(6))
    used = []
    for r, row in enumerate(rows):
        offset = 0
        for s, segment in enumerate(row):
            prefix = max(prompt_lengths[segment[0]] - 1, 0) if len(segment) > 1 else 0
            for i, b in enumerate(segment):
                packed_row[b], segment_of[b], branch_of[b], shared[b] = r, s, i + 1, prefix
                skip[b] = prefix if i else 0
                base[b] = offset - skip[b]  # real token k of row b lands at column base[b] + k
                offset += lengths[b] - skip[b]
        used.append(offset)
    width = max(max(used, default=0), 1)
    as_tensor = lambda values: torch.tensor(values, device=device, dtype=torch.long)  # noqa: E731
    b, t = real.nonzero(as_tuple=True)
    k = (real.cumsum(1) - 1)[b, t]
    placed = k >= as_tensor(skip)[b]
    b, t, k = b[placed], t[placed], k[placed]
    r = as_tensor(packed_row)[b]
    c = as_tensor(base)[b] + k
    ids = torch.full((len(rows), width), pad_id, dtype=input_ids.dtype, device=device)
    ids[r, c] = input_ids[b, t]
    position_ids = torch.arange(width, device=device).unsqueeze(0) - torch.tensor(used, device=device)[:, None]
    position_ids = position_ids.clamp(min=0)
    position_ids[r, c] = k
    segment_ids = as_tensor([len(row) for row in rows])[:, None].repeat(1, width)  # the pad tail's own segment
    segment_ids[r, c] = as_tensor(segment_of)[b]
    branch_ids = torch.zeros_like(segment_ids)
    branch_ids[r, c] = torch.where(k < as_tensor(shared)[b], 0, as_tensor(branch_of)[b])
    completion = t >= input_ids.size(1) - logits_to_keep
    r, c, b, j = r[completion], c[completion], b[completion], (t - (input_ids.size(1) - logits_to_keep))[completion]
    labels = torch.full((len(rows), width), -100, dtype=input_ids.dtype, device=device)
    labels[r, c - 1] = ids[r, c]
    return {
        "input_ids": ids,
        "position_ids": position_ids,
        "shift_labels": labels,
        "index": (r, c, b, j),
        "layout": (segment_ids, branch_ids),
    }


def varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` of the packed rows, flattened row after row: a sequence
    starts wherever ``position_ids`` is 0. transformers' flash path takes them for any batch size, where it
    would otherwise find boundaries from ``position_ids`` only in a batch of one row."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)])
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def exchange_plan(plan: list[list[tuple[int, int]]], me: int) -> tuple[int, list[int], list[int]]:
    """For rank ``me`` under a ``balance_ranks`` plan: the slots of the fixed-size all-gather (the most rows any
    rank sends), the positions (into this rank's kept rows) of the rows it sends, in slot order, and the
    gathered rows (``source rank x slots + slot``) it receives, in the order the plan lists them."""
    world = len(plan)
    outgoing = [sorted((k, dest) for dest in range(world) for src, k in plan[dest] if src == r and dest != r)
                for r in range(world)]
    slots = max((len(rows) for rows in outgoing), default=0)
    leaving = [k for k, _ in outgoing[me]]
    arriving = [src * slots + outgoing[src].index((k, me)) for src, k in plan[me] if src != me]
    return slots, leaving, arriving
