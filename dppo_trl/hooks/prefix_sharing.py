"""Prefix sharing in the packed passes: whether the model can share a prompt exactly, the units the planners place
(a group's kept rows on one rank, one segment each), the segments of one forward call, and their attention mask.
The layout and its math are in ``dppo_trl.core.prefix`` and ``dppo_trl.core.packing.packed_inputs``.

Reads of the host trainer: ``args``, ``num_generations``, ``aux_loss_enabled``, ``_one_sequence_per_row``
(``hooks.placement``)."""

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
from .generation_batch import GenerationBatch

logger = logging.getLogger(__name__)


class PrefixSharing:
    """Mixed into ``DPPOTrainer``."""

    _prefix_sharing = False  # resolved at construction (``_resolve_prefix_sharing``)
    _attention = ""
    _pair_cost = 0.0  # one attended pair's cost in tokens (``core.prefix.attention_pair_cost``)

    def _resolve_prefix_sharing(self, model_config, attention: str) -> bool:
        """Whether the packed passes share prefixes: ``prefix_sharing`` where the model makes it exact
        (``core.prefix.prefix_sharing_refusal``); where it does not, an error for ``True`` and the reason logged
        once for ``None``."""
        self._attention = attention
        self._pair_cost = attention_pair_cost(model_config)
        if not self.args.packing or self.args.prefix_sharing is False:
            return False
        reason = prefix_sharing_refusal(model_config, attention, self.aux_loss_enabled)
        if reason is None and self._one_sequence_per_row:  # a Conv1d the layer types do not name
            reason = "the model's layers carry a state along a row: each sequence has its own packed row"
        if reason is None:
            return True
        if self.args.prefix_sharing:
            raise ValueError(f"prefix_sharing=True is not exact for this model: {reason}. Set prefix_sharing=None "
                             "(on where exact) or False.")
        logger.warning("Prefix sharing is off: %s.", reason)
        return False

    @property
    def _shares_prefixes(self) -> bool:
        """Whether the planners place units (prefix sharing on and the passes packed)."""
        return self.args.packing and self._prefix_sharing

    def _rank_units(self, rows: list[int], batch: GenerationBatch) -> tuple[list[list[int]], list[int], list[int]]:
        """``(units, lengths, row_counts)`` of one rank's kept ``rows`` (indices into the generation batch): each
        unit the positions (into ``rows``) of one group's rows, at most ``per_device_train_batch_size`` of them,
        and its tokens (its segment's where sharing pays, ``_segment_tokens``). Units are formed in the order of
        the rows' indices, so every rank finds the same units for a rank from the gathered rows, whatever order
        that rank holds them in."""
        order = sorted(range(len(rows)), key=rows.__getitem__)
        groups = [rows[i] // self.num_generations for i in order]
        units = [[order[p] for p in unit] for unit in group_units(groups, self.args.per_device_train_batch_size)]
        tokens = batch.row_tokens
        lengths = [
            self._segment_tokens([int(tokens[rows[i], :2].sum()) for i in unit], int(tokens[rows[unit[0]], 0]))
            for unit in units
        ]
        return units, lengths, [len(unit) for unit in units]

    def _segment_tokens(self, lengths: list[int], prompt_length: int) -> int:
        """The tokens rows of one prompt forward: once for the prompt where sharing pays, else their own."""
        if sharing_pays(lengths, prompt_length, self._pair_cost):
            return segment_length(lengths, prompt_length)
        return sum(lengths)

    def _call_segments(self, input_ids, attention_mask, logits_to_keep) -> tuple[list[list[int]], list[int]]:
        """The segments of one packed call (rows with equal prompts where sharing pays, else each row alone) and
        their tokens."""
        lengths = attention_mask.sum(1).tolist()
        if not self._prefix_sharing:
            return [[b] for b in range(len(lengths))], lengths
        prompt_width = input_ids.size(1) - logits_to_keep
        prompt_lengths = attention_mask[:, :prompt_width].sum(1).tolist()
        segments = []
        for segment in prompt_segments(input_ids, attention_mask, prompt_width):
            if sharing_pays([lengths[b] for b in segment], prompt_lengths[segment[0]], self._pair_cost):
                segments.append(segment)
            else:
                segments.extend([b] for b in segment)
        return segments, [segment_length([lengths[b] for b in s], prompt_lengths[s[0]]) for s in segments]

    def _prefix_mask(self, layout: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The packed call's 4-D attention mask in the form the model's kernel takes (boolean for sdpa, additive
        for eager)."""
        mask = prefix_attention_mask(*layout)
        return mask if MASK_ATTENTION[self._attention] == "bool" else additive_mask(mask, dtype)
