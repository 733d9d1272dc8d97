"""Prompt pruning's hooks of ``DPPOTrainer`` (cut mode): the step's candidates are the prompts TRL's own sampler
yields; a probe of ``prompt_probe_generations`` completions of each is generated and scored first; a fixed-size
draw accepts ``m`` of each rank's candidates; only the accepted groups are generated (the probe's completions
spliced back into their groups), scored and trained, weighted ``1 / pi``. The math is in ``dppo_trl.core.prompts``.

Reads of the host trainer: ``args``, ``accelerator``, ``num_generations``, ``eos_token_ids``, ``_tokenizer``,
``reward_weights``, ``state``, ``_metrics``, ``_pending_extra_logs``, ``_pending_metrics``; TRL's ``_generate``
and ``_calculate_rewards``; ``view`` (``host.view``) and ``reward_form`` (``adapters.grpo``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from accelerate.utils import gather_object
from trl.extras.profiling import profiling_decorator

from ..core.prompts import (
    CutInputs,
    PromptHistory,
    accepted_per_rank,
    cut_decision,
    expected_candidate_tokens,
    prompt_key,
    prompt_score,
    spread_groups,
)
from ..components.generation_batch import GenerationBatch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Probe:
    """The probe of one step: ``k`` completions of every candidate, generated and scored before the draw.

    Args:
        rewards: (C, k) every rank's candidates' weighted reward sums (NaN where every function gave None).
        loss_tokens: (C, k) their loss tokens.
        completion_ids: this rank's candidates' completions, ``k`` token lists each.
        logprobs: this rank's candidates' sampling log-probs (``k`` lists each), or None.
    """

    k: int
    rewards: torch.Tensor
    loss_tokens: torch.Tensor
    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]] | None


@dataclasses.dataclass
class PromptCut:
    """One step's cut over every rank's candidates (``C = ranks x P``, rank-major).

    Args:
        keys: the candidates' prompt keys.
        pi: (C,) float64 inclusion probabilities (``sum = m`` on each rank).
        accepted: (C,) bool.
        normalizer: the token count a token-mean loss divides by, fixed before the draw; None when every candidate
            is accepted (the batch's own count is GRPO's).
        ranks: the processes.
        probe: this rank's probe (not sent between ranks), or None.
    """

    keys: list[str]
    pi: torch.Tensor
    accepted: torch.Tensor
    normalizer: float | None
    ranks: int
    probe: Probe | None = None

    def local(self, rank: int) -> torch.Tensor:
        """(P,) bool: rank ``rank``'s accepted candidates."""
        per_rank = self.accepted.numel() // self.ranks
        return self.accepted[rank * per_rank : (rank + 1) * per_rank]


