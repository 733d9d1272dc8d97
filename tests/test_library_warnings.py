"""A short DPPO run prints none of the FutureWarnings that ``dppo_trl._library_warnings`` filters (TRL's and
transformers' own), and a FutureWarning of the user's own code still shows. Each run is a fresh interpreter with
Python's default warning filters, as a user's script has."""

import os
import re
import subprocess
import sys

import pytest
import transformers
from packaging.version import Version

from dppo_trl._library_warnings import LIBRARY_FUTURE_WARNINGS

pytestmark = pytest.mark.subprocess

USERS_OWN = "the user's own deprecation"
SCRIPT = f"""
import tempfile
import warnings

from datasets import Dataset

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.tasks.toy import save_tiny_model

def reward(completions, **kwargs):
    return [float(len(text) % 2) for text in completions]

args = DPPOConfig(output_dir=tempfile.mkdtemp(), completion_keep_rate=0.5, num_generations=4,
                  per_device_train_batch_size=8, max_completion_length=4, max_steps=1, report_to="none",
                  save_strategy="no", bf16=False, use_cpu=True)
dataset = Dataset.from_dict({{"prompt": ["1+1=", "2+2=", "3+3=", "4+4="] * 4}})
model = str(save_tiny_model(tempfile.mkdtemp()))
DPPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset).train()
warnings.warn("{USERS_OWN}", FutureWarning)
"""


def run_script(tmp_path, *python_options) -> str:
    """The script's stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, *python_options, "-c", SCRIPT], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def library_warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if "FutureWarning" in line and any(re.search(message, line) for message, _ in LIBRARY_FUTURE_WARNINGS)]


def test_a_run_prints_no_library_future_warning_but_the_users_own(tmp_path):
    stderr = run_script(tmp_path)
    assert not library_warnings_in(stderr)
    assert f"FutureWarning: {USERS_OWN}" in stderr


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.23"), reason="no deprecated names before 5.23")
def test_with_the_users_own_warning_filters_the_library_warnings_show(tmp_path):
    """``python -W default``: the user's filters win, and the same run shows what the filter hides."""
    stderr = run_script(tmp_path, "-W", "default")
    shown = library_warnings_in(stderr)
    for name in ("`gradient_checkpointing`", "`is_gradient_checkpointing`", "`gradient_checkpointing_disable`",
                 "`gradient_checkpointing_enable`"):
        assert any(name in line for line in shown), f"{name} not shown:\n{stderr[-3000:]}"
    assert f"FutureWarning: {USERS_OWN}" in stderr
