"""Prompt-level pruning before rollout: history, acceptance, unbiasedness of the sampler, the trainer wiring,
checkpoint and resume."""

import itertools
import math

import pytest
import torch
from support.configs import cpu_config, validation_config
from support.models import addition_prompts
from support.recording import BATCH_KEYS, recording
from support.rewards import coarse_reward
from support.training import StopAt, params_of, train
from trl.trainer.utils import RepeatSampler

from dppo_trl import DPPOTrainer
from dppo_trl.core.prompts import (
    PromptPruningSampler,
    history_cell,
    prompt_acceptance_probabilities,
    register_prompt_score,
    update_history,
)


def test_history_is_an_exponential_moving_average():
    scores, seen = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.bool)
    update_history(scores, seen, [1], [0.8], decay=0.5)
    assert scores.tolist() == [0.0, 0.8, 0.0] and seen.tolist() == [False, True, False]
    update_history(scores, seen, [1, 2], [0.2, 0.0], decay=0.5)
    assert scores.tolist() == pytest.approx([0.0, 0.5, 0.0])
    assert seen.tolist() == [False, True, True]


def test_acceptance_is_one_for_unseen_prompts_and_calibrated_on_seen_ones():
    scores = torch.tensor([0.0, 0.1, 0.5, 1.0, 2.0, 0.0], dtype=torch.float64)
    seen = torch.tensor([True, True, True, True, True, False])
    q = prompt_acceptance_probabilities(scores, seen, keep_rate=0.5, keep_floor=0.1)
    assert q[5] == 1.0
    assert float(q[seen].mean()) == pytest.approx(0.5)
    assert q[0] == pytest.approx(0.1)  # a prompt that taught nothing keeps the floor
    assert torch.all(torch.diff(q[:5]) >= 0)


def make_sampler(n=6, batch=1, **kwargs):
    args = dict(
        num_prompts=n,
        group_size=2,
        prompts_per_batch=batch,
        repeat_count=1,
        keep_rate=0.5,
        keep_floor=0.1,
        history_decay=0.0,
        seed=3,
        accept_seed=4,
    )
    args.update(kwargs)
    return PromptPruningSampler(**args)


def test_first_epoch_accepts_everything_in_repeat_samplers_order():
    sampler = make_sampler(n=10, batch=2, repeat_count=3)
    reference = RepeatSampler(range(10), mini_repeat_count=2, batch_size=2, repeat_count=3, shuffle=True, seed=3)
    for _ in range(2):  # nothing seen: q = 1 everywhere, nothing skipped, epoch after epoch in the same order
        assert list(sampler) == list(reference)
    assert len(sampler) == len(reference)


def test_prompts_with_q_one_are_never_skipped():
    sampler = make_sampler(n=8)
    list(sampler)
    sampler.update(range(8), [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0], [3.0] * 8)  # two prompts get q = 1
    q = sampler.acceptance()
    always = [i for i in range(8) if q[i] == 1.0]
    assert always == [6, 7]
    for _ in range(30):
        sampler.decisions.clear()
        accepted = {i for i in sampler}
        assert set(always) <= accepted


def test_a_groups_cell_is_flat_or_spread_times_its_reward_bin():
    assert history_cell(0.0, 0.0, 0.0, 1.0) == 1  # every completion failed: flat, lowest bin
    assert history_cell(0.0, 1.0, 0.0, 1.0) == 7  # every completion solved: flat, highest bin
    assert history_cell(0.9, 0.375, 0.0, 1.0) == 2  # spread, second bin
    assert history_cell(0.5, 0.875, 0.0, 1.0) == 6
    assert history_cell(0.5, float("nan"), 0.0, 1.0) == 0 and history_cell(0.0, 0.3, 0.3, 0.3) == 1


def _revisited(score="calibrated", **kwargs):
    """Four prompts seen twice on rewards in [0, 1]: prompt 0 failed every time then spread (1.0), prompt 1
    spread then solved (0.0), prompt 2 solved twice (0.0), prompt 3 seen once (spread)."""
    sampler = make_sampler(n=4, score=score, **kwargs)
    sampler.update([0, 1, 2, 3], [0.0, 0.8, 0.0, 0.7], [3.0] * 4, [0.0, 0.5, 1.0, 0.875])
    sampler.update([0, 1, 2], [1.0, 0.0, 0.0], [3.0] * 3, [0.5, 1.0, 1.0])
    return sampler


