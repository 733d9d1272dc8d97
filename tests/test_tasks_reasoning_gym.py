"""reasoning-gym as a data source: rows by task name and generator options, scored by the task's own score_answer
(compared with reasoning-gym called directly), from Python and from a recipe."""

import collections
import json
import math
import time
import types
import warnings

import datasets
import pytest
import reasoning_gym
from reasoning_gym.factory import DATASETS

import dppo_trl.tasks.reasoning_gym as rg
from dppo_trl.cli import _reasoning_gym_as_dataset, parse
from dppo_trl.tasks.reasoning_gym import (
    ANSWER_FORMATS,
    DEFAULT_INSTRUCTIONS,
    reasoning_gym_dataset,
    reasoning_gym_reward,
)

OPTIONS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)
COLUMNS = ("rg_task", "rg_options", "rg_seed", "rg_size", "rg_index", "rg_answer_format")


def reward(rows, completions):
    return reasoning_gym_reward(completions, *(rows[c] for c in COLUMNS))


def test_rows_are_the_generators_entries_as_chat_prompts():
    rows = reasoning_gym_dataset("chain_sum", size=6, seed=3, answer_format="last_number", **OPTIONS)
    direct = reasoning_gym.create_dataset("chain_sum", size=6, seed=3, **OPTIONS)
    for row, entry in zip(rows, direct):
        assert row["answer"] == entry["answer"]
        content = f"{entry['question']} {DEFAULT_INSTRUCTIONS['last_number']}"
        assert row["prompt"] == [{"role": "user", "content": content}]
    assert reasoning_gym_dataset("chain_sum", size=6, seed=3, answer_format="last_number", **OPTIONS)[:] == rows[:]
    assert reasoning_gym_dataset("chain_sum", size=6, seed=4, **OPTIONS)["answer"] != rows["answer"]
    with_system = reasoning_gym_dataset(
        "chain_sum", size=1, seed=3, system_prompt="Be brief.", instruction="", **OPTIONS
    )
    assert with_system[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert with_system[0]["prompt"][1]["content"] == direct[0]["question"]


def test_the_reward_is_the_tasks_own_score_on_the_extracted_answer():
    rows = reasoning_gym_dataset("chain_sum", size=4, seed=0, answer_format="last_number", **OPTIONS)
    direct = reasoning_gym.create_dataset("chain_sum", size=4, seed=0, **OPTIONS)
    answer = rows[0]["answer"]
    texts = [f"The sum is {answer}.", f"{answer}", "I think 1,000 or 1000.5", "no number here"]
    expected = [direct.score_answer(ANSWER_FORMATS["last_number"](t), direct[0]) if ANSWER_FORMATS["last_number"](t)
                else 0.0 for t in texts]
    got = reward({c: rows[c][:1] * 4 for c in COLUMNS}, texts)
    assert got == expected and got[:2] == [1.0, 1.0] and got[3] == 0.0
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    assert reward({c: rows[c][:1] * 4 for c in COLUMNS}, conversational) == got


def test_answer_tag_format_reads_the_last_answer_tag():
    rows = reasoning_gym_dataset("chain_sum", size=1, seed=0, **OPTIONS)  # answer_tag is the default
    answer = rows[0]["answer"]
    assert "<answer>" in rows[0]["prompt"][-1]["content"]
    texts = [f"<answer>{answer}</answer>", f"The sum is {answer}.", f"<answer>0</answer> <answer>{answer}</answer>"]
    assert reward({c: list(rows[c]) * 3 for c in COLUMNS}, texts) == [1.0, 0.0, 1.0]


def test_bad_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="answer_format='xml' is not one of answer_tag, last_number"):
        reasoning_gym_dataset("chain_sum", size=1, answer_format="xml")
    with pytest.raises(ValueError, match="no task 'chain_summ'.*chain_sum"):
        reasoning_gym_dataset("chain_summ", size=1)


