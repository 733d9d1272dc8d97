"""The host's forward passes: the deferred log-prob passes run on the kept rows (the calls ``RowPlacement`` plans),
and a packed forward (the layout ``RowPlacement.packed_call`` gives) unpacked into TRL's padded ``(B, T)`` layout.
Mirrors TRL: the reference pass of a PEFT policy without a reference model runs the policy in TRL's adapter context,
and no deferred pass checkpoints its activations (TRL's ``disable_gradient_checkpointing``).

Reads of the host trainer: ``args``, ``accelerator``, ``model``, ``ref_model``, ``beta``, ``placement``,
``weighted_metrics``; ``_get_per_token_logps_and_entropies`` (TRL's hook, DPPO's override)."""

from __future__ import annotations

import contextlib

import torch
from trl.extras.profiling import profiling_decorator
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from ..components.generation_batch import GenerationBatch


class LogProbPasses:
    """Mixed into ``DPPOTrainer``."""

    @profiling_decorator
    @torch.no_grad()
    def _run_deferred_logps(self, output: dict, batch: GenerationBatch) -> None:
        """Run the log-prob passes TRL deferred (``batch.deferred_calls``), on the kept rows only; other rows hold
        zeros. Each pass is cut into forward calls no larger than TRL's (``RowPlacement.deferred_call_groups``),
        and every rank makes as many calls as the rank that needs the most, a rank short of rows forwarding a
        one-token filler, so sharded models (ZeRO-3, FSDP) that gather parameters in every forward stay in step."""
        rows = output["dppo_keep"].nonzero().flatten()
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        filler_mask = torch.zeros_like(attention_mask[:1])
        filler_mask[:, output["prompt_ids"].size(1) - 1] = 1  # one real token: the last prompt column
        groups = self.placement.deferred_call_groups(rows, batch, output["dppo_row"][rows].tolist())
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

    def _logps_of(self, model, input_ids, attention_mask, logits_to_keep, batch_size):
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]

    @profiling_decorator
    def _packed_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux_loss=False
    ):
        """TRL's per-token log-probs (and entropies) of the completion tokens, computed padding-free in one forward
        call (``RowPlacement.packed_call``) and unpacked into TRL's padded ``(B, T)`` layout; with the MoE router
        loss, over the packed tokens."""
        call = self.placement.packed_call(input_ids, attention_mask, logits_to_keep,
                                          self.accelerator.unwrap_model(model).dtype)
        if compute_aux_loss:
            call.model_inputs["output_router_logits"] = True
        with self.accelerator.autocast():
            out = model(**call.model_inputs, fused_lm_head=True)
        dtype = torch.promote_types(out.log_probs.dtype, torch.float32)
        logps = call.unpacked(out.log_probs, dtype)
        entropies = call.unpacked(out.entropy, dtype) if compute_entropy else None
        return logps, entropies, out.aux_loss if compute_aux_loss else None
