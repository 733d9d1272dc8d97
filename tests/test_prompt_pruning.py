"""Prompt pruning's cut (issue 42): the fixed-size design, the scores and the history (pure), the expected step
by exact enumeration against GRPO's over every candidate (float64, per loss type, with completion pruning), the
trainer's groups against GRPOTrainer's (the probe's completions included), resume, and TRL's own test shapes."""

import itertools
import json
import math

import pytest
import torch
from datasets import concatenate_datasets
from support.configs import N_ROWS, cpu_config, float64_settings, validation_config
from support.models import addition_prompts
from support.oracle import assert_exact, dppo_loss_and_grad, make_trainer, synthetic_batch
from support.outcomes import poisson_outcomes
from support.recording import BATCH_KEYS, recording
from support.rewards import coarse_reward, constant_reward, random_reward
from support.training import StopAt, losses_of, params_of, train
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOTrainer
from dppo_trl.core.estimator import SUPPORTED_LOSS_TYPES, horvitz_thompson_weights
from dppo_trl.core.pruning import keep_probabilities
from dppo_trl.core.prompts import (
    CutInputs,
    PromptHistory,
    accepted_per_rank,
    cut_probabilities,
    fixed_size_sample_at,
    history_cell,
    prompt_key,
    prompt_score,
    register_prompt_score,
    spread_groups,
)
from dppo_trl.tasks.toy import build_tokenizer


def fixed_size_outcomes(pi, size, min_width=1e-15):
    """Every outcome of ``fixed_size_sample`` with its exact probability: each order (``1 / P!``) times each piece
    of the start point between the breakpoints of the scaled cumulative sums."""
    n = pi.numel()
    for order in itertools.permutations(range(n)):
        order = torch.tensor(order)
        upper = torch.cumsum(pi.double()[order], 0)
        upper = upper * (size / float(upper[-1]))
        cuts = sorted({0.0, 1.0, *[float(c) % 1.0 for c in upper]})
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            if hi - lo > min_width:
                yield (hi - lo) / math.factorial(n), fixed_size_sample_at(pi, size, order, 0.5 * (lo + hi))


# ------------------------------------------------------------------ the design, the scores, the history (pure)
@pytest.mark.parametrize("scores,size", [([1.0, 0.0, 0.0, 1.0], 2), ([0.3, 2.0, 0.0, 0.7, 1.1], 2), ([1.0] * 4, 1),
                                         ([0.0, 0.0, 5.0], 1)])
def test_the_fixed_size_design_draws_exactly_m_with_inclusion_probabilities_pi(scores, size):
    """Every order and start point enumerated: each outcome accepts exactly ``m`` candidates, and candidate ``j``
    is accepted with probability exactly ``pi_j`` (float64); ``pi`` sums to ``m`` and respects the floor."""
    pi = cut_probabilities(torch.tensor(scores), size, floor=0.1)
    assert float(pi.sum()) == pytest.approx(size, abs=1e-12) and float(pi.min()) >= 0.1 - 1e-15
    inclusion, total = torch.zeros_like(pi), 0.0
    for prob, accepted in fixed_size_outcomes(pi, size):
        assert int(accepted.sum()) == size
        inclusion += prob * accepted.double()
        total += prob
    assert total == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(inclusion, pi, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scores,floor", [([5.0, 0.0, 0.0, 0.0], 0.25), ([5.0, 0.0, 0.0, 0.0], 0.2),
                                          ([3.0, 1.0, 0.0, 0.0], 0.25)])
def test_a_binding_floor_keeps_the_design_exact_up_to_m_over_p_and_is_refused_past_it(scores, floor):
    """The floor binds (every candidate or the flat ones sit at it): the enumerated inclusion probabilities are
    still ``pi``, summing to ``m``. Past ``m / P`` no ``pi`` sums to ``m``, and the core refuses it."""
    pi = cut_probabilities(torch.tensor(scores), 1, floor)
    assert float(pi.sum()) == pytest.approx(1.0, abs=1e-12) and float(pi.min()) >= floor - 1e-15
    inclusion = torch.zeros_like(pi)
    for prob, accepted in fixed_size_outcomes(pi, 1):
        inclusion += prob * accepted.double()
    torch.testing.assert_close(inclusion, pi, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="floor"):
        cut_probabilities(torch.tensor(scores), 1, 0.3)


