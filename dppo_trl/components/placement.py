"""Where the kept rows run: TRL's split of the rows (recorded per row before anything moves), the exchange of kept
rows between ranks for an even token load, the forward calls of the deferred log-prob passes on the kept rows only,
the padding-free (packed) layout of a call, and the ``steps_per_generation`` micro-batches. The math is in
``dppo_trl.core.packing`` and ``dppo_trl.core.batch``."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from ..core.batch import (
    filler_row,
    loss_mask,
    microbatch_token_counts,
    pad_to_width,
    select_rows,
    trl_microbatch_of_rows,
    unkept_rows_of_microbatch,
    with_fillers,
)
from ..core.model_support import length_dependent_rope, sequence_mixing_layers
from ..core.packing import (
    balance_ranks,
    default_packed_tokens,
    exchange_plan,
    microbatch_plan,
    pack_call,
    packed_allocation,
    packed_inputs,
    plan_calls_per_rank,
    rank_imbalance,
    varlen_kwargs,
)
from .generation_batch import ITERATION_WEIGHTS_KEY, UNKEPT_ROWS_KEY, GenerationBatch
from .view import TrainerView

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What the model allows of packing (``resolve_packing``).

    Args:
        packing: whether the passes run packed (off where the rotary follows a call's longest position).
        one_sequence_per_row: each sequence in its own packed row (layers that carry a state along a row).
        length_dependent_rope: the rope type whose frequencies follow a call's padded width, or None.
        varlen_attention: the attention kernel finds sequence boundaries from ``cu_seq_lens`` (flash).
    """

    packing: bool
    one_sequence_per_row: bool = False
    length_dependent_rope: str | None = None
    varlen_attention: bool = False


def resolve_packing(packing: bool, model, text_config, varlen_attention: bool) -> ModelLayout:
    """Where packing is exact for the model (``core.model_support``), said once: with rotary frequencies that follow
    a call's longest position, packing is off (the passes run on TRL's padded layout) and no row moves between ranks
    (a moved row is padded to the widest rank); with layers that carry a state along a row (hybrid models), each
    sequence gets its own packed row."""
    rope_type = length_dependent_rope(text_config)
    if not packing:
        return ModelLayout(False, length_dependent_rope=rope_type, varlen_attention=varlen_attention)
    if rope_type is not None:
        logger.warning(
            "Packing is off: rope_type=%r chooses its rotary frequencies from the longest position of a forward "
            "call, and a packed call's differs from TRL's padded one. DPPO runs its passes on TRL's padded "
            "layout (packing=False), as GRPO does.", rope_type,
        )
        return ModelLayout(False, length_dependent_rope=rope_type, varlen_attention=varlen_attention)
    mixing = sequence_mixing_layers(model, text_config)
    if mixing:
        logger.warning(
            "Packing puts one sequence in each row: this model's %s layers carry a state along a row, and "
            "would read one sequence's state into the next (max_packed_tokens is not used).", mixing,
        )
    return ModelLayout(True, one_sequence_per_row=bool(mixing), varlen_attention=varlen_attention)


@dataclasses.dataclass
class PackedCall:
    """One forward call's packed inputs (``model_inputs``, the model's keyword arguments) and where each packed
    token goes back in TRL's padded ``(B, T)`` layout (``index``: packed row, packed column, padded row, padded
    column)."""

    model_inputs: dict
    index: tuple
    rows: int
    logits_to_keep: int

    def unpacked(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, T) in TRL's layout from (rows, width) packed per-token values (zeros where no token is)."""
        r, c, b, j = self.index
        out = torch.zeros(self.rows, self.logits_to_keep, device=packed.device, dtype=dtype)
        out[b, j] = packed[r, c - 1].to(dtype)
        return out