def test_a_recipe_names_the_task_and_the_training_script_gets_its_rows(capsys):
    script_args, *_ = parse(["--config", "smollm2-chain-sum-lora", "--reasoning_gym_size", "5"])
    assert script_args.reasoning_gym_options == OPTIONS  # a YAML mapping
    with _reasoning_gym_as_dataset(script_args):
        loaded = datasets.load_dataset(script_args.dataset_name)  # what TRL's script calls
    assert script_args.dataset_name == "reasoning-gym/chain_sum" and datasets.load_dataset.__module__ == "datasets.load"
    expected = reasoning_gym_dataset("chain_sum", size=5, seed=0, answer_format="last_number", **OPTIONS)
    assert loaded["train"][:] == expected[:]
    with _reasoning_gym_as_dataset(script_args, with_test_split=True):  # where the run evaluates (eval_strategy)
        test = datasets.load_dataset(script_args.dataset_name)["test"]
    assert test[:] == reasoning_gym_dataset("chain_sum", size=5, seed=1, answer_format="last_number", **OPTIONS)[:]
    options = json.dumps({"min_terms": 3})
    script_args, *_ = parse(["--config", "smollm2-chain-sum-lora", "--reasoning_gym_options", options])
    assert script_args.reasoning_gym_options == {"min_terms": 3}  # JSON on the command line


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--reasoning_gym_task", "nosuch"], "reasoning-gym has no task 'nosuch'"),
        (["--reasoning_gym_answer_format", "xml"], "answer_format='xml' is not one of"),
        (["--dataset_name", "trl-lib/DeepMath-103K"], "leave dataset_name and datasets unset"),
        (["--reasoning_gym_options", "[1]"], "reasoning_gym_options must be a mapping"),
        (["--reasoning_gym_options", "{min_terms"], "reasoning_gym_options is not a JSON mapping"),
    ],
)
def test_bad_reasoning_gym_keys_stop_before_anything_loads(flags, message):
    with pytest.raises(SystemExit, match=message):
        parse(["--config", "smollm2-chain-sum-lora", *flags])


# Completions a task cannot parse: each must score in [0, 1], never raise (one raise stops a whole TRL run).
MALFORMED = [
    "",
    "  \n\t ",
    "qwerty asdf !!?",
    "<answer></answer>",
    "<answer>2 x three</answer>",
    '<answer>[1, {"a": None}]</answer>',
    "<answer>" + "9" * 400 + "</answer>",  # a 400-digit number: past float, exact only as an int
    "9" * 400,
    "<answer>1e309</answer>",  # inf as a float
    "1e309",
    "<answer>-7</answer>",
    "-7.5",
    "<answer>héllo ∑ 🙂 日本</answer>",
    "<answer>" + "ab 12, " * 2000 + "</answer>",
    "x" * 20000,
]
UNSCORABLE = "reasoning_gym/unscorable_fraction"
NO_ANSWER = "reasoning_gym/no_answer_fraction"


@pytest.fixture(scope="module")
def sweep_time():
    spent = []
    yield spent
    print(f"\nreasoning-gym malformed-answer sweep: {len(spent)} tasks in {sum(spent):.1f} s")


@pytest.mark.filterwarnings("ignore")  # the reward's warn-once and reasoning-gym's own warnings on garbage
@pytest.mark.parametrize("task", sorted(DATASETS))
def test_malformed_completions_score_in_0_1_for_every_task_and_answer_format(task, sweep_time):
    start = time.perf_counter()
    try:
        reasoning_gym.create_dataset(task, size=2, seed=0)
    except Exception as error:  # composite: mixes the tasks its `datasets` option names, and there is no default
        pytest.skip(f"{task} does not build with default options: {type(error).__name__}: {error}")
    for answer_format in ANSWER_FORMATS:
        rows = reasoning_gym_dataset(task, size=2, seed=0, answer_format=answer_format)[:]
        logged = {}
        got = reasoning_gym_reward(  # each malformed answer against each of the two entries
            MALFORMED * 2, *(rows[c] * len(MALFORMED) for c in COLUMNS), log_metric=logged.__setitem__
        )
        assert len(got) == 2 * len(MALFORMED)
        for text, value in zip(MALFORMED * 2, got):
            assert isinstance(value, float) and 0.0 <= value <= 1.0, (task, answer_format, text[:40], value)
        assert all(0.0 <= v <= 1.0 for v in logged.values())  # which metrics: the tests below
    sweep_time.append(time.perf_counter() - start)


