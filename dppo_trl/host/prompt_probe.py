"""The host's side of prompt pruning's cut: the step's candidates' keys gathered, the probe generated and scored by
TRL's own generation and reward functions (what TRL logs meanwhile dropped), the cut drawn by the component
(``components.prompt_cut.PromptCutter``), the same on every rank.

Reads of the host trainer: ``args``, ``accelerator``, ``num_generations`` (and sets it for the probe),
``eos_token_ids``, ``_tokenizer``, ``state``, ``_metrics``, ``_pending_extra_logs``, ``_pending_metrics``; TRL's
``_generate`` and ``_calculate_rewards``; ``view``, ``reward_form``, ``prompt_cutter``."""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import gather_object
from trl.extras.profiling import profiling_decorator

from ..components.prompt_cut import Probe, PromptCut
from ..core.prompts import prompt_key


class PromptProbe:
    """Mixed into ``DPPOTrainer``; used only while ``prompt_keep_rate < 1``."""

    @profiling_decorator
    def _cut_step(self, inputs: list[dict]) -> tuple[list[dict], PromptCut]:
        """The step's cut of this rank's candidates ``inputs`` (TRL's rows: ``P`` prompts, ``G`` rows each); returns
        the accepted rows and the ``PromptCut``."""
        candidates = self.prompt_cutter.candidates(inputs)
        keys = gather_object([prompt_key(x["prompt"]) for x in candidates])
        probe = self._probe(candidates) if self.args.prompt_cut_runs and self.args.prompt_probe_generations else None
        cut = self.view.same_on_every_rank(self.prompt_cutter.decide(keys, probe, len(candidates)))
        cut.probe = probe
        return self.prompt_cutter.accepted_rows(inputs, cut), cut

    @profiling_decorator
    def _probe(self, candidates: list[dict]) -> Probe:
        """Generate and score ``k`` completions of every candidate of this rank (TRL's own generation and reward
        functions), gathered over ranks; what TRL logs while doing so is left out of the step's logs."""
        k = self.args.prompt_probe_generations
        rows = [x for x in candidates for _ in range(k)]
        prompts = [x["prompt"] for x in rows]
        with self._generating_groups_of(k), self._logs_untouched():
            _, completion_ids, _, completions, logprobs, *_ = self._generate(prompts)
            rewards_per_func = self._calculate_rewards(rows, prompts, completions, completion_ids)
        rewards = self.reward_form.aggregate(rewards_per_func)
        tokens = torch.tensor([self._probe_loss_tokens(ids) for ids in completion_ids], device=self.accelerator.device)
        loss_tokens = self.accelerator.gather(tokens).cpu()

        def per_candidate(values):
            return None if values is None else [values[j * k : (j + 1) * k] for j in range(len(candidates))]

        return Probe(k, rewards.view(-1, k), loss_tokens.view(-1, k), per_candidate(completion_ids),
                     per_candidate(logprobs))

    def _probe_loss_tokens(self, ids: list[int]) -> int:
        """A probe completion's loss tokens: its length, 0 when truncated and ``mask_truncated_completions``."""
        truncated = not ids or ids[-1] not in [*self.eos_token_ids, self._tokenizer.pad_token_id]
        return 0 if truncated and self.args.mask_truncated_completions else len(ids)

    @contextlib.contextmanager
    def _generating_groups_of(self, size: int):
        """TRL's generation and scoring with groups of ``size`` (vLLM's server mode asks for ``size`` a prompt)."""
        saved = self.num_generations
        self.num_generations = size
        try:
            yield
        finally:
            self.num_generations = saved

    @contextlib.contextmanager
    def _logs_untouched(self):
        """What TRL's generation and reward functions log inside is dropped: the probe is not the step's batch."""
        stores = [self._metrics["train"], self._pending_extra_logs, self._pending_metrics]
        lengths = [{key: len(values) for key, values in store.items()} for store in stores]
        tokens_seen = self.state.num_input_tokens_seen
        try:
            yield
        finally:
            for store, before in zip(stores, lengths):
                for key in list(store):
                    if key not in before:
                        del store[key]
                    else:
                        del store[key][before[key] :]
            self.state.num_input_tokens_seen = tokens_seen
