"""The online gradient audit's hooks of ``DPPOTrainer`` (``audit_every > 0``): on an audited generation batch,
before its first optimizer step, GRPO's gradient of the whole batch (every row, TRL's own loss, log-prob passes
and micro-batches) and DPPO's (its kept, weighted micro-batches), both sketched, compared and fed to the running
bias statistic; and the speed check (``speed_check``): the same passes on one early batch, only timed, for what
the run saved (``components.audit.AuditLedger``, which keeps what both found). Both gradient passes run with dropout off
(``audit.dropout_disabled``), so with every row kept they differ by float rounding only; the log-prob passes GRPO
needs reuse DPPO's values on the rows DPPO kept.
Training is untouched: the RNG is forked and restored, ``.grad`` is left as it was (``torch.autograd.grad``, or
under reentrant checkpointing a backward into emptied ``.grad`` slots that are put back), and the dropout
settings, logged metrics and loss state are restored. The math is in ``dppo_trl.core.audit``.

Reads of the host trainer: ``args``, ``accelerator``, ``model``, ``beta``, ``_entropy_bonus_enabled``, ``_metrics``,
``compute_loss``, ``compute_loss_context_manager``, TRL's vLLM IS settings; ``view`` (``host.view``),
``keep_decision``, ``audit_ledger``, ``_deferred_pass_names``, ``_deferred_pass_model``, ``_logps_of``
(``host.passes``)."""

from __future__ import annotations

import contextlib
import time
import types

import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from ..components.audit import COUNTED, EXACT, NO_SIGNAL, PRUNED
from ..components.generation_batch import AuditReference, GenerationBatch
from ..components.view import local_rows
from ..core.audit import PhaseSeconds, dropout_disabled, has_dropout, make_sketch, sketch_gradients, synchronized_clock
from ..core.batch import loss_mask
from ..core.trl_formulas import vllm_importance_sampling_ratio
from .summary import logged_mean

# Trainer state that a loss pass may change (TRL's adaptive entropy controller).
_LOSS_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


class GradientAudit:
    """Mixed into ``DPPOTrainer``. The audit does nothing while ``audit_every == 0``; the speed check
    (``speed_check``) times GRPO's and DPPO's passes on one batch, as the audit times them, without comparing."""

    _in_grpo_reference = False  # True while the audit runs GRPO's own passes (TRL's padded path)
    _audit_sketch = None

    def _audit_this_batch(self) -> str | None:
        """This generation batch's audit: ``COUNTED`` (an ``audit_every`` batch), ``TIMED`` (the speed check's) or
        None. A function of the training position and of what was timed so far, so the same on every rank."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        batches = -(-self.state.max_steps * self.args.gradient_accumulation_steps // generate_every)
        return self.audit_ledger.plan(self.view.training_position() // generate_every, batches)

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
        return self.audit_ledger.measured_error_scale()

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
        """``NO_SIGNAL`` when every row's pruning score is exactly 0 (the trainer's ``_global_scores``: zero-spread
        groups score 0 whatever TRL's float32 A, e.g. 6e-4 for equal rewards of 0.7) and no per-row term without
        A is on (``beta == 0``, no entropy bonus); ``EXACT`` when every row that counts (score != 0, or every row
        with a loss token when such a term is on or the entropy filter's quantile takes every row's tokens) is kept
        at weight 1 on every rank; else ``PRUNED``: compared and counted in the bias statistic."""
        scores = self.keep_decision.scores(rows["advantages"], batch)
        without_a = self.beta != 0.0 or bool(getattr(self, "_entropy_bonus_enabled", False))
        if not without_a and bool((scores == 0).all()):
            return NO_SIGNAL
        local = scores[local_rows(self.view, rows["advantages"].size(0))].to(rows["dppo_keep"].device)
        every_row_counts = without_a or self.top_entropy_quantile < 1.0
        counts = loss_mask(rows).sum(1) > 0 if every_row_counts else local != 0
        missed = counts & ~(rows["dppo_keep"] & (rows["dppo_weight"] == 1))
        missed = self.accelerator.reduce(missed.sum().reshape(1).to(self.accelerator.device), reduction="sum")
        return EXACT if int(missed) == 0 else PRUNED

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
        if kind == NO_SIGNAL and counted:
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
        audit, ledger = batch.audit, self.audit_ledger
        if audit.counted:
            ledger.count(audit.kind)
        if not audit.rows:  # a counted batch without signal; its cost: telling it apart
            self.view.log_metric("dppo/audit_seconds", audit.seconds)
            ledger.spent(audit.seconds)
            return
        start = time.perf_counter() - audit.seconds  # the reference's log-prob passes count too
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(batch.trl_split_rng_state)
            reference = shuffle_sequence_dict(audit.rows)
        grpo_batches = split_tensor_dict(reference, self.args.steps_per_generation)
        (grpo, dppo), (grpo_seconds, dppo_seconds) = self._audited_gradients(grpo_batches, dppo_microbatches)
        seconds = time.perf_counter() - start
        ledger.spent(seconds, step=self.state.global_step)
        if audit.counted:
            self._record_audit(dppo, grpo, seconds, batch)
        else:
            self.view.log_metric("dppo/audit_seconds", seconds)
        generation = batch.generation_seconds
        ledger.record_times(PhaseSeconds(generation, audit.grpo_logps_seconds, grpo_seconds),
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
        """One counted audit into the ledger (``AuditLedger.record_comparison``) and its seconds into the log."""
        model_error = None if batch.prune_summary is None else batch.prune_summary[1]
        self.audit_ledger.record_comparison(dppo, grpo, batch.audit.kind, model_error)
        self.view.log_metric("dppo/audit_seconds", seconds)

    def _speed_summary(self, metrics: dict) -> str | None:
        """The summary line's part on what the run saved (``AuditLedger.speed_summary``), against the run's mean
        share of completion tokens kept."""
        run = logged_mean(self.state.log_history, "dppo/kept_token_fraction") or 0.0
        return self.audit_ledger.speed_summary(metrics, run)

    def _audit_rng_devices(self) -> list:
        return [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
