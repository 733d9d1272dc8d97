"""An sdist and a wheel built from the repository (`python -m build`: the wheel is built from the sdist) install
into a fresh virtual environment and work there, away from the checkout: the metadata `pip show` reads (summary,
license, classifiers, URLs, the README as long description), the recipes inside it (`dppo-trl --config NAME`
finds them), `dppo-trl --help`, the README's quick start (examples/quickstart.py), and
`python -m dppo_trl.demo prepare` followed by `dppo-trl --config cpu-demo`. The README's own wheel lines (`pip wheel`,
then the install of that wheel with its extras) run as written.

Offline: the build runs without build isolation (setuptools from this environment), and the fresh venv
reaches this environment's packages (torch, trl, ...) through a .pth line, which adds the directory to its path
without running the .pth files there (so this checkout's editable install is not active in it)."""

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # a wheel build, a venv, the installed CLI

REPO = Path(__file__).parent.parent
README = (REPO / "README.md").read_text()


def run(*args, cwd, timeout=300, **environment):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env.update(environment)
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def clean_source(root: Path) -> Path:
    """A copy of what a build reads: no build/ or egg-info of the checkout goes into the wheel."""
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    for name in ("dppo_trl", "recipes"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return source


def fresh_venv(root: Path) -> Path:
    """The bin directory of a venv without pip that reaches this environment's packages (the module's docstring)."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    venv_site = run(bindir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root)
    Path(venv_site.strip(), "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return bindir


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin directory of a fresh venv holding only the wheel, a working directory outside the repository)."""
    root = tmp_path_factory.mktemp("wheel")
    source = clean_source(root)
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", root / "dist", source, cwd=root)
    (sdist,) = (root / "dist").glob("dppo_trl-*.tar.gz")
    (wheel,) = (root / "dist").glob("dppo_trl-*.whl")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    bindir = fresh_venv(root)
    run(*pip, "--python", bindir / "python", "install", "--no-deps", "--no-index", wheel, cwd=root)
    work = root / "work"
    work.mkdir()
    return bindir, work, sdist


def test_the_metadata_pip_shows(installed):
    bindir, work, _ = installed
    out = run(bindir / "python", "-c", "import json, importlib.metadata as m; d = m.metadata('dppo-trl');"
              "print(json.dumps({k: d.get_all(k) for k in set(d.keys())}))", cwd=work)
    meta = json.loads(out)
    assert "Dynamic Pruning Policy Optimization" in meta["Summary"][0]
    assert meta["License-Expression"] == ["Apache-2.0"] and meta["License-File"] == ["LICENSE"]
    assert "Programming Language :: Python :: 3" in meta["Classifier"]
    assert any(url.startswith("Paper, https://arxiv.org/abs/2603.04135") for url in meta["Project-URL"])
    assert meta["Description-Content-Type"] == ["text/markdown"]
    assert meta["Description"][0].strip() == (REPO / "README.md").read_text().strip()


def test_the_sdist_holds_what_a_build_needs(installed):
    *_, sdist = installed
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "LICENSE", "dppo_trl/trainer.py", "recipes/cpu-demo.yaml"} <= names


def test_the_readme_quick_start_from_the_installed_copy(installed):
    """examples/quickstart.py (the README's block, tests/test_readme.py) outside the checkout, on the tiny model."""
    bindir, work, _ = installed
    out = run(bindir / "python", REPO / "examples" / "quickstart.py", cwd=work, DPPO_TRL_SMOLLM2=str(work / "none"))
    assert "DPPO summary: 4 steps" in out


def test_the_installed_copy_ships_the_recipes_and_lists_them_in_the_help(installed):
    bindir, work, _ = installed
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
    """The tiny-model demo of a user of the wheel, through the installed console script (docs/usage.md)."""
    bindir, work, _ = installed
    out = run(bindir / "python", "-m", "dppo_trl.demo", "prepare", "--sft-steps", "2", cwd=work)
    assert "dppo-trl --config cpu-demo" in out
    out = run(bindir / "dppo-trl", "--config", "cpu-demo", "--max_steps", "2", "--logging_steps", "1", cwd=work)
    assert "DPPO summary: 2 steps" in out
    assert (work / "demo-output" / "run" / "model.safetensors").exists()


def readme_install_lines() -> list[str]:
    return re.search(r"## Install\n.*?```bash\n(.*?)```", README, re.DOTALL)[1].splitlines()


def extras(line: str) -> set[str]:
    return set(re.search(r"\[([^]]+)\]", line)[1].split(","))


def test_the_readme_wheel_lines_run_as_written(tmp_path):
    """The README's ``pip wheel`` line and the install of its wheel, with the extras of the README's editable
    install, run by bash in a clean copy of the source; ``pip`` on the PATH is this environment's pip, installing
    into a fresh venv. Offline: pip reads no index, and the build runs without isolation (setuptools from here)."""
    block = readme_install_lines()
    (editable,) = [line for line in block if line.startswith("pip install -e ")]
    lines = block[next(i for i, line in enumerate(block) if line.startswith("pip wheel ")):]
    assert len(lines) == 2 and lines[1].startswith("pip install "), lines
    assert extras(lines[1]) == extras(editable)
    source, bindir = clean_source(tmp_path), fresh_venv(tmp_path)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "pip").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pip --python "{bindir / "python"}" "$@"\n')
    (shims / "pip").chmod(0o755)
    script = "\n".join(["exec 2>&1", *lines])
    # PIP_NO_BUILD_ISOLATION=0 turns build isolation off: pip reads a negated option's variable that way round.
    out = run("bash", "-euo", "pipefail", "-c", script, cwd=source, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}",
              PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert "Successfully installed dppo-trl" in out and "does not provide the extra" not in out, out[-3000:]
    installed_at = run(bindir / "python", "-c", "import dppo_trl; print(dppo_trl.__file__)", cwd=tmp_path).strip()
    assert Path(installed_at).resolve().is_relative_to(bindir.parent.resolve()), installed_at