def test_equal_scores_accept_m_of_p_and_m_rounds_the_rate():
    assert torch.equal(cut_probabilities(torch.ones(4), 2, 0.1), torch.full((4,), 0.5, dtype=torch.float64))
    assert [accepted_per_rank(0.5, p) for p in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 2]
    assert accepted_per_rank(0.01, 8) == 1 and accepted_per_rank(0.99, 8) == 8


def test_the_probe_score_marks_groups_whose_rewards_differ():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [float("nan"), 0.5], [0.2, float("nan")], [0.0, 0.0]])
    assert spread_groups(rewards.flatten(), 2).tolist() == [False, True, False, False, False]
    scores = prompt_score("probe")(CutInputs(["a"] * 5, PromptHistory(0.5), rewards))
    assert scores.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_history_scores_fall_back_to_the_mean_of_the_seen_prompts():
    history = PromptHistory(decay=0.5)
    history.update(["a", "b"], [0.4, 0.0], [10.0, 4.0], [0.5, 1.0])
    history.update(["a"], [0.8], [6.0], [0.25])
    assert history.prompts["a"]["score"] == pytest.approx(0.6) and history.prompts["a"]["length"] == pytest.approx(8.0)
    ema = prompt_score("ema")(CutInputs(["a", "b", "new"], history, None))
    assert ema.tolist() == pytest.approx([0.6, 0.0, 0.3])
    assert history.lengths(["a", "new"]).tolist() == pytest.approx([8.0, 6.0])
    assert PromptHistory(0.5).lengths(["a"]) is None
    # "a"'s first group was spread with a mean reward in the top bin: its cell's measure is the next visit's |A|.
    assert history.calibration[history_cell(0.4, 0.5, 0.5, 1.0)] == pytest.approx(0.8)
    calibrated = prompt_score("calibrated")(CutInputs(["a", "b"], history, None))
    assert calibrated.tolist() == pytest.approx([0.8, 0.8])  # b's cell has no measure yet: the mean of the others


def test_the_history_round_trips_through_json_and_keys_are_stable():
    history = PromptHistory(decay=0.5)
    history.update([prompt_key("x"), prompt_key([{"role": "user", "content": "x"}])], [0.5, 0.0], [3.0, 4.0],
                   [0.5, float("nan")])
    resumed = PromptHistory(decay=0.5)
    resumed.load_state_dict(json.loads(json.dumps(history.state_dict())))
    assert resumed.state_dict() == history.state_dict()
    assert prompt_key("x") != prompt_key([{"role": "user", "content": "x"}]) and prompt_key("x") == prompt_key("x")


def test_prompt_scores_refuse_a_taken_name_and_an_unknown_one():
    with pytest.raises(ValueError, match="probe"):
        register_prompt_score("probe", needs_probe=True)(lambda inputs: None)
    with pytest.raises(ValueError, match="prompt_score"):
        prompt_score("last")


# ------------------------------------------------------------------ the expected step, by exact enumeration
# The oracle batch: 3 groups of 2 rows (support.oracle.synthetic_batch); each acceptance set's batch holds only the
# accepted groups' rows, weighted 1 / pi, normalized by the full candidates' count (D fixed before the draw).
GROUP = 2
# bnpo's count is per micro-batch: exact at one micro-batch, approximate otherwise (docs/prompt_pruning.md).
EXACT_CASES = [(t, spg) for t in SUPPORTED_LOSS_TYPES for spg in (1, 3) if not (t == "bnpo" and spg > 1)]


