"""The mistakes that are not config values stop before anything loads, each with one line that names the field and
what to fix (``dppo_trl.preflight``): a reward function that does not import, a model path that does not exist, a
dataset without a ``prompt`` column. ``DPPOTrainer`` raises them before ``GRPOTrainer.__init__`` runs; the CLI's
side is in tests/test_cli.py."""

import ast
import inspect
import re
import socket
import sys

import pytest
from datasets import Dataset, IterableDataset
from support.configs import cpu_config
from support.models import addition_prompts
from support.rewards import random_reward
from trl import GRPOTrainer

from dppo_trl import DPPOTrainer
from dppo_trl.preflight import (
    TRL_REWARD_FUNCS,
    PreflightError,
    check_model_path,
    check_prompt_column,
    check_reward_funcs,
)

REWARD_MODULES = {
    "myrewards": "def f(completions, **kwargs):\n    return [0.0] * len(completions)\n\nthreshold = 3\n",
    "brokenrewards": "raise RuntimeError('boom at import')\n",
    "needsdep": "import nosuchdependency\n",
}


@pytest.fixture
def reward_modules(tmp_path, monkeypatch):
    """``REWARD_MODULES`` written in ``tmp_path``, the current directory; each forgotten after the test."""
    for name, text in REWARD_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in REWARD_MODULES:
        sys.modules.pop(name, None)


def refusal(check, *args) -> str:
    """The one line ``check(*args)`` refuses with."""
    with pytest.raises(PreflightError) as error:
        check(*args)
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, ValueError)
    return message


def test_trls_reward_registry_is_the_one_its_script_reads():
    """``TRL_REWARD_FUNCS`` is the key set of ``reward_funcs_registry`` in TRL's ``grpo.main``, read from its source."""
    from trl.scripts import grpo

    tree = ast.parse(inspect.getsource(grpo.main).lstrip())
    registry = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "reward_funcs_registry"
    )
    assert tuple(key.value for key in registry.keys) == TRL_REWARD_FUNCS


@pytest.mark.parametrize(
    "name, expected",
    [
        ("myrewards.nonexistent", r"^reward_funcs 'myrewards.nonexistent': module 'myrewards' \(.*myrewards.py\) "
         r"has no 'nonexistent'\.$"),
        ("myrewards.ff", r"has no 'ff'\. Did you mean 'f'\?$"),
        ("nosuchmodule.f", r"^reward_funcs 'nosuchmodule.f': there is no module 'nosuchmodule' in .* fix the dotted"),
        ("myrewards.sub.f", r"there is no module 'myrewards.sub'"),
        ("accuracy_rewardd", r"^reward_funcs 'accuracy_rewardd' is neither one of TRL's reward functions \("
         r"accuracy_reward, .*\) nor a dotted import path .*Did you mean 'accuracy_reward'\?$"),
        ("myrewards.threshold", r"'myrewards.threshold' is not callable \(it is of type int\)"),
        ("brokenrewards.f", r"importing 'brokenrewards' failed: RuntimeError: boom at import$"),
        ("needsdep.f", r"importing 'needsdep' failed: ModuleNotFoundError: No module named 'nosuchdependency'$"),
    ],
)
def test_a_reward_function_that_does_not_load_is_one_line(name, expected, reward_modules):
    message = refusal(check_reward_funcs, ["accuracy_reward", name])
    assert re.search(expected, message), message


def test_reward_functions_that_load_pass(reward_modules):
    check_reward_funcs([*TRL_REWARD_FUNCS, "myrewards.f", "trl.rewards.accuracy_reward"])
    check_reward_funcs(None)
    assert "myrewards" in sys.modules  # imported, from the current directory, as TRL's script will
    assert str(reward_modules) not in sys.path  # which is not left on sys.path


