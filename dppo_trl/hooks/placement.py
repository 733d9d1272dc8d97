"""Where the kept rows run: TRL's split of the rows (recorded per row before anything moves), the exchange of kept
rows between ranks for an even token load, the deferred log-prob passes on the kept rows only, the padding-free
(packed) forward, and the ``steps_per_generation`` micro-batches. The math is in ``dppo_trl.core.packing`` and
``dppo_trl.core.batch``.

Reads of the host trainer (and writes ``args.packing``, off for a length-dependent rotary: ``_resolve_packing``):
``args``, ``accelerator``, ``model``, ``ref_model``, ``beta``, ``top_entropy_quantile``,
``vllm_importance_sampling_mode``, ``_tokenizer``, ``_metrics``, ``_varlen_attention``, ``prefix_sharing``
(``components.prefix_sharing``);
``_get_per_token_logps_and_entropies`` (TRL's hook, DPPO's override), ``view`` (``host.view``),
``weighted_metrics`` (``components.weighted_metrics``)."""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from trl.extras.profiling import profiling_decorator
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

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
from ..core.model_support import length_dependent_rope, sequence_mixing_layers
from ..components.generation_batch import ITERATION_WEIGHTS_KEY, UNKEPT_ROWS_KEY, GenerationBatch

logger = logging.getLogger(__name__)