def _accepted_rows(batch, groups):
    rows = torch.tensor([r for g in groups for r in range(g * GROUP, (g + 1) * GROUP)], dtype=torch.long)
    return {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() and v.size(0) == N_ROWS else v)
            for k, v in batch.items()}, rows


def _cut_expectation(trainer, batch, pi, size, completion_rate=None, weight_pi=None):
    """E over every acceptance set (and, with ``completion_rate``, every Poisson keep mask of the accepted rows,
    their keep probabilities computed on the accepted batch as the trainer does) of the step's loss and gradient;
    ``weight_pi``: the probabilities the weights are taken from (``pi`` by default)."""
    weight_pi = pi if weight_pi is None else weight_pi
    loss, grad, total = 0.0, 0.0, 0.0
    outcomes = {}
    for prob, accepted in fixed_size_outcomes(pi, size):
        key = tuple(accepted.tolist())
        outcomes[key] = outcomes.get(key, 0.0) + prob
    for key, prob in outcomes.items():
        groups = [g for g, taken in enumerate(key) if taken]
        sub, rows = _accepted_rows(batch, groups)
        prompt_weight = (1.0 / weight_pi[torch.tensor(groups)]).repeat_interleave(GROUP)
        if completion_rate is None:
            masks = [(1.0, torch.ones(rows.numel(), dtype=torch.bool), torch.ones(rows.numel(), dtype=torch.float64))]
        else:
            row_pi, _ = keep_probabilities(sub["advantages"], completion_rate, 0.1, zero_score_contributes=False)
            masks = [(p, keep, horvitz_thompson_weights(row_pi, keep)) for p, keep, _ in poisson_outcomes(row_pi)]
        for mask_prob, keep, weights in masks:
            value, g = dppo_loss_and_grad(trainer, sub, keep, weights * prompt_weight)
            loss, grad, total = loss + prob * mask_prob * value, grad + prob * mask_prob * g, total + prob * mask_prob
    assert total == pytest.approx(1.0, abs=1e-12)
    return loss, grad


@pytest.mark.parametrize("loss_type,spg", EXACT_CASES)
def test_the_expected_cut_step_is_grpos_step_over_every_candidate(tmp_path, tiny_model_dir, train_dataset, exact_logprobs,
                                                                  loss_type,
                                                                  spg):
    """Float64, clipping active, ``beta`` 0.04: the expectation over every acceptance set of the fixed-size design
    (m = 2 of 3 candidates, unequal pi) of the trainer's loss and gradient on the accepted rows alone equals the step
    over every candidate with every row kept (DPPO's path there is GRPO's: test_trl_microbatch_statistics), with
    the token count fixed before the draw at the candidates' own. A design that ignores the weights is off."""
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, 0.04, spg, float64=True,
                           prompt_keep_rate=0.5, prompt_score="ema", prompt_probe_generations=0)
    batch = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in synthetic_batch(trainer).items()}
    pi = cut_probabilities(torch.tensor([0.9, 0.2, 0.5]), 2, 0.1)
    assert len(set(pi.tolist())) == 3  # unequal
    full_loss, full_grad = dppo_loss_and_grad(trainer, batch, torch.ones(N_ROWS, dtype=torch.bool),
                                              torch.ones(N_ROWS, dtype=torch.float64))
    loss, grad = _cut_expectation(trainer, batch, pi, 2)
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)
    uniform = torch.full((3,), 2 / 3, dtype=torch.float64)
    _, wrong = _cut_expectation(trainer, batch, pi, 2, weight_pi=uniform)  # drawn with pi, weighted as if uniform
    assert float((wrong - full_grad).norm()) > 1e-3 * float(full_grad.norm())


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_cut_composes_with_completion_pruning(tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type):
    """Acceptance sets times every Poisson keep mask of the accepted rows (keep rate 0.5 on the accepted batch's
    advantages): the expected step is still GRPO's over every candidate, float64."""
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, 0.0, 1, float64=True,
                           prompt_keep_rate=0.5, prompt_score="ema", prompt_probe_generations=0)
    batch = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in synthetic_batch(trainer).items()}
    pi = cut_probabilities(torch.tensor([0.9, 0.2, 0.5]), 2, 0.1)
    full_loss, full_grad = dppo_loss_and_grad(trainer, batch, torch.ones(N_ROWS, dtype=torch.bool),
                                              torch.ones(N_ROWS, dtype=torch.float64))
    loss, grad = _cut_expectation(trainer, batch, pi, 2, completion_rate=0.5)
    assert_exact(loss, full_loss)
    assert_exact(grad, full_grad)


