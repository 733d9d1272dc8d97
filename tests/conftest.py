"""Pytest fixtures of the whole suite (what they build comes from ``support``, which the tests import directly)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from support import exact, models  # noqa: E402


@pytest.fixture(autouse=True)
def torch_threads_as_found():
    """torch's thread count after each test as before it: a benchmark's ``main`` called in-process sets it
    (``--threads``, 2 by default in some), and the worker's later tests would run on 2 threads beside the other
    worker's, each slowed several times over (measured: a 7 s test took 280 s)."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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
