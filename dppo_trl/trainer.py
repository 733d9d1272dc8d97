"""``DPPOTrainer``: TRL's ``GRPOTrainer`` with unbiased completion pruning, Dense Prompt Packing and prompt pruning
wired into its hooks. This module builds DPPO's components (``dppo_trl.components``), composes the host's mixins
(``dppo_trl.host``) and holds every TRL
hook DPPO overrides; the math lives in ``dppo_trl.core``. One ``GenerationBatch`` per generation batch carries
DPPO's decisions from the hook that makes them to the passes that use them.

- ``_generate_and_score_completions``: TRL generates, scores and computes advantages on the FULL groups; the
  old-policy and reference log-prob passes it would run before scoring are only recorded, then run after the
  keep mask is drawn, on the kept rows alone (``components.keep_decision``, ``components.placement``, ``host.passes``).
- ``_prepare_inputs``: TRL's shuffle, then the kept rows (not TRL's equal split of all rows) make the
  ``steps_per_generation`` micro-batches, balanced by tokens when packing (TRL's own split under the entropy
  filter); each row carries its micro-batch of TRL's split, whose token count ``bnpo`` and the entropy bonus
  divide by, so no statistic is taken over a packing bin. With prefix sharing (``components.prefix_sharing``) a group's
  kept rows on a rank train together and forward their prompt once.
- ``_get_per_token_logps_and_entropies``: defers the passes during scoring; with packing, runs them padding-free
  and unpacks the result into TRL's padded ``(B, T)`` layout, so TRL's loss code runs unchanged.
- ``_compute_loss``: TRL's loss with each kept row's advantage scaled by its Horvitz-Thompson weight, rescaled to
  the full-batch normalizer; the KL term, the entropy bonus and the MoE router loss weighted the same way and
  added beside it; TRL's logged means become weighted ones (``components.weighted_loss``, ``host.loss``,
  ``components.weighted_metrics``).
- ``get_high_entropy_mask``: TRL's entropy filter over the kept rows and, forwarded without gradient, the rows of
  the same TRL micro-batch that were not kept: GRPO's quantile.
- ``_calculate_rewards``: keeps the rewards in the batch (rows whose A is 0 in exact arithmetic score 0).
- Prompt pruning (``components.prompt_cut``, ``host.prompt_probe``): the cut of each step's candidates before
  generation, the probe's completions spliced into the accepted groups (``_generate_single_turn``).
- The gradient audit (``host.audit``, ``audit_every``): GRPO's and DPPO's gradients of an audited batch; the speed
  check (``speed_check``): GRPO's passes timed once beside DPPO's, what the run saved in ``log``'s last call and the
  summary line (``host.summary``).
- ``train``: refuses an ``output_dir`` holding a user's files that a save would overwrite or delete
  (``dppo_trl.output_dir``), and writes the run's summary there at the end (``host.summary``); ``save_model``,
  ``_save_checkpoint`` and ``log`` (``completions/``) record what the run wrote there.
- Checkpoints: DPPO's state in one file (``host.checkpoint``); the model card names DPPO, and the completions
  table carries each row's keep decision and weight (``host.model_card``).

With ``completion_keep_rate=1.0``, ``prompt_keep_rate=1.0`` and ``packing=False`` every hook is TRL's own.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.extras import profiling
from trl.trainer.utils import shuffle_sequence_dict

from .config import DPPOConfig, as_dppo_config, audit_sharding_refusal
from .core.packing import is_varlen_attention
from .host.view import HostView
from .host.audit import GradientAudit
from .host.checkpoint import load_dppo_state, save_dppo_state
from .adapters.grpo import GRPORewards
from .components.generation_batch import BATCH_KEY, ITERATION_WEIGHTS_KEY, UNKEPT_ROWS_KEY, GenerationBatch
from .components.audit import AuditLedger
from .components.keep_decision import KeepDecision
from .components.placement import RowPlacement, resolve_packing
from .components.prefix_sharing import PrefixSharing
from .components.prompt_cut import PromptCutter
from .components.weighted_loss import WeightedLoss
from .components.weighted_metrics import PolicyRatioSettings, WeightedMetrics
from .components.view import local_rows
from .host.model_card import DPPOModelCard
from .host.passes import LogProbPasses
from .host.prompt_probe import PromptProbe
from .host.summary import DPPOSummaryCallback, RunClock, write_summary
from .host.loss import DPPOLoss
from .output_dir import check_output_dir, record_outputs
from .preflight import check_trainer_inputs


class DPPOTrainer(
    LogProbPasses, DPPOLoss, PromptProbe, GradientAudit,
    DPPOModelCard, GRPOTrainer,
):
    """Drop-in replacement of ``GRPOTrainer`` that trains on a random, reweighted subset of each generation
    batch, with the same expected loss and gradient (see ``DPPOConfig`` and ``docs/estimator.md``)."""

    _tag_names = ["trl", "grpo", "dppo"]
    RANK_BALANCE_TOLERANCE = 0.1  # a rank's kept tokens may exceed the mean by this fraction before rows move
    _scoring: GenerationBatch | None = None  # the batch TRL is scoring (its log-prob passes are deferred)
    _loss_pass = None  # the LossPass while DPPO's loss runs TRL's (host.loss)

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: DPPOConfig | GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        """``GRPOTrainer.__init__``'s parameters, names, order and defaults; a ``GRPOConfig`` is taken as the
        ``DPPOConfig`` with DPPO's defaults."""
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = DPPOConfig(f"{str(name).split('/')[-1] or 'model'}-DPPO")
        args = as_dppo_config(args)
        check_trainer_inputs(model, reward_funcs, train_dataset, eval_dataset, args, environment_factory)
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        if args.prompt_cut_runs and args.prompt_probe_generations and (tools or rollout_func or environment_factory):
            raise ValueError(  # after TRL's own checks of these, so that its messages come first
                f"prompt_probe_generations={args.prompt_probe_generations!r} cannot be combined with tools, "
                "rollout_func or environment_factory yet: the probe's completions are spliced into the groups at "
                "the single-turn generation. Use prompt_probe_generations=0 with a history prompt_score."
            )
        self._build_components()
        self._run_clock = RunClock()
        self._summary = DPPOSummaryCallback(self._run_clock, self.audit_ledger.speed_metrics, self._speed_summary,
                                            self.audit_ledger.summary)
        self.add_callback(self._summary)
        if self.args.audit_every and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError(audit_sharding_refusal(self.args.audit_every))

    def _build_components(self) -> None:
        """DPPO's components, each given what it depends on (TRL's settings as ``GRPOTrainer`` resolved them) and
        the trainer's view (``host.view``). Where the model makes packing inexact, ``args.packing`` is turned off
        (``components.placement.resolve_packing``)."""
        args = self.args
        self.view = HostView(self)
        self.audit_ledger = AuditLedger(args, self.view, self.num_iterations, self._speed_check_refusal())
        self.reward_form = GRPORewards(self.reward_weights, self.num_generations, self.multi_objective_aggregation)
        self.keep_decision = KeepDecision(args, self.reward_form, self.view, self._zero_score_contributes,
                                          self._measured_error_scale)
        self.prompt_cutter = PromptCutter(args, self.reward_form, self.view)
        self.weighted_loss = WeightedLoss(args, self.loss_type, self.max_completion_length, self.view)
        self.weighted_metrics = WeightedMetrics(self._policy_ratio_settings, self.view, self.get_gamma_weights)
        unwrapped = self.accelerator.unwrap_model(self.model)
        text_config = unwrapped.config.get_text_config()
        attention = getattr(unwrapped.config, "_attn_implementation", None) or ""
        layout = resolve_packing(args.packing, unwrapped, text_config, is_varlen_attention(attention))
        args.packing = layout.packing
        self.prefix_sharing = PrefixSharing(args, text_config, attention, self.num_generations, self.aux_loss_enabled,
                                            layout.one_sequence_per_row)
        self.placement = RowPlacement(
            args, layout, self.prefix_sharing, self.view, follow_trl_split=self.top_entropy_quantile < 1.0,
            per_sequence_ratio=lambda: str(self.vllm_importance_sampling_mode).startswith("sequence"),
            pad_token_id=self._tokenizer.pad_token_id, tolerance=self.RANK_BALANCE_TOLERANCE,
        )

    @property
    def last_global_keep(self) -> torch.Tensor | None:
        """The last generation batch's rows (every rank's) that some iteration keeps, the same on every rank."""
        return self.keep_decision.last_keep

    def _zero_score_contributes(self) -> bool:
        """Whether a row with A == 0 contributes to the loss: a KL term or an entropy bonus (TRL's settings now)."""
        return self.beta != 0.0 or self._entropy_bonus_enabled

    def _policy_ratio_settings(self) -> PolicyRatioSettings:
        """TRL's settings of the policy ratio and of the vLLM correction, as they stand (TRL reads them at each
        use)."""
        a = self.args
        return PolicyRatioSettings(
            self.loss_type, self.epsilon_low, self.epsilon_high, self.importance_sampling_level,
            self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
            vespo=dict(k_pos=a.vespo_k_pos, lambda_pos=a.vespo_lambda_pos, k_neg=a.vespo_k_neg,
                       lambda_neg=a.vespo_lambda_neg),
        )

    def _logps_dtype(self, model) -> torch.dtype:
        """The dtype of TRL's log-prob pass and loss: the model's, at least float32 (TRL's log-prob kernel's)."""
        return torch.promote_types(getattr(self.accelerator.unwrap_model(model), "dtype", torch.float32), torch.float32)

    def _dppo_now(self) -> bool:
        return self.args.dppo_training_path and self.model.training and not self._in_grpo_reference

    # ------------------------------------------------------------------ TRL's hooks
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-prob pass, called from three places: TRL's scoring of a generation batch (deferred: the call
        is recorded in the batch and zeros returned), DPPO's loss (inside ``_trl_batch_terms_off``: the outputs
        are captured, with the router loss TRL's was switched off for), and anywhere else. Packed on DPPO's
        training path when ``packing``, else TRL's own."""
        if self._scoring is not None:
            self._scoring.deferred_calls.append(model)
            placeholder = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device,
                                      dtype=self._logps_dtype(model))
            return placeholder, None, None
        loss_pass = self._loss_pass
        if loss_pass is not None and loss_pass.aux_loss:
            kwargs["compute_aux_loss"] = True
        if self.args.packing and self._dppo_now():
            out = self._packed_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, kwargs.get("compute_entropy", False),
                kwargs.get("compute_aux_loss", False),
            )
        else:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if loss_pass is not None:
            loss_pass.captured.append(out)
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._scoring is not None:
            self._scoring.rewards_per_func = rewards_per_func
        return rewards_per_func

    @contextlib.contextmanager
    def _scoring_batch(self, batch: GenerationBatch):
        """While TRL generates and scores a batch: its rewards and log-prob passes go into ``batch``."""
        self._scoring = batch
        try:
            yield batch
        finally:
            self._scoring = None

    def _generate_and_score_completions(self, inputs):
        """TRL's batch, plus each row's keep flag and weight (``dppo_keep``, ``dppo_weight``), its TRL split and
        origin rank, the kept rows balanced over ranks and their log-prob passes run; the ``GenerationBatch``
        under ``BATCH_KEY``."""
        if not self._dppo_now():
            return super()._generate_and_score_completions(inputs)
        audited = self._audit_this_batch()
        cut = None
        if self.args.prompt_pruning:
            inputs, cut = self._cut_step(inputs)
        with self._scoring_batch(GenerationBatch(cut=cut)) as batch, self._audit_timer(audited) as generation:
            output = super()._generate_and_score_completions(inputs)
        batch.generation_seconds = generation.seconds
        if any(key in output for key in ("pixel_values", "num_images")):
            raise NotImplementedError(
                "DPPO's training path (completion or prompt pruning, packing) does not support multimodal batches "
                "yet; set completion_keep_rate=1.0, prompt_keep_rate=1.0 and packing=False."
            )
        scores = self.keep_decision.scores(output["advantages"], batch)
        with profiling.profiling_context(self, "keep_decision"):
            self.keep_decision.draw(output, batch, scores)
        if self.args.prompt_pruning:
            prompt_weights, count = self.prompt_cutter.take_decision(scores, batch)
            batch.iteration_weights = batch.iteration_weights * prompt_weights
            if count is not None:  # a token count fixed before this batch's draw (prompts.expected_candidate_tokens)
                output["num_items_in_batch"] = torch.tensor(count, device=output["advantages"].device)
        if self.args.completion_pruning or self.args.prompt_pruning:
            self.keep_decision.log_metrics(batch, scores)
        self._log_keep_columns(batch.iteration(0))
        local, device = local_rows(self.view, output["advantages"].size(0)), output["advantages"].device
        # dppo_keep: the rows some iteration trains (forwarded, moved); dppo_weight: the first iteration's weights
        # (the audit's and the vLLM metrics'); dppo_iteration_weights: (rows, num_iterations), each iteration's.
        output["dppo_keep"], output["dppo_weight"] = batch.keep[local].to(device), batch.weights[local].to(device)
        output[ITERATION_WEIGHTS_KEY] = batch.iteration_weights[:, local].T.contiguous().to(device)
        audit_rows = dict(output) if audited else None  # this rank's rows before any exchange
        output.update(self.placement.trl_split_of_rows(output, batch))
        with profiling.profiling_context(self, "rank_balance"):
            output = self.placement.balance_ranks(output, batch)
        with self._audit_timer(audited) as logps:
            self._run_deferred_logps(output, batch)
        batch.logps_seconds = logps.seconds
        if audit_rows is not None:
            batch.audit = self._build_grpo_reference(audit_rows, batch, output, audited)
        dtype = self._logps_dtype(self.model)
        output["dppo_weight"] = output["dppo_weight"].to(dtype)
        output[ITERATION_WEIGHTS_KEY] = output[ITERATION_WEIGHTS_KEY].to(dtype)
        output[BATCH_KEY] = batch
        return output

    def _prepare_inputs(self, generation_batch):
        if not self._dppo_now():
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            rows = self._generate_and_score_completions(generation_batch)
            batch = rows.pop(BATCH_KEY)
            # TRL's own shuffle (which rows land in which micro-batch is DPPO's plan; the rows' TRL split was
            # replayed before the deferred passes, from batch.trl_split_rng_state).
            rows = shuffle_sequence_dict(rows)
            self._buffered_inputs = self._iteration_microbatches(rows, batch)
            if batch.audit is not None:  # the first iteration's: GRPO's gradient at the same parameters
                self._audit_generation_batch(batch, self._buffered_inputs[: self.args.steps_per_generation])
        # TRL's _step restarts at 0 on resume, where TRL regenerates (_buffered_inputs is None): iteration 0 again.
        return self._buffered_inputs[self._step % generate_every]

    def _iteration_microbatches(self, rows: dict, batch: GenerationBatch) -> list[dict]:
        """``steps_per_generation`` micro-batches for each of the ``num_iterations`` iterations, in order: each
        iteration's own kept rows and weights (``GenerationBatch.iteration``), planned with its own seed."""
        weights = rows.pop(ITERATION_WEIGHTS_KEY)
        microbatches = []
        for k in range(weights.size(1)):
            own = {**rows, "dppo_keep": weights[:, k] > 0, "dppo_weight": weights[:, k]}
            with profiling.profiling_context(self, "microbatch_plan"):
                microbatches += self.placement.kept_microbatches(own, batch.iteration(k), iteration=k)
        return microbatches

    def _compute_loss(self, model, inputs):
        if "dppo_weight" not in inputs:
            return super()._compute_loss(model, inputs)
        inputs = dict(inputs)
        weight = inputs.pop("dppo_weight")
        unkept = self._unkept_entropies(model, inputs.pop(UNKEPT_ROWS_KEY, None), inputs)
        scales = self.weighted_loss.scales(inputs, weight, self.current_gradient_accumulation_steps)
        advantages = inputs["advantages"]
        inputs["advantages"] = self.weighted_loss.weighted_advantages(advantages, scales.policy_weight)
        with self._trl_batch_terms_off(weight, unkept) as loss_pass:
            loss = super()._compute_loss(model, inputs)
        loss, logps, entropies, mask = self._with_weighted_terms(loss, inputs, weight, scales, loss_pass)
        self.weighted_metrics.log_loss_metrics(inputs, advantages, logps, entropies, mask, weight)
        return loss

    def get_high_entropy_mask(self, entropies, mask, threshold):
        """TRL's entropy filter. While DPPO's loss runs on this trainer, the micro-batch holds the kept rows of
        TRL's own micro-batch (``RowPlacement.follow_trl_split``) and the entropies of its rows that were not kept
        (``LossPass.unkept``): TRL's filter runs over them all, so its quantile is GRPO's, computed as TRL computes
        it, and the mask of the kept rows is recorded in the ``LossPass``. DPPO's state is read from the instance
        only: anything else (TRL's own tests call this on a ``Mock(spec=GRPOTrainer)``) gets TRL's."""
        loss_pass = self.__dict__.get("_loss_pass")
        if loss_pass is None:
            return super().get_high_entropy_mask(entropies, mask, threshold)
        every_entropy, every_mask = loss_pass.with_unkept(entropies, mask)
        return loss_pass.record_entropy_mask(super().get_high_entropy_mask(every_entropy, every_mask, threshold))

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation; while a step with a probe is scored, only the accepted groups' rows the probe did not
        generate, the probe's completions spliced back in (``components.prompt_cut``)."""
        cut = self._scoring.cut if self._scoring is not None else None
        if cut is None or cut.probe is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)

        def generate(rows, count):
            return super(DPPOTrainer, self)._generate_single_turn(rows, None, multimodal_fields, count,
                                                                  has_tool_images)

        return self.prompt_cutter.spliced(cut, prompt_ids, generate, num_generations)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """TRL's training, once ``output_dir`` holds nothing of the user's that a save of this run would overwrite
        or delete (``dppo_trl.output_dir``; checked on every rank, before anything is written)."""
        check_output_dir(self.args.output_dir, resume_from_checkpoint, self.args.save_strategy != "no")
        self._run_started = time.time()
        output = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        self._save_summary()
        return output

    def _save_summary(self) -> None:
        """The run's summary into ``output_dir`` (``dppo_summary.json``) and, where a save wrote the model card
        there, into the card (the final save writes it again)."""
        if not self.args.should_save or self._summary.summary is None:
            return
        write_summary(self.args.output_dir, self._summary.summary)
        if os.path.isfile(os.path.join(self.args.output_dir, "README.md")):
            self._write_model_card()
        self._record_outputs()

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """TRL's log; the run's last one (with ``train_runtime``) also gets what the run saved
        (``AuditLedger.speed_metrics``) and its wall seconds, resumed parts included (``dppo/speed_run_seconds``). With
        ``log_completions``, TRL's log writes ``completions/`` on the main process, so that is recorded then."""
        if "train_runtime" in logs:
            seconds = self._run_clock.seconds()
            logs = {**logs, "dppo/speed_run_seconds": seconds, **self.audit_ledger.speed_metrics(seconds)}
        super().log(logs, start_time)
        if self.args.log_completions and self.accelerator.is_main_process:
            self._record_outputs()

    def save_model(self, output_dir=None, _internal_call=False):
        """TRL's save; saved into ``output_dir`` (the run's model, not a checkpoint), with DPPO's model card."""
        super().save_model(output_dir, _internal_call)
        if output_dir in (None, self.args.output_dir) and not _internal_call:
            self._write_model_card()
            if self.args.should_save:
                self._record_outputs()

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            states = {"prompt_pruning": self.prompt_cutter.state_dict(), "audit": self.audit_ledger.state_dict(),
                      "run": self._run_clock.state_dict()}
            if os.path.isdir(folder):  # rotation deletes a new checkpoint below an older run's higher step
                save_dppo_state(folder, states)
            self._record_outputs()

    def _record_outputs(self) -> None:
        """What this run saved into ``output_dir`` is recorded as dppo-trl's (``output_dir.record_outputs``)."""
        if "_run_started" in self.__dict__:
            record_outputs(self.args.output_dir, self._run_started)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        states = load_dppo_state(checkpoint)
        if self.args.prompt_pruning and "prompt_pruning" in states:
            self.prompt_cutter.load_state_dict(states["prompt_pruning"])
        if "audit" in states:
            self.audit_ledger.load_state_dict(states["audit"])
        if checkpoint and "run" in states:
            self._run_clock.load_state_dict(states["run"])