# ------------------------------------------------------------------ the trainer: GRPO's groups, resume, TRL's shapes
def seeded_generation(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """A stand-in for ``GRPOTrainer._generate_single_turn``: completion ``i`` of a prompt in a step is drawn from a
    generator seeded by the prompt's tokens, the step and ``i`` (``i`` counts on across the calls of a step),
    whatever else the call generates. So GRPO's group and DPPO's (the probe, then the rest) hold the same
    completions."""
    if self.__dict__.get("_seeded_step") != self.state.global_step:
        self._seeded_step, self._seeded_counts = self.state.global_step, {}
    completions = []
    for ids in prompt_ids:
        key = tuple(ids)
        index = self._seeded_counts.get(key, 0)
        self._seeded_counts[key] = index + 1
        g = torch.Generator().manual_seed(hash((key, self.state.global_step, index)) % 2**31)
        length = int(torch.randint(1, self.max_completion_length + 1, (), generator=g))
        completions.append(torch.randint(10, 60, (length,), generator=g).tolist())
    return completions, None


def _unpadded(ids, mask):
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


class RewardsOut:
    """Put before a trainer class: each batch's rewards (every rank's, weighted sums) are in its output."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        out["rewards"] = self._recorded_rewards
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._recorded_rewards = rewards.sum(1)
        return rewards


def _recording_rewards(base):
    """``base`` recording each batch's rows and rewards, prompts and prompt decisions."""
    return recording(type(f"RewardsOut{base.__name__}", (RewardsOut, base), {}),
                     batch_keys=BATCH_KEYS + ("prompt_ids", "rewards"), record_prompts=True,
                     record_prompt_decisions=True)


@pytest.fixture(scope="module")
def small_dataset():
    return addition_prompts(16)


def prompt_config(tmp_path, **kwargs):
    base = dict(prompt_keep_rate=0.5, max_steps=4, per_device_train_batch_size=16, num_generations=4)
    base.update(kwargs)
    return cpu_config(tmp_path, **base)


@pytest.mark.parametrize("extra", [{}, {"prompt_score": "ema", "prompt_probe_generations": 0}])
def test_an_accepted_group_is_the_group_grpo_draws_probe_included(tmp_path, tiny_model_dir, small_dataset, extra,
                                                                   monkeypatch):
    """GRPOTrainer and DPPOTrainer (cut at 0.5 of 4 candidates, the probe of 2 or the history) with the same
    completions per prompt: each DPPO batch is GRPO's batch of the same step restricted to the accepted groups, the
    same prompts, completions, rewards and advantages, row for row; its weights are 1 / pi of its group."""
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", seeded_generation)
    grpo_cls, dppo_cls = (_recording_rewards(c) for c in (GRPOTrainer, DPPOTrainer))
    # learning_rate 0: the same policy at every step of both runs.
    args = prompt_config(tmp_path, completion_keep_rate=1.0, packing=False, learning_rate=0.0, **extra)
    grpo_args = cpu_config(tmp_path / "grpo", max_steps=4, per_device_train_batch_size=16, num_generations=4,
                           learning_rate=0.0, cls=GRPOConfig)
    grpo = grpo_cls(tiny_model_dir, coarse_reward, args=grpo_args, train_dataset=small_dataset)
    grpo.train()
    dppo = dppo_cls(tiny_model_dir, coarse_reward, args=args, train_dataset=small_dataset)
    dppo.train()
    assert dppo.prompts_seen == grpo.prompts_seen  # the candidates are GRPO's, step by step
    cut_any = False
    for g, d, (weights, _, cut) in zip(grpo.records, dppo.records, dppo.prompt_decisions):
        rows = torch.tensor([r for j, taken in enumerate(cut.accepted.tolist()) if taken for r in range(4 * j, 4 * j + 4)])
        cut_any |= rows.numel() < 16
        for ids, mask in (("prompt_ids", "prompt_mask"), ("completion_ids", "completion_mask")):
            assert _unpadded(d[ids], d[mask]) == _unpadded(g[ids][rows], g[mask][rows]), ids
        assert torch.equal(d["rewards"], g["rewards"][rows])
        torch.testing.assert_close(d["advantages"], g["advantages"][rows], rtol=0, atol=0)
        assert torch.equal(weights, (1 / cut.pi[cut.accepted]).repeat_interleave(4))
        assert int(cut.accepted.sum()) == (4 if cut.normalizer is None else 2)  # nothing known: every candidate
    assert cut_any


def test_under_the_cut_the_completion_budget_counts_grpos_rows(tmp_path, tiny_model_dir, small_dataset):
    """completion_keep_rate 0.25 of GRPO's 16 rows is 4 rows: 0.5 of the 8 accepted ones (the design's rate)."""
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, small_dataset, reward=random_reward, prompt_keep_rate=0.5,
                    completion_keep_rate=0.25, per_device_train_batch_size=16, max_steps=2)
    logs = [h for h in trainer.state.log_history if "dppo/keep_rate" in h]
    assert len(logs) == 2 and all(h["dppo/keep_rate"] == 0.5 for h in logs)
    assert all(h["dppo/expected_keep_fraction"] == pytest.approx(0.5) for h in logs)


