"""Prefix sharing: the rows of a packed call that share a prompt forwarded as one segment, the prompt once.

No TRL import. A segment is a list of rows (positions into the padded batch) with equal real prompt tokens. Its
layout in a packed row: the prompt's first ``P - 1`` tokens once (the shared prefix), then one branch per row: the
prompt's last token and the row's completion. The last prompt token is repeated because its output predicts each
completion's first token. Every token keeps its position in its own row (``position_ids`` continue from the
prompt in each branch). A token attends to its segment's shared prefix and to its own branch, causally.

It is exact: the model is causal, so the prefix's hidden states are the same for every row of the segment, and the
gradient reaching them is the sum over the branches that attend to them, which repeated rows give by linearity.

- ``prompt_segments``: the segments of a padded batch (rows with equal real prompt tokens).
- ``segment_length``: the tokens a segment forwards (the shared prefix once).
- ``sharing_pays`` / ``attention_pair_cost``: whether a segment costs less than its rows apart. Its one row attends
  over every pair of its tokens under the mask, so long completions behind a short prompt cost more shared.
- ``group_units``: rows grouped by their generation group, for the planners.
- ``prefix_attention_mask``: the 4-D boolean mask of packed rows of segments (``core.packing.packed_inputs``).
- ``prefix_sharing_refusal``: why a model cannot share prefixes exactly (None when it can).
"""

from __future__ import annotations

import torch

# Attention implementations that take an explicit 4-D mask (what prefix sharing needs), and the mask they take.
MASK_ATTENTION = {"sdpa": "bool", "eager": "additive"}

# What one attended (query, key) pair under an explicit mask costs, over its share of a layer's FLOPs: the masked
# kernel computes every pair of a row, where a row of one sequence runs causally. Fitted on bench_prefix.py's CPU
# runs (sdpa, SmolLM2's layer shapes); how often the rule then agrees with the measured sign: docs/benchmarks.md.
MASKED_PAIR_COST_FACTOR = 3.0


def prompt_segments(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> list[list[int]]:
    """Rows whose real prompt tokens are equal, in order of first appearance (a row alone is a segment of one).

    Args:
        input_ids: (B, W) the padded rows, prompts left-padded in the first ``prompt_width`` columns.
        attention_mask: (B, W) 1 on real tokens.
        prompt_width: the padded prompt width.
    """
    ids, mask = input_ids[:, :prompt_width].tolist(), attention_mask[:, :prompt_width].tolist()
    segments: dict[tuple, list[int]] = {}
    for b, (row, real) in enumerate(zip(ids, mask)):
        segments.setdefault(tuple(t for t, m in zip(row, real) if m), []).append(b)
    return list(segments.values())


def segment_length(lengths: list[int], prompt_length: int) -> int:
    """Tokens a segment forwards: its rows' ``lengths`` (prompt + completion each), the shared prefix
    (``prompt_length - 1`` tokens) counted once."""
    return sum(lengths) - (len(lengths) - 1) * max(prompt_length - 1, 0)


def attention_pair_cost(config) -> float:
    """One attended (query, key) pair's cost over one token's, in a decoder layer of ``config``'s shapes: FLOPs of
    ``QK^T`` and ``AV`` for the pair against those of the token's projections and gated MLP, times
    ``MASKED_PAIR_COST_FACTOR``."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim) + 2 * 3 * hidden * intermediate
    per_pair = 2 * 2 * heads * head_dim
    return MASKED_PAIR_COST_FACTOR * per_pair / per_token


def sharing_pays(lengths: list[int], prompt_length: int, pair_cost: float) -> bool:
    """Whether rows of one prompt cost less as one segment than apart: the token positions sharing removes against
    the attended pairs it adds (a segment's row attends over its length squared; the rows apart, over each one's),
    each pair at ``pair_cost`` tokens (``attention_pair_cost``).

    Args:
        lengths: the rows' tokens (prompt + completion each).
        prompt_length: their prompt's real tokens.
        pair_cost: one attended pair's cost in tokens.
    """
    if len(lengths) < 2:
        return False
    saved = (len(lengths) - 1) * max(prompt_length - 1, 0)
    added_pairs = segment_length(lengths, prompt_length) ** 2 - sum(n * n for n in lengths)
    return saved > pair_cost * added_pairs


def group_units(groups: list[int], max_rows: int | None = None) -> list[list[int]]:
    """Positions (into ``groups``) of each unit: the rows of one group, in order of first appearance, cut into
    pieces of at most ``max_rows`` rows (a unit forwards as one segment in one call).

    Args:
        groups: the group id of each row (rows of one group share their prompt).
        max_rows: the most rows one unit holds; None: no cut.
    """
    by_group: dict[int, list[int]] = {}
    for position, group in enumerate(groups):
        by_group.setdefault(group, []).append(position)
    step = max_rows or max(len(groups), 1)
    return [rows[i : i + step] for rows in by_group.values() for i in range(0, len(rows), step)]


def prefix_attention_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """(R, 1, W, W) boolean: query column ``q`` attends to key column ``k`` of its packed row when both are in the
    same segment, ``k <= q``, and ``k`` is in the shared prefix (branch 0) or in ``q``'s branch.

    Args:
        segment_ids: (R, W) long, the segment of each column (a row's tail of pad fillers is a segment of its own).
        branch_ids: (R, W) long, 0 in a shared prefix, else the branch (row) of the segment the column belongs to.
    """
    width = segment_ids.size(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    key_branch = branch_ids[:, None, :]
    visible = (key_branch == 0) | (key_branch == branch_ids[:, :, None])
    return (causal & same_segment & visible).unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as eager attention adds it: 0 where attended, the dtype's lowest value elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def prefix_sharing_refusal(config, attn_implementation: str | None, router_aux_loss: bool) -> str | None:
    """Why a model cannot forward a shared prefix exactly, or None when it can.

    Args:
        config: the model's (text) config.
        attn_implementation: the model's attention implementation.
        router_aux_loss: whether the MoE router loss is part of the objective (it averages over every token the
            forward sees, so a prompt forwarded once would weigh less in it than in TRL's repeated rows).
    """
    if attn_implementation not in MASK_ATTENTION:
        return (
            f"attn_implementation={attn_implementation!r} takes no explicit attention mask in a packed call (prefix "
            f"sharing needs one: {sorted(MASK_ATTENTION)}); each row forwards its prompt, as without sharing"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if layer_types != {"full_attention"} or sliding:
        kinds = sorted(layer_types | ({"sliding_attention"} if sliding else set()))
        return f"the model's attention is not full attention in every layer ({kinds}); a shared prefix would see a " \
               "different window"
    if router_aux_loss:
        return "the MoE router loss averages over every token forwarded, and a shared prompt would count once " \
               "instead of once per completion"
    return None
