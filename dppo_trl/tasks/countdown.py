"""A reasoning-shaped offline task: count down by 7 in writing. ``"58="`` -> ``"58,51,44,37,30,23,16,9,2#2"``.

The answer after ``#`` needs the whole written chain, one step per number, so the completion length grows with
the start (about 4 characters per step): starts drawn with probability proportional to ``1 / start`` give
long-tailed lengths (a few characters to about 200, the median far below the maximum). A tiny model learns the
step fast (it depends only on the previous number) but errs more often the longer the chain: short prompts end
up always solved, the longest never, so many groups have zero reward variance and the mix shifts with training.
Nothing here touches the Hub.
"""

from __future__ import annotations

import random

import torch

from .toy import answers_correct, build_tiny_model, build_tokenizer, exact_answer_reward, supervised_steps

STEP = 7
SMALLEST_START, LARGEST_START = 8, 360


def countdown(start: int) -> str:
    """The written chain ``start, start - 7, ...`` down to the first value below 7, then ``#`` and that value."""
    values = list(range(start, -1, -STEP))
    return ",".join(map(str, values)) + f"#{values[-1]}"


# 1.0 when the completion, stripped, is exactly the whole chain (the `answer` column), else 0.0.
countdown_reward = exact_answer_reward


def training_draws(starts: list[int], size: int, rng: random.Random) -> list[int]:
    """``size`` draws (with repeats) from ``starts`` with probability proportional to ``1 / start``: the task's
    distribution, under which most chains are short and a few are long."""
    return rng.choices(starts, weights=[1.0 / s for s in starts], k=size)


def countdown_splits(
    train_size: int = 512, heldout_fraction: float = 0.25, seed: int = 0, low: int = SMALLEST_START,
    high: int = LARGEST_START,
) -> tuple[list[int], list[int]]:
    """(train starts, held-out starts): the starts ``low..high`` split at random into disjoint sets; the
    training list is ``train_size`` ``training_draws`` from the training starts; the held-out list is every
    held-out start once, in increasing order (``training_draws`` of it give an evaluation set of the same law)."""
    rng = random.Random(seed)
    starts = list(range(low, high + 1))
    rng.shuffle(starts)
    cut = max(1, int(len(starts) * heldout_fraction))
    heldout, train = sorted(starts[:cut]), starts[cut:]
    return training_draws(train, train_size, rng), heldout


def warm_start_starts(size: int = 4096, seed: int = 0, low: int = SMALLEST_START, high: int = LARGEST_START):
    """``size`` draws over EVERY start (held-out ones too, as pretraining would have seen them) with probability
    proportional to ``1 / start``: the supervised warm start's examples. Held out means held out from RL."""
    return training_draws(list(range(low, high + 1)), size, random.Random(seed))


def countdown_dataset(starts: list[int]):
    """A ``datasets.Dataset`` of plain-text prompts ``"start="`` with the ``answer`` column the reward reads."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{s}=" for s in starts], "answer": [countdown(s) for s in starts]})


def max_completion_tokens(high: int = LARGEST_START) -> int:
    """Characters (= tokens of the character tokenizer) of the longest chain plus eos."""
    return len(countdown(high)) + 1


def heldout_accuracy(model, tokenizer, starts: list[int], greedy: bool = True, samples: int = 1) -> float:
    """Fraction of ``starts`` (repeats count as often as they appear) whose whole chain the model writes exactly:
    greedy, or the mean over ``samples`` completions at temperature 1."""
    rows = [s for s in starts for _ in range(1 if greedy else samples)]
    prompts, answers = [f"{s}=" for s in rows], [countdown(s) for s in rows]
    correct = answers_correct(model, tokenizer, prompts, answers, greedy, max_completion_tokens(max(rows)), 128)
    return sum(correct) / max(len(correct), 1)


def warm_start(directory, heldout_starts: list[int], sft_steps: int = 300, hidden_size: int = 128,
               num_layers: int = 2, lr: float = 3e-3, seed: int = 0) -> dict:
    """A character Qwen2 warm-started with ``sft_steps`` supervised steps (batch 32) on ``warm_start_starts``,
    saved with its tokenizer to ``directory``; returns its last loss and greedy held-out accuracy."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size, num_layers, seed, max_positions=max_completion_tokens() + 64)
    examples = [(f"{s}=", countdown(s)) for s in warm_start_starts(seed=seed)]
    with torch.random.fork_rng():
        loss = supervised_steps(model, tokenizer, examples, sft_steps, batch_size=32, lr=lr, seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return {"loss": loss, "heldout_accuracy": heldout_accuracy(model, tokenizer, heldout_starts)}