def test_the_cut_composes_with_prefix_sharing(tmp_path, tiny_model_dir, small_dataset, exact_logprobs):
    """The cut with the probe, completion pruning, packing and prefix sharing, float64: each accepted group's kept
    rows share their prompt (tokens saved), and the run ends where the same run with repeated prompts does."""
    runs = [train(DPPOTrainer, tmp_path / str(sharing), tiny_model_dir, small_dataset, reward=random_reward,
                  prompt_keep_rate=0.5, max_steps=3, prefix_sharing=sharing, **float64_settings())
            for sharing in (True, False)]
    saved = [h["dppo/prefix_tokens_saved"] for h in runs[0].state.log_history if "dppo/prefix_tokens_saved" in h]
    assert saved and min(saved) > 0
    assert all(h.get("dppo/prompt_accepted_fraction", 0.5) == 0.5 for h in runs[0].state.log_history)
    for name, p in params_of(runs[1]).items():
        torch.testing.assert_close(params_of(runs[0])[name], p, rtol=1e-9, atol=1e-12)


def test_resume_reproduces_the_cut(tmp_path, tiny_model_dir, small_dataset):
    """Stopped at step 2 and resumed: the same candidates, acceptance sets, weights and parameters as a run
    without a stop (the draw is seeded by the training position; the history is in the checkpoint)."""
    cls = recording(record_prompts=True, record_prompt_decisions=True)
    settings = dict(max_steps=6, prompt_score="ema", prompt_probe_generations=0, per_device_train_batch_size=8,
                    scale_rewards="none")  # mean |A| then varies with the spread of the rewards
    # Each prompt 4 times in one epoch of 8 steps: the history (kept per prompt) sets pi within the epoch. (After a
    # resume in a later epoch the data order is TRL's, which differs from an uninterrupted run for GRPO too.)
    small_dataset = concatenate_datasets([small_dataset.select(range(4))] * 4)
    whole = cls(tiny_model_dir, random_reward, args=prompt_config(tmp_path / "whole", **settings),
                train_dataset=small_dataset)
    whole.train()
    first = cls(tiny_model_dir, random_reward, args=prompt_config(tmp_path / "split", **settings),
                train_dataset=small_dataset, callbacks=[StopAt(3)])
    first.train()
    second = cls(tiny_model_dir, random_reward, args=prompt_config(tmp_path / "split", **settings),
                 train_dataset=small_dataset)
    second.train(resume_from_checkpoint=str(tmp_path / "split" / "out" / "checkpoint-3"))
    assert first.prompts_seen + second.prompts_seen == whole.prompts_seen
    decisions = [(d[2].accepted.tolist(), d[2].pi.tolist()) for d in first.prompt_decisions + second.prompt_decisions]
    assert decisions == [(d[2].accepted.tolist(), d[2].pi.tolist()) for d in whole.prompt_decisions]
    assert any(min(pi) < 0.5 or max(pi) > 0.5 for _, pi in decisions[3:])  # the history set unequal pi
    for name, p in params_of(whole).items():
        torch.testing.assert_close(params_of(second)[name], p, rtol=1e-5, atol=1e-6)


