"""A wheel built from the repository installs into a fresh virtual environment and works there, away from the
checkout: the recipes ship inside it, `dppo-trl --config NAME` finds them, `dppo-trl --help` lists `--config`
and the launch options, and `python -m dppo_trl.demo prepare` followed by `dppo-trl --config cpu-demo` trains.

Offline: the wheel is built without build isolation (setuptools from this environment), and the fresh venv
reaches this environment's packages (torch, trl, ...) through a .pth line, which adds the directory to its path
without running the .pth files there (so this checkout's editable install is not active in it)."""

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # a wheel build, a venv, the installed CLI

REPO = Path(__file__).parent.parent


def run(*args, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin directory of a fresh venv holding only the wheel, a working directory outside the repository)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a clean copy: no build/ or egg-info of the checkout goes into the wheel
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("dppo_trl", "recipes"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", source, "-w", root / "dist", cwd=root)
    (wheel,) = (root / "dist").glob("dppo_trl-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    venv_site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root).strip()
    Path(venv_site, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(*pip, "--python", python, "install", "--no-deps", "--no-index", wheel, cwd=root)
    work = root / "work"
    work.mkdir()
    return bindir, work


def test_the_installed_copy_ships_the_recipes_and_lists_them_in_the_help(installed):
    bindir, work = installed
    out = run(
        bindir / "python",
        "-c",
        "import dppo_trl, dppo_trl.cli as cli; print(dppo_trl.__file__); print(cli.recipes_dir());"
        "print(' '.join(cli.bundled_recipes())); print(cli.resolve_config('qwen3-4b-math-lora'));"
        "print(cli.make_parser().format_help())",
        cwd=work,
    )
    package, recipes, names, resolved, help_text = out.split("\n", 4)
    venv = bindir.parent.resolve()
    assert Path(package).resolve().is_relative_to(venv), package  # the wheel's copy, not the checkout
    assert Path(recipes).resolve() == Path(package).resolve().parent / "recipes"
    assert sorted(names.split()) == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert Path(resolved).read_text() == (REPO / "recipes" / "qwen3-4b-math-lora.yaml").read_text()
    assert "--config YAML_OR_RECIPE" in help_text and "qwen3-4b-math-lora" in help_text
    assert "--num_processes" in help_text and "--accelerate_config" in help_text


def test_prepare_then_dppo_trl_config_cpu_demo(installed):
    """What the README tells a user of the wheel to run, through the installed console script."""
    bindir, work = installed
    out = run(bindir / "python", "-m", "dppo_trl.demo", "prepare", "--sft-steps", "2", cwd=work)
    assert "dppo-trl --config cpu-demo" in out
    out = run(bindir / "dppo-trl", "--config", "cpu-demo", "--max_steps", "2", "--logging_steps", "1", cwd=work)
    assert "DPPO summary: 2 steps" in out
    assert (work / "demo-output" / "run" / "model.safetensors").exists()
