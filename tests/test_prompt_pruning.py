"""Prompt-level pruning before rollout: history, acceptance, unbiasedness of the sampler, the trainer wiring,
checkpoint and resume."""

import itertools
import math

import pytest
import torch
from conftest import StopAt, coarse_reward, cpu_config
from test_trainer import RecordingTrainer, params_of
from trl.trainer.utils import RepeatSampler

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.prompts import PromptPruningSampler, prompt_acceptance_probabilities, update_history
from dppo_trl.toy import addition_dataset, addition_pairs


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
    sampler.update(range(8), [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0])  # two prompts get q = 1
    q = sampler.acceptance()
    always = [i for i in range(8) if q[i] == 1.0]
    assert always == [6, 7]
    for _ in range(30):
        sampler.decisions.clear()
        accepted = {i for i in sampler}
        assert set(always) <= accepted


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


def test_sampler_steps_are_unbiased_statistically():
    """The sampler itself, over many epochs with a fixed history (1 prompt per step): the mean weighted
    per-step gradient matches GRPO's per-step expectation, the dataset mean, within 4 standard errors."""
    n = 6
    g = _gradient_table(n)
    sampler = make_sampler(n=n, batch=1)
    list(sampler)  # epoch 1: all unseen
    sampler.update(range(n), [0.0, 0.1, 0.4, 1.0, 2.0, 0.2])
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


@pytest.fixture(scope="module")
def small_dataset():
    return addition_dataset(addition_pairs(seed=0)[0][:16])


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


class PromptRecorder(RecordingTrainer):
    def _generate_and_score_completions(self, inputs):
        self.__dict__.setdefault("prompts_seen", []).append([x["prompt"] for x in inputs])
        return super()._generate_and_score_completions(inputs)


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
    runs = []
    for name, extra in (("a", {}), ("b", {"prompt_keep_rate": 1.0})):
        args = cpu_config(tmp_path / name, max_steps=3, **extra)
        trainer = DPPOTrainer(tiny_model_dir, coarse_reward, args=args, train_dataset=small_dataset)
        trainer.train()
        runs.append(trainer)
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
    ],
)  # (valid but unused while prompt pruning is off: a warning, tests/test_config.py)
def test_bad_prompt_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DPPOConfig(output_dir="unused", bf16=False, use_cpu=True, report_to=[], **kwargs)


def test_streaming_datasets_are_refused(tmp_path, tiny_model_dir, small_dataset):
    with pytest.raises(ValueError, match="prompt_keep_rate"):
        DPPOTrainer(
            tiny_model_dir,
            coarse_reward,
            args=prompt_config(tmp_path, max_steps=2),
            train_dataset=small_dataset.to_iterable_dataset(),
        )
