"""The `dppo-trl` command line: every recipe parses and ships with the package (found by name as well as by
path), unknown keys, bad values, reward functions that do not import, missing models and a dataset without a
prompt column, a tracker that is not installed and `--resume_from_checkpoint true` without a checkpoint stop it
before anything is loaded with a `dppo-trl:` line and exit status 2 (`true` otherwise resumes the last one), Ctrl-C
ends it with one line and the command that resumes,
flags override YAML, launch options are recognised, `--help` leads with DPPO's options by group (TRL's are
behind `--help-all`), a LoRA run trains and saves its adapter, and --num_processes N > 1 starts N processes on the
CPU (or is refused where accelerate would start one)."""

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.configs import DPPO_FIELDS
from support.models import addition_prompts
from support.processes import kill_process_tree

from dppo_trl.cli import bundled_recipes, main, make_parser, parse, recipes_dir, script_arguments_class
from dppo_trl.cli.arguments import script_keys
from dppo_trl.cli.help import COMMON_LAUNCH_OPTIONS, dppo_groups
from dppo_trl.config import DPPOConfig

REPO = Path(__file__).parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
CPU = ["--bf16", "false", "--use_cpu", "true"]  # the GPU recipes ask for bf16, which a CPU refuses


def test_there_are_the_four_recipes():
    assert {r.name for r in RECIPES} >= {
        "qwen3-4b-math-lora.yaml",
        "qwen3-4b-math.yaml",
        "qwen2.5-math-1.5b.yaml",
        "cpu-demo.yaml",
    }


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses_with_valid_values(recipe):
    text = recipe.read_text()
    assert text.startswith("# What:") and "# Hardware:" in text and "# Expect:" in text
    script_args, training_args, model_args, dataset_args, launch_args, _ = parse(["--config", str(recipe), *CPU])
    assert isinstance(training_args, DPPOConfig)
    assert (script_args.dataset_name or script_args.reasoning_gym_task) and script_args.reward_funcs
    if recipe.name == "qwen3-4b-math-lora.yaml":
        assert model_args.use_peft and training_args.use_vllm and training_args.vllm_mode == "colocate"
    if recipe.name == "qwen3-4b-math.yaml":
        assert launch_args == ["--num_processes", "8", "--accelerate_config", "zero2"]
    else:
        assert launch_args == []


def write_yaml(path, text):
    path.write_text(text)
    return str(path)


def test_unknown_yaml_key_names_the_key_and_the_closest_valid_one(tmp_path, capsys):
    config = write_yaml(tmp_path / "c.yaml", "completion_keep_rat: 0.3\nuse_cpu: true\nbf16: false\n")
    with pytest.raises(SystemExit) as error:
        main(["--config", config])
    message = "dppo-trl: unknown YAML key 'completion_keep_rat'. Did you mean 'completion_keep_rate'?"
    assert str(error.value) == message and error.value.code == 2
    assert capsys.readouterr().err.strip() == message  # the line a user sees, and no traceback


def test_unknown_flag_is_refused_not_abbreviated(tmp_path):
    with pytest.raises(SystemExit, match="unknown argument '--completion_keep_rat'.*'completion_keep_rate'"):
        parse([*CPU, "--completion_keep_rat", "0.3"])


def test_bad_value_stops_before_anything_is_loaded(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml",
        "completion_keep_rate: 2\nuse_cpu: true\nbf16: false\nmodel_name_or_path: /nonexistent/model\n",
    )
    with pytest.raises(SystemExit, match=r"^dppo-trl: completion_keep_rate=2.* is invalid.*\(0, 1\]") as error:
        main(["--config", config])
    assert error.value.code == 2


def test_the_recipes_ship_with_the_package():
    assert importlib.util.find_spec("dppo_trl.recipes") is not None  # a package (data) in editable and wheel installs
    shipped = bundled_recipes()
    assert sorted(shipped) == sorted(r.stem for r in RECIPES)
    for recipe in RECIPES:
        assert shipped[recipe.stem].read_text() == recipe.read_text()