@pytest.mark.parametrize("name", ["./missing-model", "../missing-model", "runs/a/missing", "~/missing-model"])
def test_a_local_model_path_that_does_not_exist_is_one_line(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = refusal(check_model_path, name)
    assert message.startswith(f"model_name_or_path {name!r} does not exist (no folder {tmp_path}")
    (tmp_path / "a-file").write_text("")
    assert refusal(check_model_path, "a-file", "model").startswith("model 'a-file' is a file: pass the folder")
    (tmp_path / "model").mkdir()
    check_model_path(str(tmp_path / "model"))
    check_model_path("model")


def hub_cache_with(tmp_path, repo_id: str | None) -> str:
    """A Hub cache folder that holds a snapshot of ``repo_id`` (of nothing: None)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    if repo_id:
        (cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abc").mkdir(parents=True)
    return str(cache)


def test_offline_a_hub_id_must_be_in_the_local_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    message = refusal(check_model_path, "org/missing-model", "model_name_or_path", hub_cache_with(tmp_path, None))
    assert message.startswith("model_name_or_path 'org/missing-model' is neither a folder in ")
    assert "the Hub is off (HF_HUB_OFFLINE=1)" in message and "hf download org/missing-model" in message


def test_a_cached_hub_id_passes_offline_and_any_hub_id_online_without_the_network(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = hub_cache_with(tmp_path, "org/cached-model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check_model_path("org/cached-model", "model_name_or_path", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_network(*args):
        raise AssertionError("the check reached for the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    check_model_path("org/not-cached-model", "model_name_or_path", cache)  # left to the Hub


def question_rows():
    yield {"question": "1+1"}


def test_a_streamed_dataset_is_checked_where_its_columns_are_known():
    from datasets import Features, Value

    known = IterableDataset.from_generator(question_rows, features=Features({"question": Value("string")}))
    message = refusal(check_prompt_column, known, "train_dataset")
    assert message.startswith("train_dataset has no 'prompt' column (its columns: question)")
    unknown = IterableDataset.from_generator(question_rows)
    assert unknown.column_names is None
    check_prompt_column(unknown, "train_dataset")
    check_prompt_column(None, "eval_dataset")


def prompts_from_questions(batch):
    """A transform that builds the ``prompt`` of each row from its ``question``."""
    return {"prompt": [f"Compute {q}." for q in batch["question"]], "answer": batch["answer"]}


def with_transform(dataset, transform):
    return dataset.with_transform(transform)


def set_transform(dataset, transform):
    dataset.set_transform(transform)
    return dataset


@pytest.mark.parametrize("transformed", [with_transform, set_transform])
def test_what_a_dataset_yields_is_checked_not_its_stored_columns(transformed):
    """A transform that builds ``prompt`` passes; one whose rows have none is refused with the rows' columns; a
    transform that fails, or has no row to run on, cannot tell, so it is not refused."""
    check_prompt_column(transformed(questions(), prompts_from_questions), "train_dataset")
    message = refusal(check_prompt_column, transformed(questions(), lambda batch: {"text": batch["question"]}),
                      "train_dataset")
    assert message.startswith("train_dataset has no 'prompt' column (its columns: text)")

    def fails(batch):
        raise KeyError("no such column")

    check_prompt_column(transformed(questions(), fails), "train_dataset")
    check_prompt_column(transformed(questions(0), lambda batch: {"text": batch["question"]}), "train_dataset")


def test_a_format_that_hides_the_prompt_column_is_refused():
    dataset = addition_prompts(4)
    dataset.set_format(columns=["answer"])
    assert "prompt" in dataset.column_names
    assert refusal(check_prompt_column, dataset, "train_dataset").startswith(
        "train_dataset has no 'prompt' column (its columns: answer)")
    assert refusal(check_prompt_column, questions(0), "eval_dataset").startswith(
        "eval_dataset has no 'prompt' column (its columns: question, answer)")  # no row: the stored columns


class Reached(Exception):
    """Raised in place of ``GRPOTrainer.__init__``: the trainer got past its checks."""


@pytest.fixture
def no_model_loads(monkeypatch):
    """``GRPOTrainer.__init__`` (which loads the model) raises ``Reached``."""

    def reached(self, *args, **kwargs):
        raise Reached

    monkeypatch.setattr(GRPOTrainer, "__init__", reached)


def questions(count=4) -> Dataset:
    return Dataset.from_dict({"question": ["1+1"] * count, "answer": ["2"] * count})


@pytest.mark.parametrize(
    "inputs, expected",
    [
        (dict(train_dataset=questions()),
         r"^train_dataset has no 'prompt' column \(its columns: question, answer\): .*rename the column"),
        (dict(eval_dataset={"good": addition_prompts(4), "bad": questions()}),
         r"^eval_dataset\['bad'\] has no 'prompt' column"),
        (dict(model="./missing-model"), r"^model './missing-model' does not exist \(no folder "),
        (dict(reward_funcs="accuracy_reward"),
         r"^reward_funcs\[0\] 'accuracy_reward' is a name only `trl grpo` .*from trl.rewards import accuracy_reward"),
        (dict(reward_funcs=[random_reward, "/nonexistent/reward-model"]),
         r"^reward_funcs\[1\] '/nonexistent/reward-model' does not exist"),
        (dict(reward_funcs=[random_reward, 3]), r"^reward_funcs\[1\] is not callable \(it is of type int\)"),
    ],
    ids=["train-column", "eval-dict-column", "model-path", "registry-name", "reward-model-path", "not-callable"],
)
def test_the_trainer_refuses_before_grpo_trainer_loads_anything(inputs, expected, tmp_path, tiny_model_dir,
                                                                no_model_loads):
    kwargs = {"model": tiny_model_dir, "reward_funcs": random_reward, "train_dataset": addition_prompts(8), **inputs}
    with pytest.raises(ValueError, match=expected) as error:
        DPPOTrainer(args=cpu_config(tmp_path, eval_strategy="steps", eval_steps=1), **kwargs)
    assert "\n" not in str(error.value)


def test_the_trainer_refuses_a_tracker_that_is_not_installed_before_loading(tmp_path, tiny_model_dir,
                                                                             no_model_loads, monkeypatch):
    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: ["wandb"])
    for report_to, expected in ((["tensorboard", "wandb"], r"^report_to names tensorboard, which is not installed: "
                                 r"`pip install tensorboard`"),
                                ("mlflw", r"^report_to='mlflw' is not a tracker .* Did you mean 'mlflow'\?$")):
        with pytest.raises(ValueError, match=expected):
            DPPOTrainer(tiny_model_dir, random_reward, args=cpu_config(tmp_path, report_to=report_to),
                        train_dataset=addition_prompts(8))
    with pytest.raises(Reached):  # an installed tracker, and "none", pass
        DPPOTrainer(tiny_model_dir, random_reward, args=cpu_config(tmp_path, report_to=["wandb"]),
                    train_dataset=addition_prompts(8))


def prompt_rows():
    yield {"prompt": "1+1=", "answer": "2"}


def test_inputs_the_trainer_can_use_reach_grpo_trainer(tmp_path, tiny_model_dir, no_model_loads):
    """The checks refuse only what fails: a model folder, a streamed dataset of unknown columns, a dict of eval
    datasets with prompts, conversational prompts, a dataset mapped to prompts, one from a generator, one whose
    transform builds the prompts, and, with an environment_factory, a dataset without prompts all go through."""
    streamed = IterableDataset.from_generator(question_rows)
    conversational = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1="}]], "answer": ["2"]})
    mapped = questions().map(lambda row: {"prompt": row["question"]}, remove_columns=["question"])
    generated = Dataset.from_generator(prompt_rows, cache_dir=str(tmp_path / "cache"))
    for kwargs in (
        dict(train_dataset=addition_prompts(8), eval_dataset={"a": addition_prompts(4)}),
        dict(train_dataset=streamed),
        dict(train_dataset=conversational),
        dict(train_dataset=mapped),
        dict(train_dataset=generated),
        dict(train_dataset=questions().with_transform(prompts_from_questions)),
        dict(train_dataset=set_transform(questions(), prompts_from_questions)),
        dict(train_dataset=questions(), environment_factory=lambda: None),
    ):
        with pytest.raises(Reached):
            DPPOTrainer(tiny_model_dir, [random_reward], args=cpu_config(tmp_path), **kwargs)


def test_a_dataset_whose_transform_builds_the_prompt_trains(tmp_path, tiny_model_dir):
    trainer = DPPOTrainer(tiny_model_dir, random_reward, args=cpu_config(tmp_path, max_steps=1),
                          train_dataset=questions(16).with_transform(prompts_from_questions))
    trainer.train()
    assert trainer.state.global_step == 1