def test_the_calibrated_score_is_what_the_cell_of_the_last_group_got_at_the_next_visit():
    sampler = _revisited()
    flat_low, spread_mid, flat_high = 1, 4, 7
    assert sampler.calibration_seen.nonzero().flatten().tolist() == [flat_low, spread_mid, flat_high]
    assert sampler.calibration[[flat_low, spread_mid, flat_high]].tolist() == [1.0, 0.0, 0.0]
    assert sampler.cells.tolist() == [spread_mid, flat_high, flat_high, 6]
    # Prompt 0 now sits in a cell whose next visit scored 0, prompt 3 in a cell never revisited: no prediction,
    # q = 1 like a prompt never seen. The ema score knows only each prompt's own past.
    q = sampler.acceptance()
    assert q[3] == 1.0 and q[0] == q[1] == q[2]
    ema = _revisited("ema").acceptance()
    assert ema[0] > ema[3] > ema[1] == ema[2]
    sampler.update([1], [0.0], [3.0], [1.0])  # a cell's moving average of the next visit's mean |A|
    sampler.update([0], [0.9], [3.0], [0.5])
    assert float(sampler.calibration[spread_mid]) == pytest.approx(0.8 * 0.0 + 0.2 * 0.9)


def test_prompt_scores_refuse_a_taken_name_and_an_unknown_one():
    with pytest.raises(ValueError, match="'ema' is taken"):
        register_prompt_score("ema")(lambda sampler: (sampler.scores, sampler.seen))
    with pytest.raises(ValueError, match="prompt_score='last'.*'ema', 'calibrated'"):
        make_sampler(score="last")


def _gradient_table(n):
    return torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))


def test_epoch_sum_is_exactly_unbiased_over_all_acceptance_outcomes():
    """For a fixed history and order, enumerate every accept/reject outcome of one epoch: the expected weighted
    sum of per-prompt gradients is q_bar times GRPO's epoch sum, and the expected number of steps is q_bar
    times GRPO's, so a step's expected gradient equals GRPO's."""
    n = 5
    g = _gradient_table(n)
    scores = torch.tensor([0.0, 0.3, 0.9, 2.0, 0.05], dtype=torch.float64)
    q = prompt_acceptance_probabilities(scores, torch.ones(n, dtype=torch.bool), 0.5, 0.1)
    q_bar = float(q.mean())
    expected_sum, expected_steps = torch.zeros(3, dtype=torch.float64), 0.0
    for outcome in itertools.product([False, True], repeat=n):
        prob = math.prod(float(q[i]) if a else 1 - float(q[i]) for i, a in enumerate(outcome))
        accepted = [i for i, a in enumerate(outcome) if a]
        expected_sum += prob * sum((q_bar / float(q[i]) * g[i] for i in accepted), torch.zeros(3, dtype=torch.float64))
        expected_steps += prob * len(accepted)
    torch.testing.assert_close(expected_sum, q_bar * g.sum(0))
    assert expected_steps == pytest.approx(q_bar * n)
    torch.testing.assert_close(expected_sum / expected_steps, g.mean(0))


@pytest.mark.parametrize("score", ["ema", "calibrated"])
def test_sampler_steps_are_unbiased_statistically(score):
    """The sampler itself, over many epochs with a fixed history (1 prompt per step): the mean weighted
    per-step gradient matches GRPO's per-step expectation, the dataset mean, within 4 standard errors."""
    n = 6
    g = _gradient_table(n)
    sampler = make_sampler(n=n, batch=1, score=score)
    list(sampler)  # epoch 1: all unseen
    rewards = [0.0, 0.25, 0.5, 1.0, 0.75, 1.0]
    sampler.update(range(n), [0.0, 0.1, 0.4, 1.0, 2.0, 0.0], [5.0] * n, rewards)
    sampler.update(range(n), [0.3, 0.1, 0.4, 0.0, 2.0, 0.0], [5.0] * n, rewards)
    assert len(set(sampler.acceptance().tolist())) >= 2  # prompts are skipped at different rates
    sampler.update = lambda *a, **k: None  # freeze the history
    estimates = []
    for _ in range(3000):
        list(sampler)  # n batches (the unpruned epoch length), walking on through the data epochs
        for number in sorted(sampler.decisions):
            batch = sampler.pop_decision(number)
            estimates.append(sum(w * g[i] for i, w in zip(batch["prompts"], batch["weights"])))
    estimates = torch.stack(estimates)
    mean, stderr = estimates.mean(0), estimates.std(0) / math.sqrt(len(estimates))
    assert torch.all((mean - g.mean(0)).abs() < 4 * stderr), (mean, g.mean(0), stderr)
    assert sampler.epoch > 1.3 * 3000  # it walked more data epochs than iterations: it did skip prompts


