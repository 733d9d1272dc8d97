"""Pytest fixtures of the whole suite (what they build comes from ``support``, which the tests import directly)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from support import exact, models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return models.save_tiny_dense(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    return models.save_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    return models.save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def train_dataset():
    return models.addition_prompts(64)


@pytest.fixture
def exact_logprobs(monkeypatch):
    """Every forward and backward of the test in float64: TRL's fused log-prob kernel and the model's RMSNorm, the
    two places that compute in float32, replaced for the test (``support.exact.use_float64_kernels``)."""
    exact.use_float64_kernels(monkeypatch.setattr)