def weighted_rewards(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_trls_own_test_shapes_run(tmp_path, tiny_model_dir, small_dataset, loss_type):
    """TRL's ``test_train_loss_types`` shape (3 completions a prompt, a per-device batch of 3,
    gradient_accumulation_steps 2: 2 candidates a step, 1 accepted), an epoch that does not divide into batches,
    two weighted reward functions: it trains, each step accepts one group, and the last log has every
    ``rewards/<func>/mean``, as GRPO's has."""
    args = cpu_config(tmp_path, loss_type=loss_type, prompt_keep_rate=0.5, num_generations=3,
                      per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=-1, num_train_epochs=1,
                      reward_weights=[1.0, 0.5])
    trainer = recording(record_prompt_decisions=True)(tiny_model_dir, [coarse_reward, weighted_rewards], args=args,
                                                      train_dataset=small_dataset.select(range(7)))
    trainer.train()
    assert trainer.state.global_step == 3  # 7 prompts, 2 a step: TRL's sampler drops the last one, as for GRPO
    assert [int(cut.accepted.sum()) for *_, cut in trainer.prompt_decisions] == [1, 1, 1]
    last = [h for h in trainer.state.log_history if "reward" in h][-1]
    assert {"rewards/coarse_reward/mean", "rewards/weighted_rewards/mean"} <= set(last)


def test_trls_prepare_inputs_test_shape_runs(tmp_path, tiny_model_dir, small_dataset):
    """TRL's ``test_prepare_input_called_with_correct_data`` shape: gradient_accumulation_steps 3 < spg 4, 4
    completions a prompt, a per-device batch of 6, num_iterations 2, no shuffle: it trains its 6 steps, and every
    generation batch generates 3 of its 6 candidates."""
    trainer = train(recording(record_prompt_decisions=True), tmp_path, tiny_model_dir, small_dataset,
                    reward=random_reward, prompt_keep_rate=0.5, gradient_accumulation_steps=3, steps_per_generation=4,
                    num_generations=4, per_device_train_batch_size=6, num_iterations=2, shuffle_dataset=False,
                    max_steps=6)
    assert trainer.state.global_step == 6
    accepted = [int(cut.accepted.sum()) for *_, cut in trainer.prompt_decisions]
    assert len(accepted) >= 2 and set(accepted) == {3}


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_every_candidate_accepted_is_grpos_step_and_runs_no_probe(tmp_path, tiny_model_dir, small_dataset, loss_type,
                                                                  monkeypatch):
    """``m = P`` (rate 0.9 of 4 candidates, and TRL's one candidate a process at 0.5): no probe is generated, and
    the parameters and losses are those of the same run without the cut, bit for bit, for the token-count losses
    whose normalizer the probe's count replaced before (off by ``T/D - 1``)."""

    def no_probe(self, candidates):
        raise AssertionError("the probe ran where every candidate is accepted")

    monkeypatch.setattr(DPPOTrainer, "_probe", no_probe)
    for rate, rows in ((0.9, 16), (0.5, 4)):
        runs = [train(DPPOTrainer, tmp_path / f"{rate}-{cut}", tiny_model_dir, small_dataset, reward=random_reward,
                      loss_type=loss_type, prompt_keep_rate=rate if cut else 1.0, per_device_train_batch_size=rows,
                      max_steps=2) for cut in (True, False)]
        assert losses_of(runs[0]) == losses_of(runs[1])
        for name, p in params_of(runs[1]).items():
            assert torch.equal(params_of(runs[0])[name], p), name


def test_the_weights_keep_the_losss_dtype(tmp_path, tiny_model_dir, small_dataset):
    """A float64 run: each row's weight reaches the loss in float64, exactly ``1 / pi`` of its group (a float32
    cast left 3e-8 where ``1 / pi`` is not a float32 number)."""
    trainer = train(recording(batch_keys=("dppo_weight",), record_prompt_decisions=True), tmp_path, tiny_model_dir,
                    concatenate_datasets([small_dataset.select(range(4))] * 4), reward=random_reward,
                    prompt_keep_rate=0.5, prompt_score="ema", prompt_probe_generations=0, completion_keep_rate=1.0,
                    per_device_train_batch_size=8, scale_rewards="none", max_steps=6, **float64_settings())
    unequal = 0
    for record, (weights, _, cut) in zip(trainer.records, trainer.prompt_decisions):
        assert record["dppo_weight"].dtype == torch.float64
        assert torch.equal(record["dppo_weight"], weights)
        unequal += int(any(w != float(torch.tensor(w, dtype=torch.float32)) for w in weights.tolist()))
    assert unequal  # some 1 / pi is not a float32 number


def test_trls_mask_truncated_completions_test_shape_runs(tmp_path, tiny_model_dir, small_dataset, monkeypatch):
    """TRL's ``test_train_with_mask_truncated_completions`` shape: 3 completions a prompt, a per-device batch of 3
    (one candidate a process: the cut accepts it, no probe) and a generation stand-in that returns TRL's three
    fixed completions whatever it is asked (one truncated). It trains as the run without the cut does, and each
    step generates its 3 rows in one call."""
    calls = []

    def three_fixed(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append(len(prompt_ids))
        eos = self.eos_token_ids[0]
        return [[20, 21, 22, 23, 24, 25], [26, 27, eos], [28, 29, 30, 31, 32, eos]][: len(prompt_ids)], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", three_fixed)
    runs = [train(DPPOTrainer, tmp_path / str(rate), tiny_model_dir, small_dataset, reward=random_reward,
                  loss_type="dapo", prompt_keep_rate=rate, num_generations=3, per_device_train_batch_size=3,
                  max_completion_length=6, mask_truncated_completions=True, max_steps=2) for rate in (0.5, 1.0)]
    assert calls == [3] * 4
    for name, p in params_of(runs[1]).items():
        assert torch.equal(params_of(runs[0])[name], p), name


def test_every_completion_masked_trains_without_error(tmp_path, tiny_model_dir, small_dataset):
    """``mask_truncated_completions`` with completions that are all truncated: no loss token anywhere, the token
    count fixed before the draw is 0 (the probe saw only truncated completions); the step is 0, not an error."""
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, small_dataset, reward=constant_reward, prompt_keep_rate=0.5,
                    mask_truncated_completions=True, max_completion_length=1, max_steps=2)
    assert trainer.state.global_step == 2


def test_a_streaming_dataset_trains_with_the_probe(tmp_path, tiny_model_dir, small_dataset):
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, small_dataset.to_iterable_dataset(), reward=coarse_reward,
                    prompt_keep_rate=0.5, max_steps=2)
    logs = [h for h in trainer.state.log_history if "dppo/prompt_generated_fraction" in h]
    assert len(logs) == 2 and logs[0]["dppo/prompt_generated_fraction"] == pytest.approx((2 * 2 + 1 * 2) / 8)