def _frozen_sampler(q, n=4, batch=2, group=2, **kwargs):
    """A sampler whose acceptance is the fixed ``q`` (every prompt seen, loss tokens 3 per completion)."""
    sampler = make_sampler(n=n, batch=batch, group_size=group, **kwargs)
    sampler.update(range(n), [1.0] * n, [3.0] * n)
    sampler.acceptance = lambda: q
    return sampler


def _with_draws(sampler, epochs_of_draws):
    """Replace the acceptance draw: epoch ``e`` accepts prompt ``i`` iff ``epochs_of_draws[e][i]``."""
    draws = iter(epochs_of_draws)
    sampler._accepted = lambda order, q: (lambda pattern: [bool(pattern[i]) for i in order])(next(draws))
    return sampler


def _pattern_probability(pattern, qs):
    return math.prod(float(q[i]) if a else 1.0 - float(q[i]) for draws, q in zip(pattern, qs)
                     for i, a in enumerate(draws))


def test_every_accepted_prompt_trains_once_and_the_per_step_ratio_is_exact():
    """4 prompts, 2 per batch, a fixed q, 3 epochs: every acceptance pattern enumerated (4096, float64). Each
    accepted prompt trains exactly once, in its epoch's batches or at the head of the next epoch's first one,
    except the run's final leftover (fewer than 2 prompts). So, counting that leftover, each prompt's expected
    weighted share per step is 2 / 4, GRPO's, exactly (dropping the incomplete batch, as the sampler did, gives
    shares from 0.39 to 0.65 here; without the leftover, 0.45 to 0.52)."""
    n, size, epochs = 4, 2, 3
    q = torch.tensor([1.0, 0.6, 0.3, 0.1], dtype=torch.float64)
    q_bar = float(q.mean())
    trained, leftover = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    steps = leftover_count = total = 0.0
    for flat in itertools.product([0, 1], repeat=n * epochs):
        pattern = [flat[e * n : (e + 1) * n] for e in range(epochs)]
        prob = _pattern_probability(pattern, [q] * epochs)
        sampler = _with_draws(_frozen_sampler(q, n, size), pattern)
        batches = [b for _ in range(epochs) for b in sampler._plan_epoch()]
        assert len(sampler.carry) < size
        taken = [i for b in batches for i in b["prompts"]] + [entry[0] for entry in sampler.carry]
        assert sorted(taken) == sorted(i for draws in pattern for i, a in enumerate(draws) if a)
        assert sum(b["walked"] for b in batches) + sampler.walk_owed == epochs * n  # data progress: every candidate
        for b in batches:
            for i, w in zip(b["prompts"], b["weights"]):
                trained[i] += prob * w
        for i, w, _ in sampler.carry:
            leftover[i] += prob * w
        steps += prob * len(batches)
        leftover_count += prob * len(sampler.carry)
        total += prob
    assert total == pytest.approx(1.0, rel=1e-12)
    torch.testing.assert_close(trained + leftover, torch.full((n,), epochs * q_bar, dtype=torch.float64),
                               rtol=1e-12, atol=0)
    assert steps * size + leftover_count == pytest.approx(epochs * q_bar * n, rel=1e-12)
    share = (trained + leftover) / (steps + leftover_count / size)
    torch.testing.assert_close(share, torch.full((n,), size / n, dtype=torch.float64), rtol=1e-12, atol=0)


