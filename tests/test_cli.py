"""The `dppo-trl` command line: every recipe parses, unknown keys and bad values stop it before anything is
loaded, flags override YAML, launch options are recognised, and a LoRA run trains and saves its adapter."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_config import DPPO_FIELDS

from dppo_trl.cli import main, make_parser, parse
from dppo_trl.config import DPPOConfig
from dppo_trl.toy import addition_dataset, addition_pairs

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
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
    assert script_args.dataset_name and script_args.reward_funcs
    if recipe.name == "qwen3-4b-math-lora.yaml":
        assert model_args.use_peft and training_args.use_vllm and training_args.vllm_mode == "colocate"
    if recipe.name == "qwen3-4b-math.yaml":
        assert launch_args == ["--num_processes", "8", "--accelerate_config", "zero2"]
    else:
        assert launch_args == []


def write_yaml(path, text):
    path.write_text(text)
    return str(path)


def test_unknown_yaml_key_names_the_closest_valid_key(tmp_path):
    config = write_yaml(tmp_path / "c.yaml", "completion_keep_rat: 0.3\nuse_cpu: true\nbf16: false\n")
    with pytest.raises(SystemExit, match="'--completion_keep_rat'.*Did you mean 'completion_keep_rate'"):
        parse(["--config", config])


def test_unknown_flag_is_refused_not_abbreviated(tmp_path):
    with pytest.raises(SystemExit, match="completion_keep_rat.*completion_keep_rate"):
        parse([*CPU, "--completion_keep_rat", "0.3"])


def test_bad_value_stops_before_anything_is_loaded(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml",
        "completion_keep_rate: 2\nuse_cpu: true\nbf16: false\nmodel_name_or_path: /nonexistent/model\n",
    )
    with pytest.raises(SystemExit, match=r"completion_keep_rate=2 is invalid.*\(0, 1\]"):
        main(["--config", config])


def test_flags_override_yaml(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml",
        "learning_rate: 1.0e-4\ncompletion_keep_rate: 0.5\nuse_cpu: true\n"
        "bf16: false\nenv:\n  DPPO_TEST_ENV: set-by-yaml\n",
    )
    _, training_args, *_ = parse(["--config", config, "--learning_rate", "3e-4", "--completion_keep_rate", "0.25"])
    assert training_args.learning_rate == 3e-4 and training_args.completion_keep_rate == 0.25
    import os

    assert os.environ.pop("DPPO_TEST_ENV") == "set-by-yaml"


def test_help_lists_the_dppo_options():
    text = make_parser().format_help()
    for name in DPPO_FIELDS:
        assert f"--{name}" in text, name
    assert "Horvitz" in text or "1/pi" in text  # the help text itself, not just the flag


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "dppo_trl", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--completion_keep_rate" in out.stdout


def tiny_run_config(tmp_path, model_dir, extra: str) -> str:
    """A YAML for a few CPU steps on the offline tiny model, with a local JSON dataset."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    addition_dataset(addition_pairs()[0][:32]).to_json(str(data / "train.jsonl"))
    return write_yaml(
        tmp_path / "run.yaml",
        f"""
model_name_or_path: {model_dir}
dataset_name: {data}
reward_funcs: [tests.conftest.random_reward]
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


def test_launch_options_start_the_run_under_accelerate(tmp_path, tiny_model_dir, monkeypatch):
    config = tiny_run_config(tmp_path, tiny_model_dir, "num_processes: 1\nmax_steps: 1\n")
    monkeypatch.delenv("DPPO_TRL_LAUNCHED", raising=False)
    monkeypatch.chdir(Path(__file__).parent.parent)
    main(["--config", config, "--mixed_precision", "no"])  # a YAML launch option and a command-line one
    import os

    assert os.environ.get("DPPO_TRL_LAUNCHED") == "1"  # it went through `accelerate launch`
    assert (tmp_path / "out" / "model.safetensors").exists()
