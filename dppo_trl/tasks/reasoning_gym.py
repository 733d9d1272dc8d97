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
``pip install ".[reasoning-gym]"`` in a checkout (README "Install"). From a recipe: the ``reasoning_gym_*`` keys
of ``dppo-trl``.

A completion the task cannot score scores 0.0 and never stops the run: no answer read from it, ``score_answer``
raising on what was read (some tasks raise on answers they cannot parse), or a score that is not a number (None,
NaN, a string); a finite score is clamped into [0, 1]. Each call logs, through TRL's ``log_metric``, the fraction of
its completions with no answer (``reasoning_gym/no_answer_fraction``) and the fraction the task could not score
(``reasoning_gym/unscorable_fraction``), and the first failure of each task is warned once, with the exception.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import warnings
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
        raise ImportError(
            'reasoning-gym is not installed: pip install reasoning-gym (or, in a dppo-trl checkout, pip install '
            '".[reasoning-gym]")'
        ) from error
    if task not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {task!r}; its tasks: {', '.join(sorted(DATASETS))}.")


@functools.lru_cache(maxsize=32)
def _generator(task: str, options_json: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(options_json))


@functools.lru_cache(maxsize=8192)
def _cached_entry(task: str, options_json: str, seed: int, size: int, index: int):
    return _generator(task, options_json, seed, size)[index]


def _entry(task: str, options_json: str, seed: int, size: int, index: int) -> dict:
    """Entry ``index`` of the generator, generated once: reasoning-gym generates an entry anew on each lookup (a
    knight_swap puzzle is solved again, about 0.7 s), and the reward looks one up per completion. A copy, so that
    a score_answer that changes its entry changes nothing cached."""
    return copy.deepcopy(_cached_entry(task, options_json, int(seed), int(size), int(index)))


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
    instruction = DEFAULT_INSTRUCTIONS[answer_format] if instruction is None else instruction
    rows = []
    for index in range(size):
        entry = _entry(task, options_json, seed, size, index)
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


# What became of a completion: scored by the task, no answer read from it, or the task could not score it.
SCORED, NO_ANSWER, UNSCORABLE = "scored", "no_answer", "unscorable"
NO_ANSWER_METRIC = "reasoning_gym/no_answer_fraction"
UNSCORABLE_METRIC = "reasoning_gym/unscorable_fraction"
_warned: set[tuple[str, str]] = set()  # (task, what failed): warned once per process


def _warn_once(task: str, what: str, detail: str) -> None:
    if (task, what) in _warned:
        return
    _warned.add((task, what))
    detail = detail if len(detail) <= 200 else detail[:200] + "..."
    warnings.warn(
        f"reasoning-gym task {task!r}: {detail}. Such completions score 0.0; the fraction is logged as "
        f"{NO_ANSWER_METRIC if what == 'extract' else UNSCORABLE_METRIC} (warned once per task).",
        RuntimeWarning,
        stacklevel=3,
    )


def _as_score(value) -> float | None:
    """A finite number clamped into [0, 1]; None for anything else (None, NaN, infinities, strings, ...)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        number = float(min(max(value, 0), 1)) if isinstance(value, int) else float(value)  # ints of any size
    except Exception:  # not a number (a list, a complex, ...)
        return None
    return min(max(number, 0.0), 1.0) if math.isfinite(number) else None


def _score(text, task: str, options_json: str, seed: int, size: int, index: int, answer_format: str):
    """``(score, outcome)``: the score in [0, 1] and SCORED, NO_ANSWER or UNSCORABLE (the last two score 0.0)."""
    generator = _generator(task, options_json, int(seed), int(size))
    extract = ANSWER_FORMATS[answer_format]
    entry = _entry(task, options_json, seed, size, index)
    try:
        answer = extract(text) if isinstance(text, str) else None  # None: a message without text content
    except Exception as error:  # a completion the extraction cannot read has no answer
        _warn_once(task, "extract", f"the {answer_format} extraction raised {type(error).__name__}: {error}")
        answer = None
    if answer is None:
        return 0.0, NO_ANSWER
    try:
        value = generator.score_answer(answer, entry)
    except Exception as error:  # the task cannot parse this answer (KeyboardInterrupt and the like still stop)
        _warn_once(task, "raise", f"score_answer raised {type(error).__name__}: {error}")
        return 0.0, UNSCORABLE
    result = _as_score(value)
    if result is None:
        _warn_once(task, "value", f"score_answer returned {value!r:.80}, not a finite number")
        return 0.0, UNSCORABLE
    return result, SCORED


def score(text: str, task: str, options_json: str, seed: int, size: int, index: int, answer_format: str) -> float:
    """The task's own ``score_answer`` on the answer ``answer_format`` reads from ``text``, clamped into [0, 1];
    0.0 when no answer is read or the task cannot score it (it raises, or gives no finite number)."""
    return _score(text, task, options_json, seed, size, index, answer_format)[0]


def reasoning_gym_reward(
    completions, rg_task, rg_options, rg_seed, rg_size, rg_index, rg_answer_format, log_metric=None, **kwargs
) -> list[float]:
    """TRL reward function for rows of ``reasoning_gym_dataset``: each completion scored by its task (0.0 for one
    it cannot score). With TRL's ``log_metric``, logs the fractions of this call's completions with no answer and
    that the task could not score (``NO_ANSWER_METRIC``, ``UNSCORABLE_METRIC``)."""
    rows = zip(completions, rg_task, rg_options, rg_seed, rg_size, rg_index, rg_answer_format)
    results = []
    for completion, *rest in rows:
        try:
            text = completion_text(completion)
        except Exception:  # a malformed message: nothing to read an answer from
            text = None
        results.append(_score(text, *rest))
    if log_metric is not None and results:
        outcomes = [outcome for _, outcome in results]
        log_metric(NO_ANSWER_METRIC, outcomes.count(NO_ANSWER) / len(outcomes))
        log_metric(UNSCORABLE_METRIC, outcomes.count(UNSCORABLE) / len(outcomes))
    return [value for value, _ in results]
