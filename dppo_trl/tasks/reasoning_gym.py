"""reasoning-gym as a data source: any of its procedural tasks by name, as a conversational prompt dataset, and a
reward that scores each completion with the task's own ``score_answer`` on the answer extracted from it.

    from dppo_trl.tasks.reasoning_gym import reasoning_gym_dataset, reasoning_gym_reward
    train = reasoning_gym_dataset("chain_sum", size=512, seed=0, answer_format="last_number",
                                  min_terms=2, max_terms=2, min_digits=1, max_digits=2)
    DPPOTrainer(model, reward_funcs=reasoning_gym_reward, train_dataset=train, ...)

Each row carries the task, its generator options, seed, size and index; the reward rebuilds that dataset (once per
process) and scores with the generator's own entry, so nothing of the entry is lost to serialization. How the
answer is read from a completion is a choice by name (``ANSWER_FORMATS``): reasoning-gym's own ``<answer>`` tag, or
the last number (small instruct models answer in sentences; the strict score then gives almost nothing). Needs
``pip install "dppo-trl[reasoning-gym]"``. From a recipe: the ``reasoning_gym_*`` keys of ``dppo-trl``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _answer_tag(text: str) -> str | None:
    from reasoning_gym.utils import extract_answer

    return extract_answer(text)


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


# How an answer is read from a completion's text (None: no answer, score 0).
ANSWER_FORMATS: dict[str, Callable[[str], str | None]] = {
    "answer_tag": _answer_tag,  # the last <answer>...</answer>, as reasoning-gym's own prompts ask
    "last_number": _last_number,  # the last integer or decimal (thousands separators dropped)
    "last_line": _last_line,
    "full": lambda text: text.strip(),
}
# The instruction appended to each question unless one is given.
DEFAULT_INSTRUCTIONS = {
    "answer_tag": "Give your final answer between <answer> and </answer>.",
    "last_number": "Give only the final answer.",
    "last_line": "Give the final answer on the last line.",
    "full": "Give only the final answer.",
}


def check_answer_format(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}.")


def check_task(task: str) -> None:
    """A ValueError that lists the valid names when reasoning-gym has no task ``task`` (an ImportError that
    names the extra when reasoning-gym is not installed)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as error:
        raise ImportError('reasoning-gym is not installed: pip install "dppo-trl[reasoning-gym]"') from error
    if task not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {task!r}; its tasks: {', '.join(sorted(DATASETS))}.")


@functools.lru_cache(maxsize=32)
def _generator(task: str, options_json: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(options_json))


def reasoning_gym_dataset(
    task: str,
    size: int = 1000,
    seed: int = 0,
    answer_format: str = "answer_tag",
    instruction: str | None = None,
    system_prompt: str | None = None,
    **options,
):
    """A ``datasets.Dataset`` of ``size`` entries of reasoning-gym's ``task`` (generator ``options`` such as
    ``min_terms=2``): a conversational ``prompt`` (the question, then ``instruction``, default per answer format;
    an optional system message, else the chat template's own), the reference ``answer``, and the ``rg_*`` columns
    the reward reads. The same arguments give the same rows."""
    from datasets import Dataset

    check_task(task)
    check_answer_format(answer_format)
    options_json = json.dumps(options, sort_keys=True)
    generator = _generator(task, options_json, seed, size)
    instruction = DEFAULT_INSTRUCTIONS[answer_format] if instruction is None else instruction
    rows = []
    for index in range(size):
        entry = generator[index]
        user = f"{entry['question']} {instruction}".strip()
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        rows.append(
            {
                "prompt": system + [{"role": "user", "content": user}],
                "answer": str(entry["answer"]),
                "rg_task": task,
                "rg_options": options_json,
                "rg_seed": seed,
                "rg_size": size,
                "rg_index": index,
                "rg_answer_format": answer_format,
            }
        )
    return Dataset.from_list(rows)


def completion_text(completion) -> str:
    """The text of a completion: a plain string, or the content of a conversational completion's last message."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def score(text: str, task: str, options_json: str, seed: int, size: int, index: int, answer_format: str) -> float:
    """The task's own ``score_answer`` on the answer ``answer_format`` reads from ``text`` (0 when none)."""
    generator = _generator(task, options_json, int(seed), int(size))
    answer = ANSWER_FORMATS[answer_format](text)
    return 0.0 if answer is None else float(generator.score_answer(answer, generator[int(index)]))


def reasoning_gym_reward(
    completions, rg_task, rg_options, rg_seed, rg_size, rg_index, rg_answer_format, **kwargs
) -> list[float]:
    """TRL reward function for rows of ``reasoning_gym_dataset``: each completion scored by its task."""
    rows = zip(completions, rg_task, rg_options, rg_seed, rg_size, rg_index, rg_answer_format)
    return [score(completion_text(c), *rest) for c, *rest in rows]