def _expected_run(loss_type, normalizer_of):
    """Two epochs of the real sampler (4 prompts, 2 per batch, 2 completions each) over every acceptance pattern,
    with a history update between them that changes q and D (so the prompts carried into epoch 2 were normalized
    in epoch 1): ``(E[sum of the steps' terms + the final leftover's], the claim sum_e q_bar_e sum_j g_j / D_e)``.
    A step is ``sum_j w_j g_j / Z`` with ``Z`` the trainer's ``full_batch_normalizer`` of the batch's
    ``normalizer_of(batch, loss_tokens)`` (the count, and a factor per prompt)."""
    from dppo_trl.core.estimator import full_batch_normalizer

    n, size, group = 4, 2, 2
    g = torch.tensor([3.0, -1.0, 2.0, 0.5], dtype=torch.float64)  # each prompt's summed per-token (or per-row) term
    tokens = torch.tensor([[4, 6], [20, 30], [9, 1], [50, 40]], dtype=torch.float64)  # its completions' loss tokens
    expected, claim = 0.0, None
    for flat in itertools.product([0, 1], repeat=2 * n):
        pattern = [flat[:n], flat[n:]]
        sampler = make_sampler(n=n, batch=size, group_size=group, keep_rate=0.5, keep_floor=0.1)
        sampler.update(range(n), [0.0, 0.4, 1.0, 2.0], [7.0, 30.0, 4.0, 40.0])  # lengths: estimates, not exact
        qs, ds = [sampler.acceptance()], [sampler.normalizer()]
        _with_draws(sampler, pattern)
        batches = sampler._plan_epoch()
        sampler.update(range(n), [1.5, 0.0, 0.3, 0.8], [5.0, 20.0, 5.0, 60.0])  # fixed: not draw-dependent
        qs.append(sampler.acceptance())
        ds.append(sampler.normalizer())
        batches += sampler._plan_epoch()
        prob = _pattern_probability(pattern, qs)
        run = 0.0
        for b in batches:
            loss_tokens = tokens[b["prompts"]].flatten()
            count, factors = normalizer_of(b, loss_tokens)
            z = full_batch_normalizer(loss_type, size * group, 64, count, 1, 1, 1)
            run += sum(w * f * float(g[i]) for i, w, f in zip(b["prompts"], b["weights"], factors)) / z
        for i, w, d in sampler.carry:  # the final leftover, as it would train (its own D)
            run += w * float(g[i]) / full_batch_normalizer(loss_type, size * group, 64, d, 1, 1, 1)
        expected += prob * run
        per_step = [full_batch_normalizer(loss_type, size * group, 64, d, 1, 1, 1) for d in ds]
        claim = sum(float(q.mean()) * float(g.sum()) / z for q, z in zip(qs, per_step))
    return expected, claim


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_expected_step_is_grpos_numerator_over_the_planned_normalizer(loss_type):
    """Exact enumeration (256 patterns, float64): with the trainer's normalization
    (``estimator.prompt_pruning_normalization``), the expected sum of the steps' terms is
    ``sum_e q_bar_e x sum_j g_j / D_e`` (``dapo``: ``D_e`` the planned token count; ``grpo``: the rows), while the
    expected number of steps is ``sum_e q_bar_e x M / P``: per step, GRPO's expected numerator
    ``E[N_B] = (P / M) sum_j g_j`` over ``D_e``. The random prompt-weighted count (the previous normalizer) is
    off by a ratio estimate's bias; dropping the carried prompts' own normalizer is off too."""
    from dppo_trl.core.estimator import prompt_pruning_normalization, prompt_weighted_token_count

    def planned(batch, loss_tokens):
        return prompt_pruning_normalization(loss_type, batch["normalizer"], batch["normalizers"], loss_tokens)

    expected, claim = _expected_run(loss_type, planned)
    assert expected == pytest.approx(claim, rel=1e-12)
    if loss_type == "dapo":

        def weighted_count(batch, loss_tokens):
            w = torch.tensor(batch["weights"], dtype=torch.float64).repeat_interleave(2)
            return prompt_weighted_token_count(loss_tokens, w), [1.0] * len(batch["prompts"])

        def batch_d_only(batch, loss_tokens):
            return batch["normalizer"], [1.0] * len(batch["prompts"])

        for wrong in (weighted_count, batch_d_only):
            assert abs(_expected_run(loss_type, wrong)[0] / claim - 1) > 1e-3, wrong.__name__


