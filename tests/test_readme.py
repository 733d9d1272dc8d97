"""The README as a new user reads it: its quick-start block is examples/quickstart.py, verbatim, and runs as
written; its first screen says what DPPO is, which DPPO it is, how to install it and the first two commands; no
line of its prose is wider than 120 characters."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
README = (REPO / "README.md").read_text()
QUICKSTART = REPO / "examples" / "quickstart.py"
FIRST_SCREEN = 45  # lines


def quickstart_block(text: str) -> str:
    """The fenced python block that follows the README's ``examples/quickstart.py, verbatim`` marker."""
    match = re.search(r"<!-- examples/quickstart\.py, verbatim[^>]*-->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, "README.md: no python block after the '<!-- examples/quickstart.py, verbatim -->' marker"
    return match[1]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the markdown outside fenced code blocks, tables and HTML comments."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith(("|", "<!--")):
            out.append((number, line))
    return out


def run_python_file(path: Path, cwd: Path, **environment) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **environment)
    out = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{path}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_the_readme_quick_start_is_examples_quickstart_verbatim():
    assert quickstart_block(README) == QUICKSTART.read_text()


def test_the_marker_finds_a_block_that_differs(tmp_path):
    edited = README.replace("max_steps=4,", "max_steps=5,", 1)
    assert quickstart_block(edited) != QUICKSTART.read_text()


@pytest.mark.subprocess
def test_the_readme_quick_start_runs_as_written_on_the_tiny_model(tmp_path):
    """The README's block itself, saved to a file and run in an empty folder; no SmolLM2 folder, so it builds the
    tiny model (the real one: the test below)."""
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_block(README))
    out = run_python_file(script, tmp_path, DPPO_TRL_SMOLLM2=str(tmp_path / "no-model-here"))
    assert "DPPO summary: 4 steps" in out
    assert f"No SmolLM2 in {tmp_path / 'no-model-here'} (`dppo-trl-smollm2` converts it): a tiny random model" in out
    assert re.search(r"DPPO: training \S*dppo-tiny-model-\S* for 4 steps into output_dir \S*dppo-quickstart-", out)
    assert [p.name for p in tmp_path.iterdir()] == ["quickstart.py"], "it wrote into the current folder"


@pytest.mark.subprocess
@pytest.mark.real_model
@pytest.mark.slow
def test_examples_quickstart_runs_on_the_real_model(tmp_path):
    from dppo_trl.smollm2 import ensure

    folder = ensure(quiet=True)
    out = run_python_file(QUICKSTART, tmp_path, DPPO_TRL_SMOLLM2=str(folder))
    summary = re.search(r"DPPO summary: 4 steps.*completions kept (\d\.\d+)", out)
    assert summary, out[-2000:]


def test_the_first_screen_says_what_which_how_and_the_first_commands():
    screen = "\n".join(README.splitlines()[:FIRST_SCREEN])
    for needed in ("Dynamic Pruning Policy Optimization", "2603.04135", "trl.experimental.dppo", "Divergence PPO",
                   "make setup", 'pip install -e ".[gguf,reasoning-gym]"', "pip wheel", "Python 3.10",
                   "TRL 1.16", "transformers 5.x", "make demo", "make test", "DPPOConfig", "DPPOTrainer"):
        assert needed in screen, f"README.md's first {FIRST_SCREEN} lines do not say {needed!r}"


def test_no_prose_line_over_120_characters():
    wide = [(n, len(line)) for n, line in prose_lines(README) if len(line) > 120]
    assert not wide, f"README.md lines over 120 characters (line, width): {wide}"


def test_prose_lines_leave_out_code_and_tables():
    text = "a\n```\n" + "x" * 200 + "\n```\n| " + "y" * 200 + " |\nb"
    assert prose_lines(text) == [(1, "a"), (6, "b")]


def test_the_gpu_fragment_compiles_and_its_imports_resolve():
    """The GPU fragment cannot run here; its syntax and every name it imports can be checked."""
    import ast
    import importlib

    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    (fragment,) = [b for b in blocks if "Qwen/Qwen3-4B" in b]
    for node in ast.walk(ast.parse(fragment)):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