def test_keep_rate_one_is_the_core_trainer_bit_for_bit(tmp_path, tiny_model_dir, small_dataset):
    runs = [
        train(DPPOTrainer, tmp_path / name, tiny_model_dir, small_dataset, reward=coarse_reward, max_steps=3, **extra)
        for name, extra in (("a", {}), ("b", {"prompt_keep_rate": 1.0}))
    ]
    assert runs[1].prompt_cutter.history is None
    for name, p in params_of(runs[0]).items():
        assert torch.equal(p, params_of(runs[1])[name])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(prompt_keep_rate=0.0), "prompt_keep_rate"),
        (dict(prompt_keep_rate=1.2), "prompt_keep_rate"),
        (dict(prompt_keep_rate=0.5, prompt_keep_floor=0.0), "prompt_keep_floor"),
        (dict(prompt_keep_rate=0.5, prompt_keep_floor=2.0), "prompt_keep_floor"),
        (dict(prompt_keep_rate=0.5, prompt_history_decay=1.0), "prompt_history_decay"),
        (dict(prompt_keep_rate=0.5, prompt_score="last"), "prompt_score"),
        (dict(prompt_keep_rate=0.5, prompt_probe_generations=1), "prompt_probe_generations"),
        (dict(prompt_keep_rate=0.5, prompt_probe_generations=8, num_generations=8), "prompt_probe_generations"),
        (dict(prompt_keep_rate=0.5, prompt_score="ema", prompt_probe_generations=2), "prompt_probe_generations"),
        (dict(prompt_keep_rate=0.5, prompt_probe_generations=-1), "prompt_probe_generations"),
    ],
)  # (valid but unused while prompt pruning is off: a warning, tests/test_config.py)
def test_bad_prompt_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        validation_config(**kwargs)