class RowPlacement:
    """Mixed into ``DPPOTrainer``."""

    RANK_BALANCE_TOLERANCE = 0.1  # a rank's kept tokens may exceed the mean by this fraction before rows move
    _one_sequence_per_row = False  # resolved at construction (``_resolve_packing``)
    _length_dependent_rope: str | None = None  # likewise

    def _resolve_packing(self, model, config) -> None:
        """Where packing is exact for the model (``core.model_support``), said once: with rotary frequencies that
        follow a call's longest position, ``packing`` is turned off (the passes run on TRL's padded layout) and no
        row moves between ranks (a moved row is padded to the widest rank); with layers that carry a state along a
        row (hybrid models), each sequence gets its own packed row."""
        self._length_dependent_rope = rope_type = length_dependent_rope(config)
        if not self.args.packing:
            return
        if rope_type is not None:
            logger.warning(
                "Packing is off: rope_type=%r chooses its rotary frequencies from the longest position of a forward "
                "call, and a packed call's differs from TRL's padded one. DPPO runs its passes on TRL's padded "
                "layout (packing=False), as GRPO does.", rope_type,
            )
            self.args.packing = False
            return
        mixing = sequence_mixing_layers(model, config)
        if mixing:
            logger.warning(
                "Packing puts one sequence in each row: this model's %s layers carry a state along a row, and "
                "would read one sequence's state into the next (max_packed_tokens is not used).", mixing,
            )
            self._one_sequence_per_row = True

    @property
    def _microbatches_follow_trl_split(self) -> bool:
        """Whether micro-batch ``j`` holds this rank's kept rows of TRL's micro-batch ``j`` (TRL's random split, in
        its order: no token balancing, no rows moved between ranks). The entropy filter's quantile is a statistic
        of the tokens of one micro-batch at its forward, which only TRL's own split reproduces."""
        return self.top_entropy_quantile < 1.0

    def _trl_split_of_rows(self, output: dict, batch: GenerationBatch) -> dict:
        """Per-row entries that travel with each row, also to another rank: ``dppo_row``, its index in the generation
        batch (its group: ``dppo_row // num_generations``); ``dppo_trl_microbatch``, the micro-batch
        of TRL's split the row would be in (TRL's shuffle replayed from the RNG state it is about to draw from,
        without drawing: GRPO's split wherever nothing draws in between, e.g. dropout in the deferred passes;
        random and independent of the keep draw either way), ``dppo_trl_microbatch_tokens``, that micro-batch's
        loss tokens (every row of it, kept or not), and ``dppo_origin_rank``. Records the RNG state in ``batch``
        (the audit's GRPO reference shuffles from it too)."""
        rows, device = output["advantages"].size(0), output["advantages"].device
        batch.trl_split_rng_state = torch.get_rng_state()
        with torch.random.fork_rng(devices=[]):
            permutation = torch.randperm(rows)  # shuffle_sequence_dict's draw
        microbatch = trl_microbatch_of_rows(permutation, self.args.steps_per_generation)
        tokens = microbatch_token_counts(microbatch, loss_mask(output).sum(1), self.args.steps_per_generation)
        first = self.accelerator.process_index * rows
        return {
            "dppo_row": torch.arange(first, first + rows, device=device),
            "dppo_trl_microbatch": microbatch.to(device),
            "dppo_trl_microbatch_tokens": tokens.to(device, torch.float32),
            "dppo_origin_rank": torch.full((rows,), self.accelerator.process_index, device=device),
        }

    @profiling_decorator
    @torch.no_grad()
    def _balance_ranks(self, output: dict, batch: GenerationBatch) -> dict:
        """Move kept rows between ranks (``_rank_plan``: ``balance_ranks`` on the gathered kept lengths, with prefix
        sharing a group's kept rows together; the same plan on every rank) so each rank's token load is within
        ``RANK_BALANCE_TOLERANCE`` of the mean where the rows allow.
        A row that leaves stays in its rank's batch, no longer kept; received rows are appended, kept. Every
        per-row tensor travels (one fixed-size gather per key, padded to the widest rank). Each row's loss term
        is normalized by global constants or by its own TRL micro-batch's count, which travels with it, so where a
        row trains does not change the gradient. No row moves while micro-batches follow TRL's split, nor with a
        rotary scaling that follows a call's padded width (``_resolve_packing``). Updates the kept rows and widths
        in ``batch``."""
        rows_stay = self._microbatches_follow_trl_split or self._length_dependent_rope is not None
        tolerance = math.inf if rows_stay else self.RANK_BALANCE_TOLERANCE
        plan, loads_before, loads_after = self._rank_plan(batch, tolerance)
        metrics = self._metrics["train"]
        metrics["dppo/rank_imbalance_before"].append(rank_imbalance(loads_before))
        metrics["dppo/rank_imbalance"].append(rank_imbalance(loads_after))
        slots, leaving, arriving = exchange_plan(plan, self.accelerator.process_index)
        if slots == 0:
            return output
        local_rows = output["dppo_keep"].size(0)
        widths = batch.padded_widths.amax(0).tolist()
        batch.widths_per_rank = [sum(widths)] * self.accelerator.num_processes  # every rank pads to the widest
        per_sequence_ratio = str(self.vllm_importance_sampling_mode).startswith("sequence")
        leaving = output["dppo_keep"].nonzero().flatten()[leaving]
        out = dict(output)
        per_row = (k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() and len(v) == local_rows)
        for key in sorted(per_row):
            value = pad_to_width(output, key, *widths, self._tokenizer.pad_token_id, per_sequence_ratio)
            send = value.new_zeros(slots, *value.shape[1:]) if key != "dppo_keep" else value.new_ones(slots)
            send[: len(leaving)] = value[leaving]
            gathered = self.accelerator.gather(send if key != "dppo_keep" else send.long()).to(value.dtype)
            out[key] = torch.cat([value, gathered[arriving]])
        out["dppo_keep"][leaving] = False
        out["dppo_weight"][leaving] = 0.0
        out[ITERATION_WEIGHTS_KEY][leaving] = 0.0
        batch.kept_rows_per_rank = [[batch.kept_rows_per_rank[r][i] for r, i in rows] for rows in plan]
        return out

    def _rank_plan(self, batch: GenerationBatch, tolerance: float):
        """``(plan, loads before, loads after)``: ``balance_ranks`` over every rank's kept rows, or with prefix sharing
        over its units (``PrefixSharing.rank_units``: a group's rows move together, a rank's load counts a shared
        prompt once),
        expanded to rows: a rank's own rows in their order, then the rows it receives."""
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

    @profiling_decorator
    @torch.no_grad()
    def _run_deferred_logps(self, output: dict, batch: GenerationBatch) -> None:
        """Run the log-prob passes TRL deferred (``batch.deferred_calls``), on the kept rows only; other rows hold
        zeros. Each pass is cut into forward calls no larger than TRL's (``per_device_train_batch_size`` padded
        rows; padding-free calls planned by ``plan_calls_per_rank``), and every rank makes as many calls as the rank
        that needs the most, a rank short of rows forwarding a one-token filler, so sharded models (ZeRO-3, FSDP)
        that gather parameters in every forward stay in step."""
        rows = output["dppo_keep"].nonzero().flatten()
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        filler_mask = torch.zeros_like(attention_mask[:1])
        filler_mask[:, output["prompt_ids"].size(1) - 1] = 1  # one real token: the last prompt column
        groups = self._deferred_call_groups(rows, batch, output["dppo_row"][rows].tolist())
        logits_to_keep = output["completion_ids"].size(1)
        calls = batch.deferred_calls
        for name, model in zip(self._deferred_pass_names(calls), calls):
            full = output[name]
            model, adapter = self._deferred_pass_model(name, model)
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), adapter:
                for group in groups:
                    if group.numel():
                        logps = self._logps_of(
                            model, input_ids[group], attention_mask[group], logits_to_keep, group.numel()
                        )
                        full[group] = logps.to(full.dtype)
                    else:  # this rank has no row for this call: one filler keeps the call counts equal
                        self._logps_of(model, input_ids[:1], filler_mask, logits_to_keep, 1)
        if "importance_sampling_ratio" in output:  # on every rank: it gathers metrics
            self.weighted_metrics.recompute_vllm_importance_sampling(output, rows)

    def _deferred_pass_names(self, calls: list) -> list[str]:
        """The output key each deferred call fills. TRL calls, in order: the old-policy pass (only when it needs
        one), then the reference pass (``beta != 0``)."""
        has_ref = int(self.beta != 0.0)
        return ["old_per_token_logps"] * (len(calls) - has_ref) + ["ref_per_token_logps"] * has_ref

    def _deferred_pass_model(self, name: str, model) -> tuple:
        """``(model, context)`` of a deferred pass: TRL's model, or for the reference of a PEFT policy without a
        reference model, the policy inside the adapter context TRL had entered (the base, or the ``ref`` adapter)."""
        if name == "ref_per_token_logps" and self.ref_model is None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            return self.model, use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        return model, contextlib.nullcontext()

    def _deferred_call_groups(
        self, rows: torch.Tensor, batch: GenerationBatch, output_rows: list[int]
    ) -> list[torch.Tensor]:
        """The kept rows of each forward call of a deferred pass, as many calls on every rank (each rank's calls
        planned from the gathered kept lengths and padded widths of every rank; with prefix sharing, from its
        units, ``output_rows`` being the kept rows' indices in the generation batch)."""
        per_call = self.args.per_device_train_batch_size
        kept_lengths = batch.kept_lengths_per_rank
        if self.prefix_sharing.places_units:  # one group's rows in one call, at most per_call of them
            units_per_rank = [self.prefix_sharing.rank_units(kept, batch.row_tokens)
                              for kept in batch.kept_rows_per_rank]
            plans = plan_calls_per_rank([u[1] for u in units_per_rank], batch.widths_per_rank, per_call,
                                        self._packed_budget, items_per_call=1, fit_longest=True)
            mine = self.prefix_sharing.rank_units(output_rows, batch.row_tokens)[0]
            return [rows[torch.tensor([p for u in g for p in mine[u]], dtype=torch.long)]
                    for g in plans[self.accelerator.process_index]]
        if self.args.packing:
            plans = plan_calls_per_rank(kept_lengths, batch.widths_per_rank, per_call, self._packed_budget)
            return [rows[torch.tensor(g, dtype=torch.long)] for g in plans[self.accelerator.process_index]]
        num_calls = max(1, max(-(-len(lengths) // per_call) for lengths in kept_lengths))
        mine = [g for g in torch.tensor_split(rows, num_calls) if g.numel()]
        return mine + [rows[:0]] * (num_calls - len(mine))

    def _logps_of(self, model, input_ids, attention_mask, logits_to_keep, batch_size):
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]

    def _packed_budget(self, padded_width: int) -> int:
        if self._one_sequence_per_row:  # a budget of one token: every sequence alone in its row
            return 1
        return self.args.max_packed_tokens or default_packed_tokens(
            self.args.per_device_train_batch_size, padded_width, varlen_attention=self._varlen_attention
        )

    @profiling_decorator
    def _packed_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux_loss=False
    ):
        """TRL's per-token log-probs (and entropies) of the completion tokens, computed padding-free in one forward
        call (``packed_inputs``: sequences back to back, ``position_ids`` restarting per sequence, pre-shifted
        labels; with prefix sharing the rows of one prompt as one segment under a 4-D mask; with a variable-length
        kernel ``cu_seq_lens``), allocating no more than TRL's padded call of ``per_device_train_batch_size``
        rows, and unpacked into TRL's padded ``(B, T)`` layout."""
        segments, lengths = self.prefix_sharing.call_segments(input_ids, attention_mask, logits_to_keep)
        call_budget = self.args.per_device_train_batch_size * input_ids.size(1)
        budget = self._packed_budget(input_ids.size(1))
        rows = pack_call(lengths, budget, call_budget, fit_longest=self.prefix_sharing.enabled)
        rows = [[segments[i] for i in row] for row in rows]
        packed = packed_inputs(input_ids, attention_mask, logits_to_keep, rows, self._tokenizer.pad_token_id)
        r, c, b, j = packed.pop("index")
        layout = packed.pop("layout")
        if any(len(segment) > 1 for segment in segments):  # each completion sees its prompt and its own tokens
            packed["attention_mask"] = self.prefix_sharing.mask(layout, self.accelerator.unwrap_model(model).dtype)
        elif self._one_sequence_per_row:  # TRL's padding mask: no layer (nor the MoE router loss) reads the pad tail
            packed["attention_mask"] = (layout[0] == 0).long()
        elif self._varlen_attention:  # flash finds boundaries from position_ids only in a batch of one row
            packed.update(varlen_kwargs(packed["position_ids"]))
        if compute_aux_loss:  # MoE: the router loss over the packed tokens
            packed["output_router_logits"] = True
        with self.accelerator.autocast():
            out = model(**packed, fused_lm_head=True)
        dtype = torch.promote_types(out.log_probs.dtype, torch.float32)
        logps = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device, dtype=dtype)
        logps[b, j] = out.log_probs[r, c - 1].to(dtype)
        entropies = None
        if compute_entropy:
            entropies = torch.zeros_like(logps)
            entropies[b, j] = out.entropy[r, c - 1].to(dtype)
        return logps, entropies, out.aux_loss if compute_aux_loss else None

    @profiling_decorator
    def _kept_microbatches(self, rows: dict, batch: GenerationBatch, iteration: int = 0) -> list[dict]:
        """Split this rank's kept rows (in TRL's shuffled order) into ``steps_per_generation`` micro-batches
        (``microbatch_plan``: by tokens with packing, at most ``per_device_train_batch_size`` rows each where the
        rows allow, or evenly by rows; a fair share of every rank's rows in each optimizer step; or TRL's own
        split, ``_microbatches_follow_trl_split``), with the same row count on every rank in each micro-step; a
        slot with no kept row fills up with zero-weight filler rows of one token. Under the entropy filter with
        completion pruning, each micro-batch of which some rank kept a row also carries the tokens of the rows of
        TRL's micro-batch that were not kept (``UNKEPT_ROWS_KEY``): the filter's quantile is taken over them too,
        as TRL takes it. ``iteration``: which of ``num_iterations`` (its own seed of the plan's order)."""
        rows = dict(rows)
        keep, trl_microbatch = rows.pop("dppo_keep"), rows.pop("dppo_trl_microbatch")
        rows.pop("dppo_origin_rank")
        row_index = rows.pop("dppo_row").tolist()
        kept = keep.nonzero().flatten()
        lengths = (rows["prompt_mask"].sum(1) + rows["completion_mask"].sum(1)).tolist()
        kept_anywhere = None  # under the filter: per micro-batch, whether any rank kept a row of it
        if self._microbatches_follow_trl_split:
            bins, sizes = self._trl_split_bins(trl_microbatch, kept)
            kept_anywhere, sizes = [size > 0 for size in sizes], [max(size, 1) for size in sizes]
        elif self.prefix_sharing.places_units:
            bins, sizes = self._unit_bins(kept.tolist(), [row_index[i] for i in kept.tolist()], batch, iteration)
        else:
            generator = torch.Generator().manual_seed(self.view.seed("microbatch_plan", iteration))
            positions, sizes = microbatch_plan(
                [lengths[i] for i in kept.tolist()],
                batch.kept_lengths_per_rank,
                self.args.steps_per_generation,
                self.args.per_device_train_batch_size,
                self.args.packing,
                generator,
            )
            bins = [kept[p].tolist() for p in positions]
        filler = filler_row(rows)
        microbatches = [
            with_fillers(select_rows(rows, torch.tensor(members, dtype=torch.long)), filler, size)
            for members, size in zip(bins, sizes)
        ]
        if kept_anywhere is not None and self.args.completion_pruning:
            for j, microbatch in enumerate(microbatches):
                if kept_anywhere[j]:  # else only fillers train: the filter acts on nothing (the same on every rank)
                    microbatch[UNKEPT_ROWS_KEY] = unkept_rows_of_microbatch(rows, keep, trl_microbatch, j)
        self._log_microbatch_metrics(rows, lengths, bins, sizes, row_index, batch)
        return microbatches

    def _unit_bins(self, kept: list[int], kept_rows: list[int], batch: GenerationBatch, iteration: int = 0):
        """``(bins, sizes)`` with prefix sharing: ``microbatch_plan`` over units (``PrefixSharing.rank_units``: one
        group's kept rows on this rank, one segment), so a group's rows train in one micro-batch and forward their
        prompt once. ``kept``: positions of this rank's kept rows; ``kept_rows``: their indices in the generation batch."""
        units, unit_lengths, unit_rows = self.prefix_sharing.rank_units(kept_rows, batch.row_tokens)
        every_rank = [self.prefix_sharing.rank_units(rows, batch.row_tokens) for rows in batch.kept_rows_per_rank]
        generator = torch.Generator().manual_seed(self.view.seed("microbatch_plan", iteration))
        positions, sizes = microbatch_plan(
            unit_lengths,
            [u[1] for u in every_rank],
            self.args.steps_per_generation,
            self.args.per_device_train_batch_size,
            True,
            generator,
            own_unit_rows=unit_rows,
            unit_rows_per_rank=[u[2] for u in every_rank],
        )
        return [[kept[p] for u in bin_units for p in units[u]] for bin_units in positions], sizes

    def _trl_split_bins(self, trl_microbatch, kept) -> tuple[list[list[int]], list[int]]:
        """``(bins, sizes)``: bin ``j`` the kept rows of TRL's micro-batch ``j``; ``sizes[j]`` the most any rank has
        there (0 when no rank kept a row of it)."""
        steps = self.args.steps_per_generation
        of_kept = trl_microbatch[kept].cpu()
        bins = [kept[of_kept == j].tolist() for j in range(steps)]
        counts = torch.tensor([len(members) for members in bins], device=self.accelerator.device)
        sizes = self.accelerator.gather(counts).view(-1, steps).amax(0).tolist()
        return bins, sizes

    def _log_microbatch_metrics(self, rows, lengths, bins, sizes, row_index, batch) -> None:
        """``dppo/token_density`` (real / allocated tokens), ``dppo/microbatch_imbalance`` and
        ``dppo/prefix_tokens_saved`` (the share of the kept rows' token positions that prefix sharing removed), over
        all ranks."""
        width = rows["prompt_ids"].size(1) + rows["completion_ids"].size(1)
        budget, call_budget = self._packed_budget(width), self.args.per_device_train_batch_size * width
        row_tokens = float(sum(lengths[i] for members in bins for i in members))
        tokens_per_mb, allocated = [], 0.0
        for members, size in zip(bins, sizes):
            fillers = [1] * (size - len(members))  # a filler row forwards one token
            member_lengths = [lengths[i] for i in members]
            if self.prefix_sharing.places_units:
                member_lengths = self.prefix_sharing.rank_units([row_index[i] for i in members], batch.row_tokens)[1]
            tokens_per_mb.append(float(sum(member_lengths)))
            if self.args.packing:
                shared = self.prefix_sharing.places_units
                allocated += packed_allocation(member_lengths + fillers, budget, call_budget, shared)
            else:
                allocated += size * width
        stats = torch.tensor([sum(tokens_per_mb), allocated, max(tokens_per_mb), sum(tokens_per_mb) / len(bins),
                              row_tokens])
        stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum").cpu()
        metrics = self._metrics["train"]
        metrics["dppo/token_density"].append(float(stats[0] / stats[1]) if stats[1] > 0 else 0.0)
        metrics["dppo/microbatch_imbalance"].append(float(stats[2] / stats[3]) if stats[3] > 0 else 1.0)
        metrics["dppo/prefix_tokens_saved"].append(float(1 - stats[0] / stats[4]) if stats[4] > 0 else 0.0)
