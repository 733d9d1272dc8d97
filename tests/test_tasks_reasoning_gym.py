"""reasoning-gym as a data source: rows by task name and generator options, scored by the task's own score_answer
(compared with reasoning-gym called directly), from Python and from a recipe."""

import json

import datasets
import pytest
import reasoning_gym

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
        assert row["prompt"] == [{"role": "user", "content": f"{entry['question']} {DEFAULT_INSTRUCTIONS['last_number']}"}]
    assert reasoning_gym_dataset("chain_sum", size=6, seed=3, answer_format="last_number", **OPTIONS)[:] == rows[:]
    assert reasoning_gym_dataset("chain_sum", size=6, seed=4, **OPTIONS)["answer"] != rows["answer"]
    with_system = reasoning_gym_dataset("chain_sum", size=1, seed=3, system_prompt="Be brief.", instruction="", **OPTIONS)
    assert with_system[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert with_system[0]["prompt"][1]["content"] == direct[0]["question"]


def test_the_reward_is_the_tasks_own_score_on_the_extracted_answer():
    rows = reasoning_gym_dataset("chain_sum", size=4, seed=0, answer_format="last_number", **OPTIONS)
    direct = reasoning_gym.create_dataset("chain_sum", size=4, seed=0, **OPTIONS)
    answer = rows[0]["answer"]
    texts = [f"The sum is {answer}.", f"{answer}", "I think 1,000 or 1000.5", "no number here"]
    expected = [direct.score_answer(ANSWER_FORMATS["last_number"](t), direct[0]) if ANSWER_FORMATS["last_number"](t)
                else 0.0 for t in texts]  # fmt: skip
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
    script_args, *_ = parse(["--config", "smollm2-chain-sum-lora", "--reasoning_gym_options", json.dumps({"min_terms": 3})])
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