def test_the_normalizer_is_fixed_before_the_acceptance_draw():
    """The planned D of an epoch's batches is the same whatever the acceptance draw (it is a function of the
    history only: P x G x the mean loss tokens per completion of the seen prompts), and so is the trainer's count;
    in an epoch with nothing seen it is None and the trainer counts the batch, as GRPO does."""
    from dppo_trl.core.estimator import prompt_pruning_normalization

    first = make_sampler(n=6, batch=2)
    batch = first._plan_epoch()[0]
    assert batch["normalizer"] is None and batch["normalizers"] == [None, None]
    tokens = torch.tensor([3.0, 5.0, 7.0, 9.0], dtype=torch.float64)
    assert prompt_pruning_normalization("dapo", None, [None, None], tokens) == (24.0, [1.0, 1.0])
    normalizers, counts = set(), set()
    for seed in range(40):
        sampler = make_sampler(n=6, batch=2, accept_seed=seed)
        sampler.update(range(5), [0.0, 0.1, 0.5, 1.0, 2.0], [3.0, 5.0, 10.0, 2.0, 6.0])  # prompt 5 unseen
        for b in sampler._plan_epoch():
            normalizers.update(b["normalizers"] + [b["normalizer"]])
            draws = torch.rand(4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 40
            counts.add(prompt_pruning_normalization("dapo", b["normalizer"], b["normalizers"], draws)[0])
    assert normalizers == counts == {2 * 2 * (3 + 5 + 10 + 2 + 6) / 5}


@pytest.mark.parametrize("score", ["ema", "calibrated"])
def test_sampler_state_round_trips_the_length_history_and_the_carry(score):
    """A resumed sampler plans the next epochs as the original does: the loss-token history, the calibration,
    the prompts carried over (with their weights and normalizers) and the walk owed are in its state (JSON, as in
    checkpoints)."""
    import json

    def build():
        sampler = make_sampler(n=7, batch=3, accept_seed=11, score=score)
        rewards = [0.0, 0.5, 0.25, 1.0, 0.75, 1.0, 0.5]
        for _ in range(2):
            sampler.update(range(7), [0.0, 0.2, 0.4, 1.0, 2.0, 0.1, 0.3], [3.0, 8.0, 1.0, 4.0, 9.0, 2.0, 5.0], rewards)
        return sampler

    original = build()
    for _ in range(6):  # plan until some prompts are carried over
        original.plan = original._plan_epoch()
        if original.carry:
            break
    assert original.carry
    original.update([0, 3], [0.5, 0.5], [11.0, 13.0], [0.5, 0.125])
    state = json.loads(json.dumps(original.state_dict(), allow_nan=False))
    resumed = build()
    resumed.load_state_dict(state, next_batch=original.batches_planned)
    assert torch.equal(resumed.lengths, original.lengths) and resumed.carry == original.carry
    assert torch.equal(resumed.calibration, original.calibration) and torch.equal(resumed.cells, original.cells)
    assert resumed.walk_owed == original.walk_owed and resumed.plan == original.plan
    for _ in range(3):
        assert resumed._plan_epoch() == original._plan_epoch()


@pytest.fixture(scope="module")
def small_dataset():
    return addition_prompts(16)


def prompt_config(tmp_path, **kwargs):
    base = dict(
        prompt_keep_rate=0.5,
        max_steps=-1,
        num_train_epochs=3,
        per_device_train_batch_size=8,
        num_generations=4,
        lr_scheduler_type="linear",
    )
    base.update(kwargs)
    return cpu_config(tmp_path, **base)


PromptRecorder = recording(batch_keys=BATCH_KEYS, record_prompts=True)


def test_epochs_are_passes_over_the_data_in_fewer_steps(tmp_path, tiny_model_dir, small_dataset):
    from transformers.trainer_callback import ProgressCallback

    trainer = PromptRecorder(
        tiny_model_dir, coarse_reward, args=prompt_config(tmp_path, disable_tqdm=False), train_dataset=small_dataset
    )
    bar_positions = []
    progress = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ProgressCallback))
    original_close = progress.on_train_end

    def record_then_close(*args, **kwargs):
        bar_positions.append((progress.training_bar.n, progress.training_bar.total))
        return original_close(*args, **kwargs)

    progress.on_train_end = record_then_close
    trainer.train()
    assert bar_positions == [(3 * 8, 3 * 8)]  # the progress bar ends full, like GRPO's
    assert trainer._prompt_sampler.epoch == 3
    assert trainer.state.global_step < 3 * 8  # GRPO: 16 prompts / 2 per step x 3 epochs
    assert len(trainer.prompts_seen) == trainer.state.global_step
    # The learning-rate schedule follows data progress: it ends with the last epoch, as GRPO's would.
    assert trainer.lr_scheduler.last_epoch == trainer.state.max_steps == 3 * 8
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    logs = [h for h in trainer.state.log_history if "dppo/prompt_q_bar" in h]
    assert logs[0]["dppo/prompt_q_bar"] == 1.0  # first epoch: nothing seen
    assert logs[-1]["dppo/prompt_q_bar"] < 1.0 and "dppo/prompt_weight_max" in logs[-1]


