"""Prefix sharing in the packed passes: whether the model can share a prompt exactly, the units the planners place
(a group's kept rows on one rank, one segment each), the segments of one forward call, and their attention mask.
The layout and its math are in ``dppo_trl.core.prefix`` and ``dppo_trl.core.packing.packed_inputs``."""

from __future__ import annotations

import logging

import torch

from ..core.prefix import (
    MASK_ATTENTION,
    additive_mask,
    attention_pair_cost,
    group_units,
    prefix_attention_mask,
    prefix_sharing_refusal,
    prompt_segments,
    segment_length,
    sharing_pays,
)

logger = logging.getLogger(__name__)


class PrefixSharing:
    """Whether, and where, a packed pass forwards the prompt of a group's rows once.

    Args:
        config: the run's ``DPPOConfig`` (``packing``, ``prefix_sharing``, ``per_device_train_batch_size``).
        model_config: the model's text config.
        attention: the model's attention implementation.
        group_size: ``num_generations``.
        router_loss: whether the MoE router loss is on (it reads every token: no sharing).
        one_sequence_per_row: whether each sequence gets its own packed row (layers with a state along a row).
    """

    def __init__(self, config, model_config, attention: str, group_size: int, router_loss: bool,
                 one_sequence_per_row: bool):
        self.config, self.attention, self.group_size = config, attention, group_size
        self.pair_cost = attention_pair_cost(model_config)  # one attended pair's cost in tokens
        self.enabled = self._resolve(model_config, router_loss, one_sequence_per_row)

    def _resolve(self, model_config, router_loss: bool, one_sequence_per_row: bool) -> bool:
        """``prefix_sharing`` where the model makes it exact (``core.prefix.prefix_sharing_refusal``); where it does
        not, an error for ``True`` and the reason logged once for ``None``."""
        if not self.config.packing or self.config.prefix_sharing is False:
            return False
        reason = prefix_sharing_refusal(model_config, self.attention, router_loss)
        if reason is None and one_sequence_per_row:  # a Conv1d the layer types do not name
            reason = "the model's layers carry a state along a row: each sequence has its own packed row"
        if reason is None:
            return True
        if self.config.prefix_sharing:
            raise ValueError(f"prefix_sharing=True is not exact for this model: {reason}. Set prefix_sharing=None "
                             "(on where exact) or False.")
        logger.warning("Prefix sharing is off: %s.", reason)
        return False

    @property
    def places_units(self) -> bool:
        """Whether the planners place units (prefix sharing on and the passes packed)."""
        return self.config.packing and self.enabled

    def rank_units(self, rows: list[int], row_tokens: torch.Tensor) -> tuple[list[list[int]], list[int], list[int]]:
        """``(units, lengths, row_counts)`` of one rank's kept ``rows`` (indices into the generation batch, whose
        (N, 3) ``row_tokens`` are ``GenerationBatch.row_tokens``): each unit the positions (into ``rows``) of one
        group's rows, at most ``per_device_train_batch_size`` of them, and its tokens (its segment's where sharing
        pays). Units are formed in the order of the rows' indices, so every rank finds the same units for a rank
        from the gathered rows, whatever order that rank holds them in."""
        order = sorted(range(len(rows)), key=rows.__getitem__)
        groups = [rows[i] // self.group_size for i in order]
        units = [[order[p] for p in unit] for unit in group_units(groups, self.config.per_device_train_batch_size)]
        lengths = [
            self.segment_tokens([int(row_tokens[rows[i], :2].sum()) for i in unit], int(row_tokens[rows[unit[0]], 0]))
            for unit in units
        ]
        return units, lengths, [len(unit) for unit in units]

    def segment_tokens(self, lengths: list[int], prompt_length: int) -> int:
        """The tokens rows of one prompt forward: once for the prompt where sharing pays, else their own."""
        if sharing_pays(lengths, prompt_length, self.pair_cost):
            return segment_length(lengths, prompt_length)
        return sum(lengths)

    def call_segments(self, input_ids, attention_mask, logits_to_keep) -> tuple[list[list[int]], list[int]]:
        """The segments of one packed call (rows with equal prompts where sharing pays, else each row alone) and
        their tokens."""
        lengths = attention_mask.sum(1).tolist()
        if not self.enabled:
            return [[b] for b in range(len(lengths))], lengths
        prompt_width = input_ids.size(1) - logits_to_keep
        prompt_lengths = attention_mask[:, :prompt_width].sum(1).tolist()
        segments = []
        for segment in prompt_segments(input_ids, attention_mask, prompt_width):
            if sharing_pays([lengths[b] for b in segment], prompt_lengths[segment[0]], self.pair_cost):
                segments.append(segment)
            else:
                segments.extend([b] for b in segment)
        return segments, [segment_length([lengths[b] for b in s], prompt_lengths[s[0]]) for s in segments]

    def mask(self, layout: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The packed call's 4-D attention mask in the form the model's kernel takes (boolean for sdpa, additive
        for eager)."""
        mask = prefix_attention_mask(*layout)
        return mask if MASK_ATTENTION[self.attention] == "bool" else additive_mask(mask, dtype)