def test_the_probe_is_refused_with_tools_and_a_rollout_function(tmp_path, tiny_model_dir, small_dataset):
    def tool(x: int) -> int:
        """A tool.

        Args:
            x: a number.
        """
        return x

    for extra in (dict(tools=[tool], processing_class=tool_tokenizer()),
                  dict(rollout_func=lambda prompts, trainer: {})):
        with pytest.raises(ValueError, match="prompt_probe_generations"):
            DPPOTrainer(tiny_model_dir, coarse_reward, args=prompt_config(tmp_path), train_dataset=small_dataset,
                        **extra)
    # One candidate a process: nothing is cut, no probe runs, nothing to refuse.
    DPPOTrainer(tiny_model_dir, coarse_reward, args=prompt_config(tmp_path, per_device_train_batch_size=4),
                train_dataset=small_dataset, tools=[tool], processing_class=tool_tokenizer())


def tool_tokenizer():
    """The toy tokenizer with TRL's Qwen3 chat template, which renders tool calls (TRL checks it first)."""
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = build_tokenizer()
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


class CountingEnvironment:
    """A TRL environment (``environment_factory``): ``reset`` gives no prompt text, a tool counts."""

    def reset(self, **kwargs):
        return None

    def count(self, n: int) -> int:
        """Count.

        Args:
            n: a number.
        """
        return n + 1


def test_trls_own_environment_checks_come_before_the_probes_refusal(tmp_path, tiny_model_dir):
    """Without a dataset, TRL asks for ``max_steps`` first (its message, not DPPO's)."""
    with pytest.raises(ValueError, match="max_steps"):
        DPPOTrainer(tiny_model_dir, coarse_reward, args=prompt_config(tmp_path, max_steps=-1),
                    environment_factory=CountingEnvironment, processing_class=tool_tokenizer())
    with pytest.raises(ValueError, match="prompt_probe_generations"):
        DPPOTrainer(tiny_model_dir, coarse_reward, args=prompt_config(tmp_path, max_steps=2),
                    environment_factory=CountingEnvironment, processing_class=tool_tokenizer())
