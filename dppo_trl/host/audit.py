"""The online gradient audit's hooks of ``DPPOTrainer`` (``audit_every > 0``): on an audited generation batch,
before its first optimizer step, GRPO's gradient of the whole batch (every row, TRL's own loss, log-prob passes
and micro-batches) and DPPO's (its kept, weighted micro-batches), both sketched, compared and fed to the running
bias statistic; and the speed check (``speed_check``): the same passes on one early batch, only timed, for what
the run saved (``_speed_metrics``, ``_speed_summary``). Both gradient passes run with dropout off
(``audit.dropout_disabled``), so with every row kept they differ by float rounding only; the log-prob passes GRPO
needs reuse DPPO's values on the rows DPPO kept.
Training is untouched: the RNG is forked and restored, ``.grad`` is left as it was (``torch.autograd.grad``, or
under reentrant checkpointing a backward into emptied ``.grad`` slots that are put back), and the dropout
settings, logged metrics and loss state are restored. The math is in ``dppo_trl.core.audit``.

Reads of the host trainer: ``args``, ``accelerator``, ``model``, ``beta``, ``_entropy_bonus_enabled``, ``_metrics``,
``compute_loss``, ``compute_loss_context_manager``, TRL's vLLM IS settings; ``view`` (``host.view``),
``keep_decision``, ``_deferred_pass_names``, ``_deferred_pass_model``, ``_logps_of`` (the
placement)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import types

import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from ..core.audit import (
    BIAS_ALARM_MIN_AUDITS,
    BIAS_ALARM_T,
    PhaseSeconds,
    audited_batch,
    bias_alarm,
    bias_t,
    compare_gradients,
    dropout_disabled,
    has_dropout,
    make_sketch,
    measured_error_scale,
    projected_time_ratios,
    representative_timing,
    run_speed_metrics,
    sketch_gradients,
    speed_check_batch,
    synchronized_clock,
)
from ..core.batch import loss_mask
from ..core.trl_formulas import vllm_importance_sampling_ratio
from ..components.generation_batch import AuditReference, GenerationBatch
from ..components.view import local_rows
from .summary import logged_mean

logger = logging.getLogger(__name__)

# Trainer state that a loss pass may change (TRL's adaptive entropy controller).
_LOSS_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")

# What an audited batch is, decided when it is generated (the same on every rank: from the gathered scores).
_NO_SIGNAL = "no signal"  # every score exactly 0 and no term without A: both gradients are float residue
_EXACT = "exact"  # every row that counts kept at weight 1: DPPO's estimate is GRPO's gradient in exact arithmetic
_PRUNED = "pruned"

# What an audited batch's audit is, decided before it is generated (the same on every rank).
COUNTED = "counted"  # an `audit_every` batch: compared, counted in the bias statistic, timed
TIMED = "timed"  # the speed check's batch (`speed_check`): only timed


class GradientAudit:
    """Mixed into ``DPPOTrainer``. The audit does nothing while ``audit_every == 0``; the speed check
    (``speed_check``) times GRPO's and DPPO's passes on one batch, as the audit times them, without comparing."""

    _in_grpo_reference = False  # True while the audit runs GRPO's own passes (TRL's padded path)
    _audit_sketch = None

    def _audit_records(self) -> dict:
        """Per-run audit results: audits run, batches without signal, cosines, measured-to-model error ratios, the
        projections that enter the bias statistic, its t after each, the counted audit at which it first alarmed,
        the measured time ratios (for the summary line, the measured adaptive keep rate and checkpoints)."""
        if "_audit_log" not in self.__dict__:
            self._audit_log = {"audits": 0, "no_signal": 0, "cosine": [], "ratio": [], "projection": [],
                               "bias_t": [], "alarm_at": None,
                               "train_time_ratio": [], "step_time_ratio": [], "generation_share": [],
                               "timed_token_fraction": [], "measuring_seconds": 0.0, "speed_check_at": None}
        return self._audit_log

    def _audit_this_batch(self) -> str | None:
        """This generation batch's audit: ``COUNTED`` (an ``audit_every`` batch), ``TIMED`` (the speed check's) or
        None. A function of the training position and of what was timed so far, so the same on every rank."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        index = self.view.training_position() // generate_every
        if audited_batch(index, self.args.audit_every, self.args.seed):
            return COUNTED
        if self._speed_check_refusal() is None and self._audit_records()["speed_check_at"] is None:
            batches = -(-self.state.max_steps * self.args.gradient_accumulation_steps // generate_every)
            return TIMED if index >= speed_check_batch(batches) else None
        return None

    def _speed_check_refusal(self) -> str | None:
        """Why the speed check does not run on this trainer (None: it runs)."""
        if not self.args.speed_check:
            return "speed_check=False"
        if not self.args.dppo_training_path:
            return "nothing is pruned or packed (GRPO's own path)"
        if self.args.prompt_pruning:
            return "prompt pruning generates only the accepted groups, GRPO's batch is not there to time"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "not under DeepSpeed or FSDP yet"
        return None

    def _measured_error_scale(self) -> float:
        """How much the measured pruning error exceeded the model-based one on the audits so far (1.0 before any,
        or with ``adaptive_keep_error_source='model'``): earlier batches only."""
        if self.args.adaptive_keep_error_source != "audit":
            return 1.0
        return measured_error_scale(self._audit_records()["ratio"])

    @contextlib.contextmanager
    def _audit_timer(self, audited: bool):
        """Times the block into the yielded ``.seconds`` on an audited batch, with a GPU sync on each side; on any
        other batch it syncs nothing and ``.seconds`` stays 0 (training's hot path pays nothing)."""
        timer = types.SimpleNamespace(seconds=0.0)
        if not audited:
            yield timer
            return
        start = synchronized_clock()
        yield timer
        timer.seconds = synchronized_clock() - start

    @contextlib.contextmanager
    def _grpo_reference(self):
        self._in_grpo_reference = True
        try:
            yield
        finally:
            self._in_grpo_reference = False

    def _audit_batch_kind(self, rows: dict, batch: GenerationBatch) -> str:
        """``_NO_SIGNAL`` when every row's pruning score is exactly 0 (the trainer's ``_global_scores``: zero-spread
        groups score 0 whatever TRL's float32 A, e.g. 6e-4 for equal rewards of 0.7) and no per-row term without
        A is on (``beta == 0``, no entropy bonus); ``_EXACT`` when every row that counts (score != 0, or every row
        with a loss token when such a term is on or the entropy filter's quantile takes every row's tokens) is kept
        at weight 1 on every rank; else ``_PRUNED``: compared and counted in the bias statistic."""
        scores = self.keep_decision.scores(rows["advantages"], batch)
        without_a = self.beta != 0.0 or bool(getattr(self, "_entropy_bonus_enabled", False))
        if not without_a and bool((scores == 0).all()):
            return _NO_SIGNAL
        local = scores[local_rows(self.view, rows["advantages"].size(0))].to(rows["dppo_keep"].device)
        every_row_counts = without_a or self.top_entropy_quantile < 1.0
        counts = loss_mask(rows).sum(1) > 0 if every_row_counts else local != 0
        missed = counts & ~(rows["dppo_keep"] & (rows["dppo_weight"] == 1))
        missed = self.accelerator.reduce(missed.sum().reshape(1).to(self.accelerator.device), reduction="sum")
        return _EXACT if int(missed) == 0 else _PRUNED

    @torch.no_grad()
    def _build_grpo_reference(self, rows: dict, batch: GenerationBatch, output: dict | None = None,
                              plan: str = COUNTED) -> AuditReference:
        """GRPO's version of this rank's rows of the generation batch (before any rank exchange), kept as
        an ``AuditReference``: the deferred old-policy and reference passes, through TRL's own forward in TRL's
        chunks of ``per_device_train_batch_size``, and the vLLM IS ratio rebuilt from them. A row DPPO kept on
        this rank takes DPPO's log-probs where the model has dropout (one dropout draw, so with every row kept the
        two gradients agree to float rounding; without dropout every row is forwarded, TRL's values exactly);
        the others are forwarded (on one process only those; with several, every row, so that
        every rank makes the same forward calls). DPPO's values are read from ``output`` (the batch after the
        rank exchange and DPPO's passes, where a kept row that stayed keeps its index) or, without it, from
        ``rows`` itself, whose tensors DPPO's passes fill in place unless rows moved between ranks (then they
        still hold TRL's zero placeholders, and every row is forwarded). A ``COUNTED`` batch without signal is
        not built (nothing to compare); the speed check's (``TIMED``) always is."""
        start = time.perf_counter()
        kind = self._audit_batch_kind(rows, batch)
        counted = plan == COUNTED
        if kind == _NO_SIGNAL and counted:
            return AuditReference({}, kind, time.perf_counter() - start)
        local_rows = rows["advantages"].size(0)
        calls = batch.deferred_calls
        names = self._deferred_pass_names(calls)
        dppo_rows = rows if output is None else output
        kept = dppo_rows["dppo_keep"][:local_rows]
        if output is None and bool(kept.any()) and not all(bool((rows[n][kept] != 0).any()) for n in names):
            kept = torch.zeros_like(kept)  # rows moved: DPPO's values are not in these tensors
        if not has_dropout(self.model):  # no draw to share: TRL's own padded passes, GRPO's values bit for bit
            kept = torch.zeros_like(kept)
        rows = {k: v for k, v in rows.items() if k not in ("dppo_keep", "dppo_weight")}
        one_process = self.accelerator.num_processes == 1
        forward = (~kept).nonzero().flatten() if one_process else torch.arange(local_rows, device=kept.device)
        input_ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)[forward]
        attention_mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)[forward]
        logits_to_keep, size = rows["completion_ids"].size(1), self.args.per_device_train_batch_size
        forward_start = synchronized_clock()
        with torch.random.fork_rng(devices=self._audit_rng_devices()), self._grpo_reference():
            for name, model in zip(names, calls):
                values = dppo_rows[name][:local_rows].clone()
                if forward.numel():
                    model, adapter = self._deferred_pass_model(name, model)
                    with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), adapter:
                        logps = self._logps_of(model, input_ids, attention_mask, logits_to_keep, size).to(values.dtype)
                    values[forward] = torch.where(kept[forward, None], values[forward], logps)
                rows[name] = values
        forward_seconds = synchronized_clock() - forward_start
        # GRPO forwards every row: the rows forwarded here, scaled to all (DPPO's time where none was forwarded).
        grpo_logps = forward_seconds * local_rows / forward.numel() if forward.numel() else batch.logps_seconds
        if "importance_sampling_ratio" in rows:
            rows["importance_sampling_ratio"] = vllm_importance_sampling_ratio(
                rows["old_per_token_logps"], rows["sampling_per_token_logps"], loss_mask(rows),
                self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max,
            ).to(rows["importance_sampling_ratio"].dtype)
        return AuditReference(rows, kind, time.perf_counter() - start, grpo_logps if names else 0.0, counted)

    def _audit_generation_batch(self, batch: GenerationBatch, dppo_microbatches: list[dict]) -> None:
        """Compare GRPO's and DPPO's gradients of the batch just prepared (``batch.audit``, DPPO's
        ``dppo_microbatches``), at the current parameters. GRPO's micro-batches are TRL's: its shuffle (from the RNG
        state it drew from, ``batch.trl_split_rng_state``) and split. A batch without signal is counted and not
        compared (no gradient pass; only its seconds are logged). The speed check's batch (not ``counted``) is
        only timed."""
        audit = batch.audit
        records = self._audit_records()
        if audit.counted:
            records["audits"] += 1
            records["no_signal"] += audit.kind == _NO_SIGNAL
        if not audit.rows:  # a counted batch without signal; its cost: telling it apart
            self._metrics["train"]["dppo/audit_seconds"].append(audit.seconds)
            records["measuring_seconds"] += audit.seconds
            return
        start = time.perf_counter() - audit.seconds  # the reference's log-prob passes count too
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(batch.trl_split_rng_state)
            reference = shuffle_sequence_dict(audit.rows)
        grpo_batches = split_tensor_dict(reference, self.args.steps_per_generation)
        (grpo, dppo), (grpo_seconds, dppo_seconds) = self._audited_gradients(grpo_batches, dppo_microbatches)
        seconds = time.perf_counter() - start
        records["measuring_seconds"] += seconds
        if audit.counted:
            self._record_audit(dppo, grpo, seconds, batch)
        else:
            self._metrics["train"]["dppo/audit_seconds"].append(seconds)
        if records["speed_check_at"] is None:
            records["speed_check_at"] = self.state.global_step
        generation = batch.generation_seconds
        self._record_audit_times(PhaseSeconds(generation, audit.grpo_logps_seconds, grpo_seconds),
                                 PhaseSeconds(generation, batch.logps_seconds, dppo_seconds),
                                 batch.iteration(0).kept_token_fraction)

    def _audited_gradients(self, grpo_batches: list[dict], dppo_batches: list[dict]) -> tuple:
        """``((grpo, dppo), (grpo seconds, dppo seconds))``: the sketched sums, over each list of micro-batches, of
        the gradient of what ``training_step`` backpropagates (TRL's ``compute_loss``, which scales for
        accumulation itself), reduced over ranks as DDP reduces the gradient (a mean), and the seconds of this
        rank's forward and backward passes; both with dropout off (``model.training`` stays True); RNG, dropout
        settings, logged metrics and loss state as they were before."""
        model = self.accelerator.unwrap_model(self.model)
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if self._audit_sketch is None:
            self._audit_sketch = make_sketch(sum(p.numel() for _, p in params), self.args.audit_sketch_dim,
                                             self.args.audit_exact_params, self.args.seed)
        saved_metrics = {key: list(values) for key, values in self._metrics["train"].items()}
        saved_state = {name: getattr(self, name) for name in _LOSS_STATE if hasattr(self, name)}
        try:
            with torch.random.fork_rng(devices=self._audit_rng_devices()), dropout_disabled(self.model):
                with self._grpo_reference():
                    grpo, grpo_seconds = self._sketched_gradient(model, params, grpo_batches)
                dppo, dppo_seconds = self._sketched_gradient(model, params, dppo_batches)
        finally:
            self._metrics["train"].clear()
            self._metrics["train"].update(saved_metrics)
            for name, value in saved_state.items():
                setattr(self, name, value)
        seconds = (grpo_seconds, dppo_seconds)
        if self.accelerator.num_processes == 1:
            return (grpo, dppo), seconds
        both = self.accelerator.reduce(torch.stack([grpo, dppo]).to(self.accelerator.device), reduction="mean")
        return (both[0].cpu(), both[1].cpu()), seconds

    def _sketched_gradient(self, model, params, batches) -> tuple[torch.Tensor, float]:
        """The sketched sum of the micro-batches' gradients, and the seconds of their forward and backward passes
        (the sketching left out)."""
        total = torch.zeros(self._audit_sketch.dim, dtype=torch.float64)  # on the CPU
        seconds = 0.0
        for batch in batches:
            start = synchronized_clock()
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, batch)
            grads = self._gradients_of(loss, [p for _, p in params])
            seconds += synchronized_clock() - start
            sketch_gradients(self._audit_sketch, [(n, g, p.numel()) for (n, p), g in zip(params, grads)], out=total)
            del grads, loss
        return total, seconds

    def _gradients_of(self, loss, params: list) -> list:
        """``d loss / d params``, every ``.grad`` as it was after: ``torch.autograd.grad``; under reentrant
        gradient checkpointing, which refuses it, a backward into emptied ``.grad`` slots, whose gradients are
        taken out before the saved ``.grad`` tensors are put back."""
        kwargs = self.args.gradient_checkpointing_kwargs or {}
        if not (self.args.gradient_checkpointing and kwargs.get("use_reentrant")):
            return torch.autograd.grad(loss, params, allow_unused=True)
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss.backward()
            return [p.grad for p in params]
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad

    def _record_audit(self, dppo: torch.Tensor, grpo: torch.Tensor, seconds: float, batch: GenerationBatch) -> None:
        """Log this audit (``dppo/audit_*``) and update the run's bias statistic: the projection enters it unless
        DPPO's estimate of this batch is GRPO's gradient in exact arithmetic (``_EXACT``: its projection is
        float rounding, which has no mean-zero guarantee)."""
        records, metrics = self._audit_records(), self._metrics["train"]
        comparison = compare_gradients(dppo, grpo)
        if comparison is not None:
            metrics["dppo/audit_cosine"].append(comparison["cosine"])
            metrics["dppo/audit_rel_error"].append(comparison["rel_error"])
            metrics["dppo/audit_projection"].append(comparison["projection"])
            records["cosine"].append(comparison["cosine"])
            model_error = None if batch.prune_summary is None else batch.prune_summary[1]
            if model_error:
                ratio = comparison["rel_error"] / model_error
                metrics["dppo/audit_noise_to_signal"].append(ratio)
                records["ratio"].append(ratio)
            if batch.audit.kind == _PRUNED:
                self._add_to_bias_statistic(comparison["projection"])
        metrics["dppo/audit_seconds"].append(seconds)

    def _record_audit_times(self, grpo: PhaseSeconds, dppo: PhaseSeconds, kept_token_fraction: float) -> None:
        """Log what pruning saves on this machine, from the audited batch's phases at the same parameters:
        ``dppo/audit_train_time_ratio`` (log-prob and gradient passes), ``dppo/audit_step_time_ratio`` (with
        generation, projected) and ``dppo/audit_generation_share`` (generation's share of GRPO's step); and the
        share of completion tokens the timed iteration kept (whether the timing stands for the run)."""
        ratios = projected_time_ratios(grpo, dppo, self.num_iterations)
        if ratios is None:
            return
        records, metrics = self._audit_records(), self._metrics["train"]
        for name, value in ratios.items():
            metrics[f"dppo/audit_{name}"].append(value)
            records[name].append(value)
        records["timed_token_fraction"].append(kept_token_fraction)

    def _add_to_bias_statistic(self, projection: float) -> None:
        records, metrics = self._audit_records(), self._metrics["train"]
        records["projection"].append(projection)
        t = bias_t(records["projection"])
        if t is None:
            return
        records["bias_t"].append(t)
        metrics["dppo/audit_bias_t"].append(t)
        if records["alarm_at"] is None and bias_alarm(records["projection"]):
            records["alarm_at"] = len(records["projection"])
            logger.warning(
                "DPPO gradient audit: bias alarm. After %d counted audits DPPO's gradient is %s GRPO's along GRPO's "
                "own direction by %.1f%% on average (bias t %.2f, alarm beyond +-%.0f): prune_sampling=%r does not "
                "estimate GRPO's gradient without bias on this run.", len(records["projection"]),
                "shorter than" if t < 0 else "longer than", 100 * statistics.fmean(records["projection"]), t,
                BIAS_ALARM_T, self.args.prune_sampling,
            )
        metrics["dppo/audit_bias_alarm"].append(float(records["alarm_at"] is not None))

    def _audit_summary(self) -> str | None:
        """``audits N, median cosine C, bias t T over K audits`` and the alarm for the summary line; None without
        audits."""
        records = self._audit_records()
        if records["audits"] == 0:
            return None
        cosine = f"{statistics.median(records['cosine']):.3f}" if records["cosine"] else "n/a"
        parts = [f"audits {records['audits']}", f"median cosine {cosine}"]
        if records["no_signal"]:
            parts.append(f"{records['no_signal']} without signal")
        t, counted = bias_t(records["projection"]), len(records["projection"])
        if t is not None:
            parts.append(f"bias t {t:.2f} over {counted} audits")
        if records["alarm_at"] is not None:
            parts.append(f"BIAS ALARM (|t| > {BIAS_ALARM_T:g} at audit {records['alarm_at']})")
        elif counted >= BIAS_ALARM_MIN_AUDITS:
            parts.append(f"no bias alarm (|t| <= {BIAS_ALARM_T:g})")
        return ", ".join(parts)

    def _speed_metrics(self, run_seconds: float) -> dict:
        """What the run saved, for the final log (``report_to``): the measured ratios (the median over the timed
        batches) and the projection over ``run_seconds``, what the speed check and audits took counted against the
        saving; empty before any batch was timed."""
        records = self._audit_records()
        return run_speed_metrics(records["train_time_ratio"], records["step_time_ratio"], records["generation_share"],
                                 run_seconds, records["measuring_seconds"])

    def _speed_summary(self, metrics: dict) -> str | None:
        """The summary line's part on what the run saved (``metrics``: ``_speed_metrics``'s), or why it was not
        measured (None on GRPO's path or with ``speed_check=False`` and no audit)."""
        if metrics:
            records = self._audit_records()
            timed = len(records["step_time_ratio"])
            step, train, share, grpo, saved, measuring = (metrics[f"dppo/speed_{name}"] for name in (
                "step_time_ratio", "train_time_ratio", "generation_share", "projected_grpo_seconds",
                "projected_seconds_saved", "measuring_seconds"))
            reuse = (f"; each generation batch trained num_iterations={self.num_iterations} times, every "
                     "iteration counted" if self.num_iterations > 1 else "")
            what = "the speed check and the audits" if records["audits"] else "the speed check"
            return (f"measured here: a step takes {step:.2f} of GRPO's time (training {train:.2f}, generation "
                    f"{share:.0%} of GRPO's step; {timed} batch{'es' if timed > 1 else ''} timed{reuse}), projected "
                    f"time saved {saved:.0f} s of GRPO's {grpo:.0f} s ({what} took {measuring:.0f} s of this run, "
                    f"counted against the saving){self._timing_caveat(records['timed_token_fraction'])}")
        if not self.args.speed_check or not self.args.dppo_training_path:
            return None
        return f"speed not measured: {self._speed_check_refusal() or 'the run ended before its timed batch'}"

    def _timing_caveat(self, timed_token_fractions: list[float]) -> str:
        """The summary line's warning when the timed batches kept far more or fewer completion tokens than the
        run's batches did on average ("" when they stand for the run)."""
        run = logged_mean(self.state.log_history, "dppo/kept_token_fraction") or 0.0
        if representative_timing(timed_token_fractions, run):
            return ""
        timed = statistics.median(timed_token_fractions)
        return (f"; NOT REPRESENTATIVE: the timed batch kept {timed:.0%} of its completion tokens, the run's batches "
                f"{run:.0%} on average, so the projection is not this run's")

    def _audit_state_dict(self) -> dict | None:
        """The audit history for a checkpoint: a resumed run goes on with the bias statistic and the measured/model
        ratios that ``adaptive_keep_error_source='audit'`` reads, and the speed check's timings (None while neither
        runs)."""
        saves = self.args.audit_every or self._speed_check_refusal() is None
        return {"records": self._audit_records()} if saves else None

    def _load_audit_state_dict(self, state: dict) -> None:
        records = self._audit_records()
        records.update({k: v for k, v in state["records"].items() if k in records})

    def _audit_rng_devices(self) -> list:
        return [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
