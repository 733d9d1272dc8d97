"""The host's side of DPPO's loss: TRL's batch-normalized terms (KL, entropy bonus, MoE router loss) switched off
around ``GRPOTrainer._compute_loss`` and added back weighted (``components.weighted_loss``); the entropies of the rows
of TRL's micro-batch that were not kept, forwarded without gradient (the entropy filter's quantile is over them too);
TRL's adaptive entropy controller kept in step, on the weighted window.

Reads of the host trainer: ``args``, ``accelerator``, ``current_gradient_accumulation_steps``,
``importance_sampling_level``, ``router_aux_loss_coef``, ``use_adaptive_entropy``, ``_metrics``, ``weighted_loss``;
writes TRL's ``beta``, ``_entropy_bonus_enabled``, ``aux_loss_enabled`` (restored) and its adaptive entropy state
(``entropy_coef``, ``_last_world_entropy``, ``_entropy_window_stats``), as TRL's own loss does."""

from __future__ import annotations

import contextlib

import torch
from trl.extras.profiling import profiling_decorator

from ..components.weighted_loss import LossPass, LossScales
from ..core.batch import TOKEN_KEYS, filler_row, loss_mask
from ..core.trl_formulas import adaptive_entropy_coef


class DPPOLoss:
    """Mixed into ``DPPOTrainer``."""

    @contextlib.contextmanager
    def _trl_batch_terms_off(self, row_weights: torch.Tensor, unkept=None):
        """Around ``GRPOTrainer._compute_loss`` on a kept micro-batch: TRL normalizes its KL (``beta``), entropy
        bonus and MoE router loss per micro-batch, which pruning would bias, so they are off inside (``beta`` 0,
        the bonus and the router loss disabled) and DPPO adds weighted ones after. Yields the ``LossPass`` that
        the forward inside fills (``_get_per_token_logps_and_entropies``, ``get_high_entropy_mask``); restores
        TRL's settings on exit, also on an exception. ``unkept``: ``_unkept_entropies``'s result."""
        saved = (self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled)
        loss_pass = LossPass(row_weights, beta=saved[0], entropy_bonus=saved[1], aux_loss=saved[2], unkept=unkept)
        self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = 0.0, False, False
        self._loss_pass = loss_pass
        try:
            yield loss_pass
        finally:
            self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = saved
            self._loss_pass = None

    @profiling_decorator
    @torch.no_grad()
    def _unkept_entropies(self, model, unkept: dict | None, inputs: dict):
        """``(entropies, loss mask)`` (P, T) of the rows of this micro-batch's TRL micro-batch that were not kept
        (``unkept``, from ``RowPlacement.kept_microbatches`` under the entropy filter with completion pruning),
        forwarded without gradient; None when there is nothing to take. A rank with no such row forwards a one-token
        filler row of ``inputs`` (no loss token), so every rank makes the same forward calls (ZeRO-3, FSDP)."""
        if unkept is None:
            return None
        if unkept["prompt_ids"].size(0) == 0:
            filler = filler_row(inputs)
            unkept = {key: filler[key] for key in TOKEN_KEYS if key in filler}
        input_ids = torch.cat([unkept["prompt_ids"], unkept["completion_ids"]], dim=1)
        attention_mask = torch.cat([unkept["prompt_mask"], unkept["completion_mask"]], dim=1)
        _, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, unkept["completion_ids"].size(1), compute_entropy=True
        )
        return entropies, loss_mask(unkept)

    def _with_weighted_terms(self, loss, inputs, weight, scales: LossScales, loss_pass: LossPass):
        """TRL's policy loss of the micro-batch on the full-batch scale, plus the weighted KL, entropy bonus and
        router loss. Returns the loss, the forward's ``(logps, entropies)`` and the loss mask."""
        terms, accumulation = self.weighted_loss, self.current_gradient_accumulation_steps
        mask = loss_mask(inputs)
        loss = terms.on_full_batch_scale(loss, mask, scales)
        logps, entropies, aux_loss = loss_pass.captured[0]
        if loss_pass.beta != 0.0:
            kl = terms.kl_sum(logps, inputs, mask, weight, scales, self.importance_sampling_level)
            loss = loss + loss_pass.beta * kl / scales.full_z
        if loss_pass.entropy_bonus:
            terms.log_policy_loss(loss, accumulation)
            normalized, weighted = terms.entropy_token_weights(mask, weight, scales, loss_pass, accumulation,
                                                               entropies.dtype)
            loss = loss - self._entropy_coefficient(entropies, weighted) * (entropies * normalized).sum()
        if self.aux_loss_enabled:  # a regularizer of the rows forwarded, as GRPO's is of its micro-batch
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics["train"]["aux_loss"].append(self.accelerator.gather(aux_loss.detach()).mean().item())
        return loss, logps, entropies, mask

    def _entropy_coefficient(self, entropies: torch.Tensor, weighted: torch.Tensor) -> float:
        """TRL's entropy bonus coefficient for this micro-batch; the adaptive controller (TRL's rule and state) uses
        the previous step's end for the whole window and measures the weighted window entropy."""
        apply_coef = self.entropy_coef
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            self._update_adaptive_entropy(torch.stack([(entropies * weighted).sum(), weighted.sum()]).detach())
        if self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(self.entropy_coef)
        return apply_coef

    def _update_adaptive_entropy(self, stats: torch.Tensor) -> None:
        """TRL's adaptive entropy controller on the weighted ``(entropy sum, token count)`` of the window."""
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world = (total[0] / total[1].clamp(min=1e-12)).item()
        a = self.args
        self.entropy_coef = adaptive_entropy_coef(
            self.entropy_coef, world, a.entropy_target, a.entropy_coef_delta, a.entropy_coef_min, a.entropy_coef_max
        )
        self._last_world_entropy, self._entropy_window_stats = world, None