@pytest.mark.parametrize(
    "value", ["qwen3-4b-math-lora", "qwen3-4b-math-lora.yaml", "recipes/qwen3-4b-math-lora.yaml", "=by-name"]
)
def test_a_shipped_recipe_is_found_by_name_from_any_directory(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here: the shipped copy is used
    argv = ["--config=qwen3-4b-math-lora"] if value == "=by-name" else ["--config", value]
    script_args, training_args, model_args, _, launch_args, training_argv = parse([*argv, *CPU])
    assert model_args.use_peft and training_args.completion_keep_rate == 0.5 and launch_args == []
    assert training_argv == ["--config", str(bundled_recipes()["qwen3-4b-math-lora"]), *CPU]  # what a launch gets


def test_a_file_wins_over_a_recipe_name_and_an_unknown_name_lists_the_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_yaml(tmp_path / "cpu-demo", "completion_keep_rate: 0.25\nuse_cpu: true\nbf16: false\n")
    assert parse(["--config", "cpu-demo"])[1].completion_keep_rate == 0.25
    with pytest.raises(SystemExit, match="'qwen9' is neither a file nor a shipped recipe.*qwen3-4b-math-lora") as e:
        parse(["--config", "qwen9"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="neither a file"):  # a path elsewhere is a path, not a recipe name
        parse(["--config", str(tmp_path / "elsewhere" / "cpu-demo.yaml")])


def test_the_demo_recipe_without_prepare_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as error:
        main(["--config", "cpu-demo"])
    assert error.value.code == 2
    assert "demo-output/warm-start does not exist" in str(error.value)
    assert "python -m dppo_trl.demo prepare" in capsys.readouterr().err


@pytest.mark.parametrize(
    "yaml_text",
    [
        "dataset_name: some/dataset\ndataset_streaming: true\n",
        "datasets:\n  - path: some/dataset\nstreaming: true\n",
    ],
    ids=["dataset_streaming", "datasets-mixture"],
)
def test_a_streaming_dataset_with_prompt_pruning_is_accepted(yaml_text, tmp_path):
    """Prompt pruning's history is kept per prompt, not per dataset row: a streaming dataset parses as it is."""
    config = write_yaml(
        tmp_path / "c.yaml",
        yaml_text + "prompt_keep_rate: 0.5\nuse_cpu: true\nbf16: false\nmodel_name_or_path: /nonexistent/model\n",
    )
    script_args, training_args, _, dataset_args, *_ = parse(["--config", config])
    assert training_args.prompt_keep_rate == 0.5 and (script_args.dataset_streaming or dataset_args.streaming)


def test_yaml_launch_switches_are_passed_when_true_and_left_out_when_false(tmp_path):
    base = "use_cpu: true\nbf16: false\nnum_processes: 2\n"
    assert parse(["--config", write_yaml(tmp_path / "a.yaml", base + "multi_gpu: true\n")])[4] == [
        "--num_processes",
        "2",
        "--multi_gpu",
    ]
    assert parse(["--config", write_yaml(tmp_path / "b.yaml", base + "multi_gpu: false\n")])[4] == [
        "--num_processes",
        "2",
    ]
    with pytest.raises(SystemExit, match="YAML key 'multi_gpu' is a switch"):
        parse(["--config", write_yaml(tmp_path / "c.yaml", base + "multi_gpu: sometimes\n")])


def test_flags_override_yaml(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml",
        "learning_rate: 1.0e-4\ncompletion_keep_rate: 0.5\nuse_cpu: true\n"
        "bf16: false\nenv:\n  DPPO_TEST_ENV: set-by-yaml\n",
    )
    _, training_args, *_ = parse(["--config", config, "--learning_rate", "3e-4", "--completion_keep_rate", "0.25"])
    assert training_args.learning_rate == 3e-4 and training_args.completion_keep_rate == 0.25
    assert os.environ.pop("DPPO_TEST_ENV") == "set-by-yaml"


def help_texts(monkeypatch) -> tuple[str, str]:
    """(``dppo-trl --help``, ``dppo-trl --help-all``) on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    parser = make_parser()
    return parser.format_help(), parser.format_full_help()


def listed_options(text: str) -> list[str]:
    """The options a help text lists, one entry each (an entry's line starts with two spaces and its flag)."""
    return re.findall(r"^  (-\w|--[\w-]+)", text, re.MULTILINE)


def section(text: str, title: str) -> str:
    """A section of a help text: from its ``title:`` line to the next blank line followed by another title."""
    start = text.index(f"\n{title}:\n") + 1
    found = re.search(r"\n\n\S[^\n]*:\n", text[start:])
    return text[start : start + found.start()] if found else text[start:]


def test_the_help_lists_the_dppo_options_config_and_launch_options(monkeypatch):
    text, full = help_texts(monkeypatch)
    for name in DPPO_FIELDS:
        assert f"--{name}" in text, name
    assert "Horvitz" in text or "1/pi" in text  # the help text itself, not just the flag
    assert "--config YAML_OR_RECIPE" in text
    for name in bundled_recipes():
        assert name in text, name
    common = ("--accelerate_config", "--num_processes", "--num_machines", "--mixed_precision", "--use_deepspeed")
    for help_text in (text, full):
        launch = section(help_text, "launch options")
        for flag in common:
            assert flag in launch, flag
        assert "--gradient_accumulation_steps" not in launch  # that one is training's
    assert "--zero_stage," in section(full, "launch options")  # every other launch option, by name


def test_the_first_screen_of_the_help_is_dppos_options_by_group(monkeypatch):
    text, _ = help_texts(monkeypatch)
    first_screen = "\n".join(text.splitlines()[:50])
    assert "\ncompletion pruning:\n" in first_screen and "--completion_keep_rate FLOAT" in first_screen
    assert "--config YAML_OR_RECIPE" in first_screen
    # Where an installed user reads more: the docstring and the installed recipes, not a page a wheel lacks.
    assert "help(dppo_trl.DPPOConfig)" in first_screen and "docs/" not in text
    assert f"recipes in {recipes_dir()}" in " ".join(first_screen.split())
    groups = dppo_groups()
    assert list(groups) == ["completion pruning", "the gradient audit", "prompt pruning", "packing"]
    assert set().union(*map(set, groups.values())) == DPPO_FIELDS
    lines = text.splitlines()
    headings = [lines.index(f"{group}:") for group in groups]
    assert headings == sorted(headings) and headings[-1] < lines.index("launch options:") < 100
    for group, fields in groups.items():  # each option in its group's section, with its help text beside it
        assert listed_options(section(text, group)) == [f"--{name}" for name in fields], group


def test_every_dppo_help_text_is_one_or_two_short_sentences(monkeypatch):
    parser = make_parser()
    own = DPPO_FIELDS | set(script_keys())  # what the short help shows with its help text, besides launch options
    shown = {a.dest: a.help for a in parser._actions if a.dest in own}
    assert set(shown) == own and len(own) == len(DPPO_FIELDS) + 6
    for name, help_text in shown.items():
        assert 0 < len(help_text.split()) <= 40, (name, len(help_text.split()))
        assert help_text.count(". ") + help_text.count("; ") <= 2, name
    text, _ = help_texts(monkeypatch)
    for group in dppo_groups():  # on screen: at most 6 lines an option
        body = section(text, group).splitlines()[1:]
        assert len(body) <= 6 * len(listed_options("\n".join(body))), group


def test_trls_options_are_behind_help_all_and_parse_as_before(monkeypatch):
    text, full = help_texts(monkeypatch)
    short, every = set(listed_options(text)), set(listed_options(full))
    dppo_own = {f"--{name}" for name in DPPO_FIELDS} | {f"--{name}" for name in script_keys()}
    assert short - {"-h", "--help-all", "--config", "--accelerate_config"} - dppo_own == {
        f"--{name}" for name in COMMON_LAUNCH_OPTIONS
    }
    for flag in ("--learning_rate", "--beta", "--num_generations", "--model_name_or_path", "--lora_r", "--datasets"):
        assert flag not in short and flag in every, flag
    assert text.rstrip().endswith("To see every option: dppo-trl --help-all")
    parser = make_parser()
    for action in parser._actions:  # the full help lists every option the parser takes, with its help
        assert action.option_strings[0] in every or action.option_strings[0].startswith("--no"), action.dest
    # What parses is what did: the dataclasses' fields, -h, --config (taken out by TRL) and --help-all, which is no key.
    from trl import DatasetMixtureConfig, ModelConfig

    classes = (script_arguments_class(), DPPOConfig, ModelConfig, DatasetMixtureConfig)
    fields = {f.name for cls in classes for f in dataclasses.fields(cls)}
    assert {a.dest for a in parser._actions} == fields | {"help", argparse.SUPPRESS}
    assert [a.option_strings for a in parser._actions if a.dest == argparse.SUPPRESS] == [
        ["--help-all", "--help_all"],
        ["--config"],
    ]


def test_help_and_help_all_print_to_stdout_and_exit_0(capsys, tmp_path):
    config = write_yaml(tmp_path / "c.yaml", "help_all: true\nuse_cpu: true\nbf16: false\n")
    for flag, present, absent in [
        ("--help", "--completion_keep_rate", "--learning_rate FLOAT"),
        ("--help-all", "--learning_rate FLOAT", None),
        ("--help_all", "--learning_rate FLOAT", None),
    ]:
        with pytest.raises(SystemExit) as error:
            main([flag])
        out = capsys.readouterr()
        assert error.value.code == 0 and present in out.out and not out.err, flag
        assert absent is None or absent not in out.out
    with pytest.raises(SystemExit, match="unknown YAML key 'help_all'"):  # a flag, not a key
        parse(["--config", config])


@pytest.mark.subprocess
def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "dppo_trl", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--completion_keep_rate" in out.stdout
    assert "--config YAML_OR_RECIPE" in out.stdout and "--num_processes" in out.stdout


def tiny_run_config(tmp_path, model_dir, extra: str, reward: str = "tests.support.rewards.random_reward") -> str:
    """A YAML for a few CPU steps on the offline tiny model, with a local JSON dataset."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    addition_prompts(32).to_json(str(data / "train.jsonl"))
    return write_yaml(
        tmp_path / "run.yaml",
        f"""
model_name_or_path: {model_dir}
dataset_name: {data}
reward_funcs: [{reward}]
output_dir: {tmp_path / "out"}
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 6
save_strategy: "no"
report_to: none
bf16: false
use_cpu: true
gradient_checkpointing: false
{extra}""",
    )


def test_lora_training_through_the_cli_saves_the_adapter(tmp_path, tiny_model_dir):
    config = tiny_run_config(
        tmp_path,
        tiny_model_dir,
        """
use_peft: true
lora_r: 4
lora_alpha: 8
lora_target_modules: [q_proj, v_proj]
beta: 0.05
completion_keep_rate: 0.5
max_steps: 2
learning_rate: 1.0e-3
""",
    )
    main(["--config", config])
    out = tmp_path / "out"
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists()
    card = (out / "README.md").read_text()  # names the training set: here a local dataset, in words
    assert f"the local model `{tiny_model_dir}` on the local dataset `{tmp_path / 'data'}`." in card


@pytest.mark.subprocess
def test_launch_options_start_the_run_under_accelerate(tmp_path, tiny_model_dir, monkeypatch):
    config = tiny_run_config(tmp_path, tiny_model_dir, "num_processes: 1\nmax_steps: 1\n")
    monkeypatch.delenv("DPPO_TRL_LAUNCHED", raising=False)
    monkeypatch.chdir(Path(__file__).parent.parent)
    main(["--config", config, "--mixed_precision", "no"])  # a YAML launch option and a command-line one
    assert os.environ.get("DPPO_TRL_LAUNCHED") == "1"  # it went through `accelerate launch`
    assert (tmp_path / "out" / "model.safetensors").exists()


def run_cli_with_timeout(argv, env, log, timeout):
    """``python -m dppo_trl ARGV`` in a session of its own, its output to ``log``; past ``timeout`` seconds (a hang)
    it and every process it started (torch.distributed.run's workers have sessions of their own) are killed."""
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "dppo_trl", *argv], cwd=REPO, env={**os.environ, **env},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(process.pid)
            process.wait()
            pytest.fail(f"no result after {timeout} s (a hang?):\n{log.read_text()[-3000:]}")


@pytest.mark.subprocess
def test_num_processes_on_the_cpu_starts_that_many_processes(tmp_path, tiny_model_dir):
    """`accelerate launch --num_processes 2` on the CPU starts ONE process (its CPU launcher leaves several to
    mpirun); dppo-trl starts two (torch.distributed.run, gloo): each trainer sees a group of two, and both
    processes end (a finished gloo rank can hang at exit, see ``dppo_trl.cli.run``), each after joining its
    threads and running its ``atexit`` handlers (a tracker's final sync), which ``os._exit`` alone skipped."""
    reward = "tests.world_size_reward.recording_reward"
    config = tiny_run_config(tmp_path, tiny_model_dir, "max_steps: 1\n", reward=reward)
    world = tmp_path / "world"
    world.mkdir()
    env = {"DPPO_TEST_WORLD_DIR": str(world), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DPPO_TRL_LAUNCHED": ""}
    log = tmp_path / "log.txt"
    assert run_cli_with_timeout(["--config", config, "--num_processes", "2"], env, log, timeout=240) == 0, (
        log.read_text()[-3000:]
    )
    ranks = sorted((json.loads(f.read_text()) for f in world.glob("rank*.json")), key=lambda r: r["rank"])
    assert ranks == [{"rank": r, "world_size": 2, "backend": "gloo"} for r in (0, 1)]
    for rank in (0, 1):  # the exit handlers and threads that the reward registered and started in each process
        assert (world / f"atexit{rank}").read_text() == "ran" and (world / f"thread{rank}").read_text() == "ran"
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert "dppo-trl: 2 processes on the CPU (torch.distributed.run, gloo)" in log.read_text()  # said, not silent


def test_num_processes_beyond_the_gpus_is_a_line_not_a_single_process(tmp_path, monkeypatch, capsys):
    """With one GPU, `accelerate launch --num_processes 2` would start one process: dppo-trl refuses, naming
    --num_processes and what to do, before anything is loaded or launched."""
    import torch

    config = write_yaml(tmp_path / "c.yaml", "bf16: false\nmodel_name_or_path: /nonexistent/model\n")
    monkeypatch.delenv("DPPO_TRL_LAUNCHED", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as error:
        main(["--config", config, "--num_processes", "2"])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dppo-trl: --num_processes 2 would start a single process here (1 GPU visible)")
    assert "--use_cpu true" in err and "Traceback" not in err


def test_conflicting_launch_options_are_a_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """accelerate's own refusals of the launch options come before anything is loaded, as a `dppo-trl:` line."""
    config = write_yaml(tmp_path / "c.yaml", "use_cpu: true\nbf16: false\nmodel_name_or_path: /nonexistent/model\n")
    monkeypatch.delenv("DPPO_TRL_LAUNCHED", raising=False)
    with pytest.raises(SystemExit) as error:
        main(["--config", config, "--cpu", "--multi_gpu", "--num_processes", "2"])
    assert error.value.code == 2
    assert capsys.readouterr().err.startswith("dppo-trl: You can only use one of `--cpu`, `--multi_gpu`")


def test_a_model_folder_under_home_is_expanded_and_a_missing_smollm2_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    from dppo_trl.cli import _expand_model_path

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models" / "mine").mkdir(parents=True)
    _, _, model_args, *_ = parse(["--config", "smollm2-chain-sum-lora", "--model_name_or_path", "~/models/mine"])
    _expand_model_path(model_args)
    assert model_args.model_name_or_path == str(tmp_path / "models" / "mine")
    with pytest.raises(SystemExit) as error:
        main(["--config", "smollm2-chain-sum-lora"])  # the recipe's ~/.cache/dppo_trl/SmolLM2-135M-Instruct
    assert error.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"dppo-trl: {tmp_path}/.cache/dppo_trl/SmolLM2-135M-Instruct does not exist: run "
                          "`dppo-trl-smollm2`")


def refused_before_loading(argv, monkeypatch, capsys) -> str:
    """The one stderr line with which ``main(argv)`` exits 2, having loaded nothing: no run started and no model
    read (``run`` and ``from_pretrained`` fail the test)."""
    import transformers

    def loads(*args, **kwargs):
        raise AssertionError("something loaded")

    monkeypatch.setattr("dppo_trl.cli.run", loads)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", loads)
    capsys.readouterr()  # what came before: the test's own dataset writing
    with pytest.raises(SystemExit) as error:
        main(argv)
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err == f"{error.value}\n"
    return err.strip()


@pytest.mark.parametrize(
    "reward, expected",
    [
        ("myrewards.nonexistent", "dppo-trl: reward_funcs 'myrewards.nonexistent': module 'myrewards' ("),
        ("nosuchmodule.f", "dppo-trl: reward_funcs 'nosuchmodule.f': there is no module 'nosuchmodule' in "),
        ("accuracy_rewardd", "dppo-trl: reward_funcs 'accuracy_rewardd' is neither one of TRL's reward functions"),
    ],
)
def test_a_reward_function_that_does_not_load_is_one_line_before_anything_loads(
    reward, expected, tmp_path, tiny_model_dir, monkeypatch, capsys
):
    (tmp_path / "myrewards.py").write_text("def reward(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    monkeypatch.delitem(sys.modules, "myrewards", raising=False)
    monkeypatch.chdir(tmp_path)  # TRL's script imports a reward's module from the current directory
    config = tiny_run_config(tmp_path, tiny_model_dir, "max_steps: 1\n", reward=reward)
    try:
        assert refused_before_loading(["--config", config], monkeypatch, capsys).startswith(expected)
    finally:
        sys.modules.pop("myrewards", None)


def test_an_output_dir_holding_a_users_files_is_one_line_before_anything_loads(tmp_path, tiny_model_dir,
                                                                                 monkeypatch, capsys):
    """TRL's own `trl grpo` overwrites README.md and tokenizer.json and deletes an old checkpoint-100/ here
    (save_steps 1, save_total_limit 1); dppo-trl refuses, and the folder is left byte-identical."""
    out = tmp_path / "out"
    (out / "checkpoint-100").mkdir(parents=True)
    (out / "checkpoint-100" / "model.safetensors").write_bytes(b"weights")
    (out / "README.md").write_text("my notes")
    (out / "tokenizer.json").write_text("{}")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    config = tiny_run_config(tmp_path, tiny_model_dir, "max_steps: 1\n")
    argv = ["--config", config, "--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "1"]
    line = refused_before_loading(argv, monkeypatch, capsys)
    assert line.startswith("dppo-trl: output_dir=") and "README.md, checkpoint-100/, tokenizer.json" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    resumed = argv + ["--resume_from_checkpoint", str(out / "checkpoint-100")]  # resuming from them is allowed
    monkeypatch.setattr("dppo_trl.cli.run", lambda *args: None)
    assert main(resumed) == 0


@pytest.mark.parametrize("model", ["./missing-model", "{tmp}/missing-model", "org/not-in-the-cache"])
def test_a_missing_model_is_one_line_before_anything_loads(model, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    model = model.format(tmp=tmp_path)
    config = tiny_run_config(tmp_path, model, "max_steps: 1\n")
    err = refused_before_loading(["--config", config], monkeypatch, capsys)
    assert err.startswith(f"dppo-trl: model_name_or_path {model!r} ")
    assert ("does not exist" if "missing" in model else "HF_HUB_OFFLINE=1") in err


def questions_run_config(tmp_path, model_dir) -> str:
    """``tiny_run_config`` whose dataset's prompts are in a ``question`` column."""
    config = tiny_run_config(tmp_path, model_dir, "max_steps: 1\n")
    data = tmp_path / "data" / "train.jsonl"
    data.write_text(data.read_text().replace('"prompt":', '"question":'))
    return config


def test_a_dataset_without_a_prompt_column_is_one_line_before_the_model_loads(tmp_path, tiny_model_dir, monkeypatch,
                                                                               capsys):
    """TRL's script loads the dataset before the trainer; the trainer refuses it before GRPOTrainer.__init__."""
    import trl

    def loads(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", loads)
    config = questions_run_config(tmp_path, tiny_model_dir)
    with pytest.raises(SystemExit) as error:
        main(["--config", config])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("dppo-trl: train_dataset has no 'prompt' column (its columns: question, ")
    assert "Traceback" not in err


class Ended(Exception):
    """In place of the launcher's SIGTERM: the process was ended while it waited."""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_a_launch_only_the_main_process_prints_the_datasets_line(rank, tmp_path, tiny_model_dir, monkeypatch,
                                                                         capsys):
    """Every process of a launch meets the dataset check and stops with status 2. The main one prints its line at
    once; another waits first (the launcher ends it once the main one has exited), so it prints nothing where it
    is ended during the wait, and its line only where it is not (the main process did not meet the error)."""
    import trl

    launch = importlib.import_module("dppo_trl.cli.launch")  # the module (dppo_trl.cli.launch is also a function)

    def loads(*args, **kwargs):
        raise AssertionError("the model loaded")

    def ended(seconds):
        raise Ended

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", loads)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(launch.time, "sleep", ended)
    config = questions_run_config(tmp_path, tiny_model_dir)
    capsys.readouterr()
    with pytest.raises(Ended if rank == "1" else SystemExit):
        main(["--config", config])
    line = "dppo-trl: train_dataset has no 'prompt' column (its columns: question, "
    assert (line in capsys.readouterr().err) == (rank == "0")
    waited = []
    monkeypatch.setattr(launch.time, "sleep", waited.append)
    with pytest.raises(SystemExit) as error:
        main(["--config", config])
    assert error.value.code == 2 and waited == ([] if rank == "0" else [launch.REPORT_GRACE_S])
    assert capsys.readouterr().err.count(line) == 1


@pytest.mark.subprocess
def test_two_processes_print_the_datasets_line_once_and_exit_2(tmp_path, tiny_model_dir):
    """``--num_processes 2`` on the CPU: both processes refuse the dataset, its line is printed once, and the
    launching process exits with status 2, without the launcher's traceback."""
    config = questions_run_config(tmp_path, tiny_model_dir)
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DPPO_TRL_LAUNCHED": ""}
    log = tmp_path / "log.txt"
    status = run_cli_with_timeout(["--config", config, "--num_processes", "2"], env, log, timeout=240)
    output = log.read_text()
    assert status == 2, output[-3000:]
    assert output.count("dppo-trl: train_dataset has no 'prompt' column (its columns: question, ") == 1, output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "report_to, expected",
    [
        ("tensorboard", "dppo-trl: report_to names tensorboard, which is not installed: `pip install tensorboard`"),
        ("tensorbord", "dppo-trl: report_to='tensorbord' is not a tracker transformers reports to;"),
    ],
)
def test_a_tracker_that_is_not_installed_is_one_line_before_anything_loads(report_to, expected, tmp_path,
                                                                          tiny_model_dir, monkeypatch, capsys):
    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: [])  # none installed
    config = tiny_run_config(tmp_path, tiny_model_dir, "max_steps: 1\n")
    line = refused_before_loading(["--config", config, "--report_to", report_to], monkeypatch, capsys)
    assert line.startswith(expected)
    assert report_to == "tensorboard" or "Did you mean 'tensorboard'?" in line


def test_resume_from_checkpoint_true_resumes_the_last_checkpoint_of_output_dir(tmp_path, tiny_model_dir, monkeypatch,
                                                                             capsys):
    config = tiny_run_config(tmp_path, tiny_model_dir, "max_steps: 1\n")
    argv = ["--config", config, "--resume_from_checkpoint", "true"]
    line = refused_before_loading(argv, monkeypatch, capsys)
    assert line.startswith("dppo-trl: resume_from_checkpoint=true: output_dir=") and "holds no checkpoint-*" in line
    for step in (2, 10):
        (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
    resumed = []
    monkeypatch.setattr("dppo_trl.cli.run", lambda script, training, *rest: resumed.append(training))
    assert main(argv) == 0
    assert resumed[0].resume_from_checkpoint == str(tmp_path / "out" / "checkpoint-10")  # the last, as Trainer's
    assert main(["--config", config, "--resume_from_checkpoint", "false"]) == 0
    assert resumed[1].resume_from_checkpoint is None


def test_a_refusal_without_checkpoints_does_not_suggest_resuming(tmp_path, tiny_model_dir, monkeypatch, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "README.md").write_text("my notes")
    config = tiny_run_config(tmp_path, tiny_model_dir, "max_steps: 1\n")
    line = refused_before_loading(["--config", config], monkeypatch, capsys)
    assert "README.md" in line and "resume" not in line


def test_the_interruption_line(tmp_path):
    from dppo_trl.cli.runtime import interruption_line

    folder = tmp_path / "out"
    assert interruption_line(None, None, ["--config", "x.yaml"]) == "dppo-trl: interrupted."
    assert interruption_line(None, str(folder), []) == (
        f"dppo-trl: interrupted; no checkpoint was saved in {folder}: there is none to resume from.")
    (folder / "checkpoint-3").mkdir(parents=True)
    trainer = argparse.Namespace(state=argparse.Namespace(global_step=4, max_steps=40), args=None)
    line = interruption_line(trainer, str(folder), ["--config", "my run.yaml", "--resume_from_checkpoint", "x"])
    assert line == (f"dppo-trl: interrupted at step 4 of 40; the checkpoints in {folder} are kept (the last: "
                    "checkpoint-3). Resume with: dppo-trl --config 'my run.yaml' --resume_from_checkpoint true")


@pytest.mark.subprocess
def test_ctrl_c_ends_the_run_with_one_line_and_the_resume_command(tmp_path, tiny_model_dir):
    """Ctrl-C (SIGINT) during training: no traceback, one line with the step reached and the command that resumes
    from the last checkpoint, status 130."""
    import signal
    import time

    config = tiny_run_config(tmp_path, tiny_model_dir, "max_steps: 1000\nsave_strategy: steps\nsave_steps: 1\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "dppo_trl", "--config", config], cwd=REPO, stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not (tmp_path / "out" / "checkpoint-2").is_dir() and time.monotonic() < deadline:
                time.sleep(0.5)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=120) == 130, log.read_text()[-3000:]
        finally:
            kill_process_tree(process.pid)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    line = [x for x in text.splitlines() if x.startswith("dppo-trl: interrupted at step ")]
    assert len(line) == 1 and line[0].endswith(f"Resume with: dppo-trl --config {config} --resume_from_checkpoint "
                                               "true"), text[-3000:]
    assert re.search(r"the checkpoints in .* are kept \(the last: checkpoint-\d+\)", line[0])


def test_the_generated_known_keys_are_the_parsers():
    """``_known_keys.py`` holds every name the parser takes (DPPOConfig's fields among them): a field added to the
    config without `python -m dppo_trl.cli.keys --write` fails here."""
    from dppo_trl.cli import _known_keys, keys

    assert keys.main([]) == 0
    assert {f.name for f in dataclasses.fields(DPPOConfig)} <= set(_known_keys.TRAINING_KEYS)
    assert "--completion_keep_rate" in _known_keys.TRAINING_FLAGS and "num_processes" in _known_keys.LAUNCH_OPTIONS


@pytest.mark.parametrize(
    "argv, yaml_text",
    [
        (["--complete_keep_rate=0.3"], ""),
        (["--completion_keep_rate", "0.3", "--num-proceses", "2"], ""),
        ([], "completion_keep_rat: 0.3\n"),
        ([], "per-device-train-batch-size: 8\n"),
    ],
)
def test_a_typo_is_refused_before_trl_loads_with_the_parsers_own_message(argv, yaml_text, tmp_path, monkeypatch,
                                                                         capsys):
    from dppo_trl.cli import keys

    config = write_yaml(tmp_path / "c.yaml", "model_name_or_path: /nonexistent/model\nuse_cpu: true\nbf16: false\n"
                        + yaml_text)
    argv = ["--config", config, *argv]
    with pytest.raises(SystemExit) as slow:  # the parser's own check (it loads TRL)
        parse(argv)
    monkeypatch.setattr("dppo_trl.cli.parse", lambda argv: pytest.fail("the parser ran"))
    with pytest.raises(SystemExit) as fast:
        main(argv)
    assert fast.value.code == 2 and str(fast.value) == str(slow.value) and "unknown" in str(fast.value)
    assert capsys.readouterr().err == f"{fast.value}\n"
    code = ("import sys\nfrom dppo_trl.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]  # refused with none of them imported


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES))
def test_what_the_parser_takes_passes_the_fast_check(recipe):
    from dppo_trl.cli.keys import check_known_keys

    check_known_keys(["--config", recipe, "--no_packing", "--per-device-train-batch-size", "8", "--help-all",
                      "--num_processes", "2", "--mixed-precision=no", "--reasoning_gym_options", '{"min_terms": 2}',
                      "--seed", "-1", "--output_dir=--odd-folder"])


def test_under_other_versions_of_the_sources_the_parser_checks_the_keys(monkeypatch):
    """The names depend on the installed transformers, TRL and accelerate (the vLLM lane pins another transformers):
    where their versions differ from those generated with, the fast check refuses nothing."""
    from dppo_trl.cli import keys

    typo = ["--complete_keep_rate=0.3"]
    with pytest.raises(SystemExit):
        keys.check_known_keys(typo)
    other = {**keys.installed_versions(), "transformers": "5.0.0"}
    monkeypatch.setattr(keys, "installed_versions", lambda: other)
    keys.check_known_keys(typo)