class PromptPruning:
    """Mixed into ``DPPOTrainer``; used only while ``prompt_keep_rate < 1``."""

    _prompt_history: PromptHistory | None = None

    def _history(self) -> PromptHistory:
        if self._prompt_history is None:
            self._prompt_history = PromptHistory(self.args.prompt_history_decay)
        return self._prompt_history

    @profiling_decorator
    def _cut_step(self, inputs: list[dict]) -> tuple[list[dict], PromptCut]:
        """The step's cut of this rank's candidates ``inputs`` (TRL's rows: ``P`` prompts, ``G`` rows each); returns
        the accepted rows and the ``PromptCut``."""
        group = self.num_generations
        if any(key in x for x in inputs for key in ("image", "images")):
            raise NotImplementedError(
                "DPPO's prompt pruning does not support multimodal batches yet; set prompt_keep_rate=1.0."
            )
        if len(inputs) % group:
            raise ValueError(
                f"prompt_keep_rate={self.args.prompt_keep_rate!r} needs whole groups on every rank: each process's "
                f"generation batch (per_device_train_batch_size x steps_per_generation = {len(inputs)} rows) must be "
                f"a multiple of num_generations={group}."
            )
        candidates = [inputs[i] for i in range(0, len(inputs), group)]
        keys = gather_object([prompt_key(x["prompt"]) for x in candidates])
        probe = self._probe(candidates) if self.args.prompt_cut_runs and self.args.prompt_probe_generations else None
        cut = self.view.same_on_every_rank(self._decide_cut(keys, probe, len(candidates)))
        cut.probe = probe
        local = cut.local(self.accelerator.process_index).tolist()
        rows = [row for j, taken in enumerate(local) if taken for row in inputs[j * group : (j + 1) * group]]
        return rows, cut

    def _decide_cut(self, keys: list[str], probe: Probe | None, candidates_per_rank: int) -> PromptCut:
        """Scores, inclusion probabilities, the draw and the normalizer, from what is known before the draw."""
        history = self._history()
        lengths = probe.loss_tokens.double().mean(1) if probe is not None else history.lengths(keys)
        ranks = self.accelerator.num_processes
        accepted = accepted_per_rank(self.args.prompt_keep_rate, candidates_per_rank)
        # Nothing known of any candidate, or m = P: every candidate is accepted and the step is GRPO's.
        if lengths is None or accepted == candidates_per_rank:
            ones = torch.ones(len(keys), dtype=torch.float64)
            return PromptCut(keys, ones, ones.bool(), None, ranks)
        probe_rewards = None if probe is None else probe.rewards
        scores = prompt_score(self.args.prompt_score)(CutInputs(keys, history, probe_rewards))
        generator = torch.Generator().manual_seed(self.view.seed("prompt_cut"))
        pi, keep = cut_decision(scores, ranks, accepted, self.args.prompt_keep_floor, generator)
        return PromptCut(keys, pi, keep, expected_candidate_tokens(lengths, self.num_generations), ranks)

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

    def _spliced_generation(self, cut: PromptCut, prompt_ids, generate, group: int):
        """``(completion_ids, logprobs)`` of the accepted rows (``group`` a prompt): the probe's ``k`` completions of
        each accepted candidate, then ``group - k`` generated now by ``generate(prompt_ids, count)``."""
        probe, k = cut.probe, cut.probe.k
        mine = [j for j, taken in enumerate(cut.local(self.accelerator.process_index).tolist()) if taken]
        rest = [ids for g in range(len(mine)) for ids in prompt_ids[g * group + k : (g + 1) * group]]
        new_ids, new_logprobs = generate(rest, group - k)
        completion_ids, logprobs = [], None if new_logprobs is None or probe.logprobs is None else []
        for g, j in enumerate(mine):
            completion_ids += probe.completion_ids[j] + list(new_ids[g * (group - k) : (g + 1) * (group - k)])
            if logprobs is not None:
                logprobs += probe.logprobs[j] + list(new_logprobs[g * (group - k) : (g + 1) * (group - k)])
        return completion_ids, logprobs

    def _take_prompt_decision(self, scores: torch.Tensor, batch: GenerationBatch) -> tuple[torch.Tensor, float | None]:
        """The accepted rows' prompt weights ``1 / pi`` (every rank's rows) and the token normalizer fixed before
        the draw (None when every candidate was accepted: the batch's own count, TRL's, stands); feeds the groups
        back to the history."""
        cut, group = batch.cut, self.num_generations
        accepted_pi = cut.pi[cut.accepted]
        weights = (1.0 / accepted_pi).repeat_interleave(group)
        loss_tokens = batch.loss_tokens.double()
        normalizer = float(loss_tokens.sum()) if cut.normalizer is None else cut.normalizer
        keys = [key for key, taken in zip(cut.keys, cut.accepted.tolist()) if taken]
        group_rewards = self.reward_form.aggregate(batch.rewards_per_func).double().view(-1, group)
        self._history().update(keys, scores.abs().view(-1, group).mean(1).tolist(),
                               loss_tokens.view(-1, group).mean(1).tolist(), group_rewards.nanmean(1).tolist())
        self._log_cut_metrics(cut, weights, loss_tokens, normalizer, group_rewards)
        return weights, cut.normalizer

    def _log_cut_metrics(self, cut: PromptCut, weights, loss_tokens, normalizer: float, group_rewards) -> None:
        metrics, group = self._metrics["train"], self.num_generations
        candidates, accepted = cut.accepted.numel(), int(cut.accepted.sum())
        k = 0 if cut.probe is None else cut.probe.k
        generated = candidates * k + accepted * (group - k)
        metrics["dppo/prompt_accepted_fraction"].append(accepted / candidates)
        metrics["dppo/prompt_generated_fraction"].append(generated / (candidates * group))
        metrics["dppo/prompt_flat_fraction"].append(1.0 - float(spread_groups(group_rewards.flatten(), group).double()
                                                                .mean()) if accepted else 0.0)
        metrics["dppo/prompt_weight_max"].append(float(weights.max()) if weights.numel() else 0.0)
        # Its mean over steps estimates E[T] / D, the scale of the fixed normalizer (1 when D is exact).
        metrics["dppo/prompt_token_scale"].append(float((loss_tokens * weights).sum()) / max(normalizer, 1.0))

    def _prompt_pruning_state_dict(self) -> dict | None:
        return None if self._prompt_history is None else {"history": self._prompt_history.state_dict()}

    def _load_prompt_pruning_state_dict(self, state: dict) -> None:
        if "history" not in state:
            logger.warning("DPPO: this checkpoint holds the prompt sampler of an earlier version (its history was per "
                           "dataset row); prompt pruning goes on with an empty history.")
            return
        self._history().load_state_dict(state["history"])
