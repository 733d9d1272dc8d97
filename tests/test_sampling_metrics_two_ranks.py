"""TRL's `sampling/*` means over two ranks: TRL logs the mean over ranks of each rank's mean
(``gather(rank_mean).mean()``), not one token-weighted mean over every rank's tokens. DPPO re-estimates them from
the rows it forwards (Horvitz-Thompson weighted) and must log the same quantity, each rank's mean taken over the
rows that rank generated, also when rows move to another rank to balance the training load."""

import json
from pathlib import Path

import pytest
from test_multiprocess import run_two_processes
from test_vllm_path import SAMPLING_KEYS

WORKER = Path(__file__).parent / "sampling_metrics_worker.py"


def test_two_rank_sampling_means_are_trls(tmp_path, tiny_model_dir):
    logs = {}
    for name in ("grpo", "dppo"):
        run_two_processes(WORKER, tiny_model_dir, tmp_path / name, name)
        (logs[name],) = [h for h in json.loads((tmp_path / name / "log.json").read_text()) if "loss" in h]
    dppo, grpo = logs["dppo"], logs["grpo"]
    assert dppo["dppo/rank_imbalance"] < dppo["dppo/rank_imbalance_before"]  # rows moved between the ranks
    # One pooled token-weighted mean over both ranks (DPPO's before) reads 6e-5 relative off here.
    for key in SAMPLING_KEYS:
        assert dppo[key] == pytest.approx(grpo[key], rel=2e-6, abs=1e-8), key
