"""Two ranks, every row kept, rows moved between the ranks to balance their tokens, against GRPOTrainer:
- TRL's `sampling/*` means are the mean over ranks of each rank's mean (``gather(rank_mean).mean()``), not one
  token-weighted mean over every rank's tokens. DPPO re-estimates them from the rows it forwards
  (Horvitz-Thompson weighted) and logs the same quantity, each rank's mean over the rows that rank generated.
- `bnpo` and the entropy bonus divide by the tokens of each rank's micro-batch of TRL's split: a row that moved
  carries that count with it, so the gradient is GRPOTrainer's (float64)."""

import json
from pathlib import Path

import pytest
import torch
from support.processes import run_two_processes
from support.sampler import SAMPLING_KEYS

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # torchrun, twice

WORKER = Path(__file__).parent / "sampling_metrics_worker.py"


def test_two_ranks_log_trls_sampling_means_and_take_grpos_gradient(tmp_path, tiny_model_dir):
    logs, grads = {}, {}
    for name in ("grpo", "dppo"):
        run_two_processes(WORKER, tiny_model_dir, tmp_path / name, name)
        (logs[name],) = [h for h in json.loads((tmp_path / name / "log.json").read_text()) if "loss" in h]
        grads[name] = torch.load(tmp_path / name / "grad.pt")
    dppo, grpo = logs["dppo"], logs["grpo"]
    assert dppo["dppo/rank_imbalance"] < dppo["dppo/rank_imbalance_before"]  # rows moved between the ranks
    # One pooled token-weighted mean over both ranks (DPPO's before) read 6e-5 relative off here.
    for key in SAMPLING_KEYS:
        assert dppo[key] == pytest.approx(grpo[key], rel=2e-6, abs=1e-8), key
    assert float((grads["dppo"] - grads["grpo"]).norm() / grads["grpo"].norm()) < 1e-6
