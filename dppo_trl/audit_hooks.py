"""The online gradient audit's hooks of ``DPPOTrainer`` (``audit_every > 0``): on an audited generation batch,
before its first optimizer step, GRPO's gradient of the whole batch (every row, TRL's own loss, log-prob passes
and micro-batches) and DPPO's (its kept, weighted micro-batches), both sketched, compared and fed to the running
bias statistic. Training is untouched: gradients come from ``torch.autograd.grad`` (no ``.grad``), the RNG, the
logged metrics and the loss state are restored. The math is in ``dppo_trl.audit``."""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from .audit import (
    RunningMoments,
    audited_batch,
    bias_z,
    compare_gradients,
    make_sketch,
    measured_error_scale,
    sketch_gradients,
)
from .batch import loss_mask
from .pruning import vllm_importance_sampling_ratio

# Trainer state that a loss pass may change (TRL's adaptive entropy controller, DPPO's entropy mask).
_LOSS_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats", "_last_entropy_mask")


class GradientAuditHooks:
    """Mixed into ``DPPOTrainer``; does nothing while ``audit_every == 0``."""

    _in_grpo_reference = False  # True while the audit runs GRPO's own passes (TRL's padded path)
    _audit_reference: dict | None = None  # the audited batch's rows as GRPO has them, until the audit runs
    _audit_sketch = None
    _audit_moments = RunningMoments()

    def _audit_records(self) -> dict:
        """Per-run audit results: cosines, measured-to-model error ratios, bias z values (for the summary line and
        the measured adaptive keep rate)."""
        if "_audit_log" not in self.__dict__:
            self._audit_log = {"cosine": [], "ratio": [], "bias_z": []}
        return self._audit_log

    def _audit_this_batch(self) -> bool:
        generate_every = self.args.steps_per_generation * self.num_iterations
        return audited_batch(self._training_position() // generate_every, self.args.audit_every, self.args.seed)

    def _measured_error_scale(self) -> float:
        """How much the measured pruning error exceeded the model-based one on the audits so far (1.0 before any,
        or with ``adaptive_keep_error_source='model'``): earlier batches only."""
        if self.args.adaptive_keep_error_source != "audit":
            return 1.0
        return measured_error_scale(self._audit_records()["ratio"])

    @contextlib.contextmanager
    def _grpo_reference(self):
        self._in_grpo_reference = True
        try:
            yield
        finally:
            self._in_grpo_reference = False

    @torch.no_grad()
    def _build_grpo_reference(self, rows: dict, calls: list) -> None:
        """GRPO's version of this rank's rows of the generation batch (before any rank exchange): the deferred
        old-policy and reference passes on every row, through TRL's own forward in TRL's chunks of
        ``per_device_train_batch_size``, and the vLLM IS ratio rebuilt from them. Kept as ``_audit_reference``."""
        rows = {k: v for k, v in rows.items() if k not in ("dppo_keep", "dppo_weight")}
        input_ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
        attention_mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
        logits_to_keep, size = rows["completion_ids"].size(1), self.args.per_device_train_batch_size
        with torch.random.fork_rng(devices=self._audit_rng_devices()), self._grpo_reference():
            for name, model in zip(self._deferred_pass_names(calls), calls):
                model, adapter = self._deferred_pass_model(name, model)
                with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), adapter:
                    rows[name] = self._logps_of(model, input_ids, attention_mask, logits_to_keep, size)
        if "importance_sampling_ratio" in rows:
            rows["importance_sampling_ratio"] = vllm_importance_sampling_ratio(
                rows["old_per_token_logps"], rows["sampling_per_token_logps"], loss_mask(rows),
                self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max,
            ).to(rows["importance_sampling_ratio"].dtype)  # fmt: skip
        self._audit_reference = rows

    def _audit_generation_batch(self, shuffle_rng_state: torch.Tensor) -> None:
        """Compare GRPO's and DPPO's gradients of the batch just prepared, at the current parameters. GRPO's
        micro-batches are TRL's: its shuffle (from the RNG state it drew from, ``shuffle_rng_state``) and split."""
        reference, self._audit_reference = self._audit_reference, None
        if reference is None:
            return
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(shuffle_rng_state)
            reference = shuffle_sequence_dict(reference)
        grpo_batches = split_tensor_dict(reference, self.args.steps_per_generation)
        grpo, dppo = self._audited_gradients(grpo_batches, self._buffered_inputs)
        self._record_audit(dppo, grpo, time.perf_counter() - start)

    def _audited_gradients(self, grpo_batches: list[dict], dppo_batches: list[dict]) -> tuple:
        """The sketched sums, over each list of micro-batches, of the gradient of what ``training_step`` back-
        propagates (TRL's ``compute_loss``, which scales for accumulation itself), reduced over ranks as DDP
        reduces the gradient (a mean); RNG, logged metrics and loss state as they were before."""
        model = self.accelerator.unwrap_model(self.model)
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if self._audit_sketch is None:
            self._audit_sketch = make_sketch(sum(p.numel() for _, p in params), self.args.audit_sketch_dim,
                                             self.args.audit_exact_params, self.args.seed)  # fmt: skip
        saved_metrics = {key: list(values) for key, values in self._metrics["train"].items()}
        saved_state = {name: getattr(self, name) for name in _LOSS_STATE if hasattr(self, name)}
        try:
            with torch.random.fork_rng(devices=self._audit_rng_devices()):
                with self._grpo_reference():
                    grpo = self._sketched_gradient(model, params, grpo_batches)
                dppo = self._sketched_gradient(model, params, dppo_batches)
        finally:
            self._metrics["train"].clear()
            self._metrics["train"].update(saved_metrics)
            for name, value in saved_state.items():
                setattr(self, name, value)
        both = self.accelerator.reduce(torch.stack([grpo, dppo]), reduction="mean")
        return both[0].cpu(), both[1].cpu()

    def _sketched_gradient(self, model, params, batches) -> torch.Tensor:
        total = None
        for batch in batches:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, batch)
            grads = self._gradients_of(loss, [p for _, p in params])
            sketch = sketch_gradients(self._audit_sketch, [(n, g, p.numel()) for (n, p), g in zip(params, grads)])
            total = sketch if total is None else total + sketch
        return total

    def _gradients_of(self, loss, params: list) -> list:
        """``d loss / d params`` with every ``.grad`` left as it was: ``torch.autograd.grad``; under reentrant
        gradient checkpointing, which refuses it, a backward into emptied ``.grad`` slots that are then put back."""
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

    def _record_audit(self, dppo: torch.Tensor, grpo: torch.Tensor, seconds: float) -> None:
        """Log this audit (``dppo/audit_*``) and update the run's bias statistic."""
        records, metrics = self._audit_records(), self._metrics["train"]
        self._audit_moments = self._audit_moments.update(dppo - grpo)
        comparison = compare_gradients(dppo, grpo)
        if comparison is not None:
            metrics["dppo/audit_cosine"].append(comparison["cosine"])
            metrics["dppo/audit_rel_error"].append(comparison["rel_error"])
            records["cosine"].append(comparison["cosine"])
            model_error = None if self._prune_summary is None else self._prune_summary[1]
            if model_error:
                ratio = comparison["rel_error"] / model_error
                metrics["dppo/audit_noise_to_signal"].append(ratio)
                records["ratio"].append(ratio)
        z = bias_z(self._audit_moments)
        if z is not None:
            metrics["dppo/audit_bias_z"].append(z)
            records["bias_z"].append(z)
        metrics["dppo/audit_seconds"].append(seconds)

    def _audit_summary(self) -> str | None:
        """``audits N, median cosine C, worst bias z Z`` for the summary line; None without audits."""
        records = self._audit_records()
        if self._audit_moments.count == 0:  # counts an audit whose GRPO gradient was 0 too (no cosine then)
            return None
        cosine = f"{statistics.median(records['cosine']):.3f}" if records["cosine"] else "n/a"
        worst = f"{max(records['bias_z']):.2f}" if records["bias_z"] else "n/a"
        return f"audits {self._audit_moments.count}, median cosine {cosine}, worst bias z {worst}"

    _AUDIT_STATE_FILE = "dppo_audit.pt"

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.audit_every and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            moments = self._audit_moments
            torch.save({"records": self._audit_records(), "count": moments.count, "mean": moments.mean,
                        "m2": moments.m2}, os.path.join(folder, self._AUDIT_STATE_FILE))  # fmt: skip

    def _load_optimizer_and_scheduler(self, checkpoint):
        """A resumed run goes on with the audit history (the bias statistic, the measured/model ratios that
        ``adaptive_keep_error_source='audit'`` reads) where the checkpoint left it."""
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, self._AUDIT_STATE_FILE) if checkpoint else None
        if self.args.audit_every and path and os.path.exists(path):
            state = torch.load(path, weights_only=True)
            self._audit_log = state["records"]
            self._audit_moments = RunningMoments(state["count"], state["mean"], state["m2"])

    def _audit_rng_devices(self) -> list:
        return [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