def test_keep_rate_one_is_the_core_trainer_bit_for_bit(tmp_path, tiny_model_dir, small_dataset):
    runs = [
        train(DPPOTrainer, tmp_path / name, tiny_model_dir, small_dataset, reward=coarse_reward, max_steps=3, **extra)
        for name, extra in (("a", {}), ("b", {"prompt_keep_rate": 1.0}))
    ]
    assert runs[1]._prompt_sampler is None
    for name, p in params_of(runs[0]).items():
        assert torch.equal(p, params_of(runs[1])[name])


def test_max_steps_runs_take_exactly_max_steps_across_pruned_epochs(tmp_path, tiny_model_dir, small_dataset):
    trainer = PromptRecorder(
        tiny_model_dir, coarse_reward, args=prompt_config(tmp_path, max_steps=28), train_dataset=small_dataset
    )
    trainer.train()
    # GRPO's epoch is 8 steps; the Trainer plans 4 epochs and each yields 8 steps, from more data epochs.
    assert trainer.state.global_step == len(trainer.prompts_seen) == 28
    assert trainer._prompt_sampler.epoch > 4


@pytest.mark.parametrize(
    "budget,stop",
    [
        ({}, 10),
        ({"max_steps": 28}, 13),
        ({"max_steps": 28, "prompt_score": "calibrated"}, 13),
        # each generation batch serves 2 iterations x 2 micro-steps: 2 optimizer steps; stop in the last epoch
        ({"max_steps": 12, "steps_per_generation": 2, "gradient_accumulation_steps": 2, "num_iterations": 2}, 10),
    ],
)
def test_resume_makes_the_same_decisions_as_an_uninterrupted_run(tmp_path, tiny_model_dir, small_dataset, budget, stop):
    """Epoch-based (stop inside the second, pruned, epoch) and max_steps (stop mid-way through the Trainer's
    second epoch, which is made of pruned data epochs)."""
    whole = PromptRecorder(
        tiny_model_dir, coarse_reward, args=prompt_config(tmp_path / "whole", **budget), train_dataset=small_dataset
    )
    whole.train()
    assert whole.state.global_step > stop
    if budget.get("prompt_score") == "calibrated":  # the trainer fed back rewards: revisits measured per cell
        assert whole._prompt_sampler.calibration_seen.any() and whole._prompt_sampler.reward_range is not None
    first = PromptRecorder(
        tiny_model_dir,
        coarse_reward,
        args=prompt_config(tmp_path / "split", **budget),
        train_dataset=small_dataset,
        callbacks=[StopAt(stop)],
    )
    first.train()
    assert first.state.global_step == stop
    second = PromptRecorder(
        tiny_model_dir, coarse_reward, args=prompt_config(tmp_path / "split", **budget), train_dataset=small_dataset
    )
    second.train(resume_from_checkpoint=str(tmp_path / "split" / "out" / f"checkpoint-{stop}"))
    assert first.prompts_seen + second.prompts_seen == whole.prompts_seen
    assert second.state.global_step == whole.state.global_step
    for name, p in params_of(whole).items():
        torch.testing.assert_close(params_of(second)[name], p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(prompt_keep_rate=0.0), "prompt_keep_rate"),
        (dict(prompt_keep_rate=1.2), "prompt_keep_rate"),
        (dict(prompt_keep_rate=0.5, prompt_keep_floor=0.0), "prompt_keep_floor"),
        (dict(prompt_keep_rate=0.5, prompt_keep_floor=2.0), "prompt_keep_floor"),
        (dict(prompt_keep_rate=0.5, prompt_history_decay=1.0), "prompt_history_decay"),
        (dict(prompt_keep_rate=0.5, prompt_history_decay=-0.1), "prompt_history_decay"),
        (dict(prompt_keep_rate=0.5, prompt_score="last"), "prompt_score"),
    ],
)  # (valid but unused while prompt pruning is off: a warning, tests/test_config.py)
def test_bad_prompt_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        validation_config(**kwargs)


def test_streaming_datasets_are_refused(tmp_path, tiny_model_dir, small_dataset):
    with pytest.raises(ValueError, match="prompt_keep_rate"):
        DPPOTrainer(
            tiny_model_dir,
            coarse_reward,
            args=prompt_config(tmp_path, max_steps=2),
            train_dataset=small_dataset.to_iterable_dataset(),
        )