class RowPlacement:
    """Where each kept row trains and how each forward call is laid out.

    Args:
        config: the run's ``DPPOConfig``.
        layout: ``ModelLayout`` (``resolve_packing``).
        prefix_sharing: ``components.prefix_sharing.PrefixSharing``.
        view: the trainer (``components.view.TrainerView``).
        follow_trl_split: micro-batches hold TRL's own split (the entropy filter's quantile is a statistic of one
            micro-batch at its forward, which only TRL's split reproduces).
        per_sequence_ratio: whether the vLLM importance-sampling ratio is one per row (``sequence_*`` modes), as the
            trainer's setting stands at the call.
        pad_token_id: the tokenizer's.
        tolerance: a rank's kept tokens may exceed the mean by this fraction before rows move.
    """

    def __init__(self, config, layout: ModelLayout, prefix_sharing, view: TrainerView, follow_trl_split: bool,
                 per_sequence_ratio: Callable[[], bool], pad_token_id: int, tolerance: float):
        self.config, self.layout, self.prefix_sharing, self.view = config, layout, prefix_sharing, view
        self.follow_trl_split, self.per_sequence_ratio = follow_trl_split, per_sequence_ratio
        self.pad_token_id, self.tolerance = pad_token_id, tolerance

    def trl_split_of_rows(self, output: dict, batch: GenerationBatch) -> dict:
        """Per-row entries that travel with each row, also to another rank: ``dppo_row``, its index in the generation
        batch (its group: ``dppo_row // num_generations``); ``dppo_trl_microbatch``, the micro-batch of TRL's split
        the row would be in (TRL's shuffle replayed from the RNG state it is about to draw from, without drawing:
        GRPO's split wherever nothing draws in between, e.g. dropout in the deferred passes; random and independent
        of the keep draw either way), ``dppo_trl_microbatch_tokens``, that micro-batch's loss tokens (every row of
        it, kept or not), and ``dppo_origin_rank``. Records the RNG state in ``batch`` (the audit's GRPO reference
        shuffles from it too)."""
        rows, device = output["advantages"].size(0), output["advantages"].device
        batch.trl_split_rng_state = torch.get_rng_state()
        with torch.random.fork_rng(devices=[]):
            permutation = torch.randperm(rows)  # shuffle_sequence_dict's draw
        steps = self.config.steps_per_generation
        microbatch = trl_microbatch_of_rows(permutation, steps)
        tokens = microbatch_token_counts(microbatch, loss_mask(output).sum(1), steps)
        first = self.view.rank * rows
        return {
            "dppo_row": torch.arange(first, first + rows, device=device),
            "dppo_trl_microbatch": microbatch.to(device),
            "dppo_trl_microbatch_tokens": tokens.to(device, torch.float32),
            "dppo_origin_rank": torch.full((rows,), self.view.rank, device=device),
        }

    @torch.no_grad()
    def balance_ranks(self, output: dict, batch: GenerationBatch) -> dict:
        """Move kept rows between ranks (``rank_plan``: ``balance_ranks`` on the gathered kept lengths, with prefix
        sharing a group's kept rows together; the same plan on every rank) so each rank's token load is within
        ``tolerance`` of the mean where the rows allow.
        A row that leaves stays in its rank's batch, no longer kept; received rows are appended, kept. Every
        per-row tensor travels (one fixed-size gather per key, padded to the widest rank). Each row's loss term
        is normalized by global constants or by its own TRL micro-batch's count, which travels with it, so where a
        row trains does not change the gradient. No row moves while micro-batches follow TRL's split, nor with a
        rotary scaling that follows a call's padded width. Updates the kept rows and widths in ``batch``."""
        rows_stay = self.follow_trl_split or self.layout.length_dependent_rope is not None
        plan, loads_before, loads_after = self.rank_plan(batch, math.inf if rows_stay else self.tolerance)
        self.view.log_metric("dppo/rank_imbalance_before", rank_imbalance(loads_before))
        self.view.log_metric("dppo/rank_imbalance", rank_imbalance(loads_after))
        slots, leaving, arriving = exchange_plan(plan, self.view.rank)
        if slots == 0:
            return output
        local_rows = output["dppo_keep"].size(0)
        widths = batch.padded_widths.amax(0).tolist()
        batch.widths_per_rank = [sum(widths)] * self.view.world_size  # every rank pads to the widest
        leaving = output["dppo_keep"].nonzero().flatten()[leaving]
        per_sequence = self.per_sequence_ratio()
        out = dict(output)
        per_row = (k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() and len(v) == local_rows)
        for key in sorted(per_row):
            value = pad_to_width(output, key, *widths, self.pad_token_id, per_sequence)
            send = value.new_zeros(slots, *value.shape[1:]) if key != "dppo_keep" else value.new_ones(slots)
            send[: len(leaving)] = value[leaving]
            gathered = self.view.gather(send if key != "dppo_keep" else send.long()).to(value.dtype)
            out[key] = torch.cat([value, gathered[arriving]])
        out["dppo_keep"][leaving] = False
        out["dppo_weight"][leaving] = 0.0
        out[ITERATION_WEIGHTS_KEY][leaving] = 0.0
        batch.kept_rows_per_rank = [[batch.kept_rows_per_rank[r][i] for r, i in rows] for rows in plan]
        return out

    def rank_plan(self, batch: GenerationBatch, tolerance: float):
        """``(plan, loads before, loads after)``: ``balance_ranks`` over every rank's kept rows, or with prefix sharing
        over its units (``PrefixSharing.rank_units``: a group's rows move together, a rank's load counts a shared
        prompt once), expanded to rows: a rank's own rows in their order, then the rows it receives."""
        if not self.prefix_sharing.places_units:
            lengths = batch.kept_lengths_per_rank
            plan = balance_ranks(lengths, tolerance)
            return plan, [sum(r) for r in lengths], [sum(lengths[r][i] for r, i in rows) for rows in plan]
        units = [self.prefix_sharing.rank_units(rows, batch.row_tokens) for rows in batch.kept_rows_per_rank]
        unit_plan = balance_ranks([u[1] for u in units], tolerance)
        plan = []
        for dest, held in enumerate(unit_plan):
            rows = [(src, i) for src, u in held for i in units[src][0][u]]
            plan.append(sorted(r for r in rows if r[0] == dest) + [r for r in rows if r[0] != dest])
        loads_after = [sum(units[src][1][u] for src, u in held) for held in unit_plan]
        return plan, [sum(u[1]) for u in units], loads_after

    def deferred_call_groups(self, rows: torch.Tensor, batch: GenerationBatch,
                             output_rows: list[int]) -> list[torch.Tensor]:
        """The kept ``rows`` of each forward call of a deferred pass, as many calls on every rank (each rank's calls
        planned from the gathered kept lengths and padded widths of every rank; with prefix sharing, from its
        units, ``output_rows`` being the kept rows' indices in the generation batch). An empty group: this rank
        forwards a filler in that call, so sharded models (ZeRO-3, FSDP) that gather parameters in every forward
        stay in step."""
        per_call = self.config.per_device_train_batch_size
        if self.prefix_sharing.places_units:  # one group's rows in one call, at most per_call of them
            units_per_rank = [self.prefix_sharing.rank_units(kept, batch.row_tokens)
                              for kept in batch.kept_rows_per_rank]
            plans = plan_calls_per_rank([u[1] for u in units_per_rank], batch.widths_per_rank, per_call,
                                        self.packed_budget, items_per_call=1, fit_longest=True)
            mine = self.prefix_sharing.rank_units(output_rows, batch.row_tokens)[0]
            return [rows[torch.tensor([p for u in g for p in mine[u]], dtype=torch.long)]
                    for g in plans[self.view.rank]]
        kept_lengths = batch.kept_lengths_per_rank
        if self.config.packing:
            plans = plan_calls_per_rank(kept_lengths, batch.widths_per_rank, per_call, self.packed_budget)
            return [rows[torch.tensor(g, dtype=torch.long)] for g in plans[self.view.rank]]
        num_calls = max(1, max(-(-len(lengths) // per_call) for lengths in kept_lengths))
        mine = [g for g in torch.tensor_split(rows, num_calls) if g.numel()]
        return mine + [rows[:0]] * (num_calls - len(mine))

    def packed_budget(self, padded_width: int) -> int:
        """A packed row's token budget in a call whose padded rows are ``padded_width`` wide."""
        if self.layout.one_sequence_per_row:  # a budget of one token: every sequence alone in its row
            return 1
        return self.config.max_packed_tokens or default_packed_tokens(
            self.config.per_device_train_batch_size, padded_width, varlen_attention=self.layout.varlen_attention
        )

    def packed_call(self, input_ids, attention_mask, logits_to_keep, mask_dtype: torch.dtype) -> PackedCall:
        """One forward call of TRL's padded rows laid out padding-free (``packed_inputs``: sequences back to back,
        ``position_ids`` restarting per sequence, pre-shifted labels; with prefix sharing the rows of one prompt as
        one segment under a 4-D mask; with a variable-length kernel ``cu_seq_lens``), allocating no more than
        TRL's padded call of ``per_device_train_batch_size`` rows."""
        segments, lengths = self.prefix_sharing.call_segments(input_ids, attention_mask, logits_to_keep)
        call_budget = self.config.per_device_train_batch_size * input_ids.size(1)
        budget = self.packed_budget(input_ids.size(1))
        rows = pack_call(lengths, budget, call_budget, fit_longest=self.prefix_sharing.enabled)
        rows = [[segments[i] for i in row] for row in rows]
        packed = packed_inputs(input_ids, attention_mask, logits_to_keep, rows, self.pad_token_id)
        index, layout = packed.pop("index"), packed.pop("layout")
        if any(len(segment) > 1 for segment in segments):  # each completion sees its prompt and its own tokens
            packed["attention_mask"] = self.prefix_sharing.mask(layout, mask_dtype)
        elif self.layout.one_sequence_per_row:  # TRL's padding mask: no layer (nor the MoE router loss) reads pads
            packed["attention_mask"] = (layout[0] == 0).long()
        elif self.layout.varlen_attention:  # flash finds boundaries from position_ids only in a batch of one row
            packed.update(varlen_kwargs(packed["position_ids"]))
        return PackedCall(packed, index, input_ids.size(0), logits_to_keep)

    def kept_microbatches(self, rows: dict, batch: GenerationBatch, iteration: int = 0) -> list[dict]:
        """Split this rank's kept rows (in TRL's shuffled order) into ``steps_per_generation`` micro-batches
        (``microbatch_plan``: by tokens with packing, at most ``per_device_train_batch_size`` rows each where the
        rows allow, or evenly by rows; a fair share of every rank's rows in each optimizer step; or TRL's own
        split, ``follow_trl_split``), with the same row count on every rank in each micro-step; a slot with no
        kept row fills up with zero-weight filler rows of one token. Under the entropy filter with completion
        pruning, each micro-batch of which some rank kept a row also carries the tokens of the rows of TRL's
        micro-batch that were not kept (``UNKEPT_ROWS_KEY``): the filter's quantile is taken over them too, as TRL
        takes it. ``iteration``: which of ``num_iterations`` (its own seed of the plan's order)."""
        rows = dict(rows)
        keep, trl_microbatch = rows.pop("dppo_keep"), rows.pop("dppo_trl_microbatch")
        rows.pop("dppo_origin_rank")
        row_index = rows.pop("dppo_row").tolist()
        kept = keep.nonzero().flatten()
        lengths = (rows["prompt_mask"].sum(1) + rows["completion_mask"].sum(1)).tolist()
        kept_anywhere = None  # under the filter: per micro-batch, whether any rank kept a row of it
        if self.follow_trl_split:
            bins, sizes = self._trl_split_bins(trl_microbatch, kept)
            kept_anywhere, sizes = [size > 0 for size in sizes], [max(size, 1) for size in sizes]
        elif self.prefix_sharing.places_units:
            bins, sizes = self._unit_bins(kept.tolist(), [row_index[i] for i in kept.tolist()], batch, iteration)
        else:
            generator = torch.Generator().manual_seed(self.view.seed("microbatch_plan", iteration))
            config = self.config
            positions, sizes = microbatch_plan(
                [lengths[i] for i in kept.tolist()], batch.kept_lengths_per_rank, config.steps_per_generation,
                config.per_device_train_batch_size, config.packing, generator,
            )
            bins = [kept[p].tolist() for p in positions]
        filler = filler_row(rows)
        microbatches = [
            with_fillers(select_rows(rows, torch.tensor(members, dtype=torch.long)), filler, size)
            for members, size in zip(bins, sizes)
        ]
        if kept_anywhere is not None and self.config.completion_pruning:
            for j, microbatch in enumerate(microbatches):
                if kept_anywhere[j]:  # else only fillers train: the filter acts on nothing (the same on every rank)
                    microbatch[UNKEPT_ROWS_KEY] = unkept_rows_of_microbatch(rows, keep, trl_microbatch, j)
        self._log_microbatch_metrics(rows, lengths, bins, sizes, row_index, batch)
        return microbatches

    def _unit_bins(self, kept: list[int], kept_rows: list[int], batch: GenerationBatch, iteration: int = 0):
        """``(bins, sizes)`` with prefix sharing: ``microbatch_plan`` over units (``PrefixSharing.rank_units``: one
        group's kept rows on this rank, one segment), so a group's rows train in one micro-batch and forward their
        prompt once. ``kept``: positions of this rank's kept rows; ``kept_rows``: their indices in the generation
        batch."""
        units, unit_lengths, unit_rows = self.prefix_sharing.rank_units(kept_rows, batch.row_tokens)
        every_rank = [self.prefix_sharing.rank_units(rows, batch.row_tokens) for rows in batch.kept_rows_per_rank]
        generator = torch.Generator().manual_seed(self.view.seed("microbatch_plan", iteration))
        positions, sizes = microbatch_plan(
            unit_lengths,
            [u[1] for u in every_rank],
            self.config.steps_per_generation,
            self.config.per_device_train_batch_size,
            True,
            generator,
            own_unit_rows=unit_rows,
            unit_rows_per_rank=[u[2] for u in every_rank],
        )
        return [[kept[p] for u in bin_units for p in units[u]] for bin_units in positions], sizes

    def _trl_split_bins(self, trl_microbatch, kept) -> tuple[list[list[int]], list[int]]:
        """``(bins, sizes)``: bin ``j`` the kept rows of TRL's micro-batch ``j``; ``sizes[j]`` the most any rank has
        there (0 when no rank kept a row of it)."""
        steps = self.config.steps_per_generation
        of_kept = trl_microbatch[kept].cpu()
        bins = [kept[of_kept == j].tolist() for j in range(steps)]
        counts = torch.tensor([len(members) for members in bins], device=self.view.device)
        sizes = self.view.gather(counts).view(-1, steps).amax(0).tolist()
        return bins, sizes

    def _log_microbatch_metrics(self, rows, lengths, bins, sizes, row_index, batch) -> None:
        """``dppo/token_density`` (real / allocated tokens), ``dppo/microbatch_imbalance`` and
        ``dppo/prefix_tokens_saved`` (the share of the kept rows' token positions that prefix sharing removed), over
        all ranks."""
        width = rows["prompt_ids"].size(1) + rows["completion_ids"].size(1)
        budget, call_budget = self.packed_budget(width), self.config.per_device_train_batch_size * width
        shared = self.prefix_sharing.places_units
        row_tokens = float(sum(lengths[i] for members in bins for i in members))
        tokens_per_mb, allocated = [], 0.0
        for members, size in zip(bins, sizes):
            fillers = [1] * (size - len(members))  # a filler row forwards one token
            member_lengths = [lengths[i] for i in members]
            if shared:
                member_lengths = self.prefix_sharing.rank_units([row_index[i] for i in members], batch.row_tokens)[1]
            tokens_per_mb.append(float(sum(member_lengths)))
            if self.config.packing:
                allocated += packed_allocation(member_lengths + fillers, budget, call_budget, shared)
            else:
                allocated += size * width
        stats = torch.tensor([sum(tokens_per_mb), allocated, max(tokens_per_mb), sum(tokens_per_mb) / len(bins),
                              row_tokens])
        stats = self.view.reduce_sum(stats.to(self.view.device)).cpu()
        log = self.view.log_metric
        log("dppo/token_density", float(stats[0] / stats[1]) if stats[1] > 0 else 0.0)
        log("dppo/microbatch_imbalance", float(stats[2] / stats[3]) if stats[3] > 0 else 1.0)
        log("dppo/prefix_tokens_saved", float(1 - stats[0] / stats[4]) if stats[4] > 0 else 0.0)