def test_answers_the_task_raises_on_score_0_and_are_logged_as_unscorable(monkeypatch):
    """The two reproduced crashes: prime_factorization reading `2 x three` as int (ValueError), boxnet iterating
    the int json gives for a last number (TypeError). Straight from reasoning-gym they raise; through the reward
    they score 0.0, and log_metric sees the fraction of the call's completions the task could not score."""
    monkeypatch.setattr(rg, "_warned", set(), raising=False)  # warn-once state of earlier tests
    cases = [("prime_factorization", "answer_tag", "<answer>2 x three</answer>", ValueError),
             ("boxnet", "last_number", "I would move 5 boxes", TypeError)]
    for task, answer_format, bad, error in cases:
        generator = reasoning_gym.create_dataset(task, size=2, seed=0)
        with pytest.raises(error):
            generator.score_answer(ANSWER_FORMATS[answer_format](bad), generator[0])
        rows = reasoning_gym_dataset(task, size=2, seed=0, answer_format=answer_format)[:1]
        good = f"<answer>{rows['answer'][0]}</answer>" if answer_format == "answer_tag" else "no number at all"
        logged = collections.defaultdict(list)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = reasoning_gym_reward([good, bad], *(rows[c] * 2 for c in COLUMNS),
                                       log_metric=lambda name, value: logged[name].append(value))
            reasoning_gym_reward([bad], *(rows[c] for c in COLUMNS))  # no log_metric: a plain call
        assert got[1] == 0.0 and (got[0] == 1.0 if answer_format == "answer_tag" else got[0] == 0.0)
        assert logged[UNSCORABLE] == [0.5]
        assert logged[NO_ANSWER] == ([0.0] if answer_format == "answer_tag" else [0.5])  # boxnet's good has no number
        ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and task in str(w.message)]
        assert len(ours) == 1 and error.__name__ in str(ours[0].message) and UNSCORABLE in str(ours[0].message)


def test_a_score_that_is_not_a_finite_number_in_0_1(monkeypatch):
    """Finite scores are clamped into [0, 1]; None, NaN, infinities and non-numbers count as unscorable."""
    rows = reasoning_gym_dataset("chain_sum", size=1, seed=0, answer_format="last_number", **OPTIONS)[:]
    generator = rg._generator("chain_sum", rows["rg_options"][0], 0, 1)
    returned = [None, math.nan, math.inf, "1.0", [1.0], 2.5, -1.0, 10**400, True, 0.25]
    expected = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.25]
    values = iter(returned)
    monkeypatch.setattr(generator, "score_answer", lambda answer, entry: next(values))
    logged = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = reasoning_gym_reward(["7"] * len(returned), *(rows[c] * len(returned) for c in COLUMNS),
                                   log_metric=logged.__setitem__)
    assert got == expected and logged == {UNSCORABLE: 0.5, NO_ANSWER: 0.0}
    # Completions with no answer, or no text at all (a tool-call message), are counted apart.
    monkeypatch.undo()
    texts = ["no number", [{"role": "assistant", "content": None}], [], "7"]
    got = reasoning_gym_reward(texts, *(rows[c] * 4 for c in COLUMNS), log_metric=logged.__setitem__)
    assert got[:3] == [0.0, 0.0, 0.0] and logged == {UNSCORABLE: 0.0, NO_ANSWER: 0.75}


def test_trls_calculate_rewards_calls_the_reward_and_collects_its_metrics():
    """TRL 1.16's own _calculate_rewards (dataset columns, trainer_state, log_extra, log_metric as kwargs) on a
    stand-in trainer: one unscorable completion of two scores 0 and its fraction lands in TRL's pending metrics."""
    import torch
    from transformers import TrainerState
    from trl import GRPOTrainer

    rows = reasoning_gym_dataset("prime_factorization", size=1, seed=0)
    inputs = [dict(rows[0]), dict(rows[0])]
    texts = [f"<answer>{rows[0]['answer']}</answer>", "<answer>2 x three</answer>"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=types.SimpleNamespace(report_to=[]),
        state=TrainerState(),
        reward_funcs=[reasoning_gym_reward],
        reward_processing_classes=[None],
        reward_func_names=["reasoning_gym_reward"],
        environments=None,
        _pending_metrics=collections.defaultdict(list),
        _pending_extra_logs=collections.defaultdict(list),
    )
    trainer._log_metric = types.MethodType(GRPOTrainer._log_metric, trainer)
    trainer._log_completion_extra = types.MethodType(GRPOTrainer._log_completion_extra, trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        prompts = [row["prompt"] for row in inputs]
        rewards = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, [[1], [2]])
    assert rewards[:, 0].tolist() == [1.0, 0.0]
    assert dict(trainer._pending_metrics) == {UNSCORABLE: [0.5], NO_ANSWER: [0.0]}
