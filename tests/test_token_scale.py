"""The cut's token scale ``T / D`` simulation (benchmarks/bench_token_scale.py, docs/prompt_pruning.md)."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_token_scale  # noqa: E402


def test_the_token_scale_is_the_batchs_tokens_over_the_probes_planned_count():
    lengths = torch.tensor([[10.0, 30.0, 20.0, 20.0], [5.0, 5.0, 50.0, 40.0]], dtype=torch.float64)
    # D = 4 x (mean(10, 30) + mean(5, 5)) = 100; T = 180.
    assert bench_token_scale.token_scale(lengths, probe=2) == 1.8
    assert bench_token_scale.token_scale(torch.full((3, 8), 7.0, dtype=torch.float64), probe=2) == 1.0


def test_the_simulation_writes_each_shapes_mean_and_spread(tmp_path):
    out = tmp_path / "scale.json"
    result = bench_token_scale.main(["--steps", "200", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["scale"]) == {"1x4", "1x16", "8x4"}
    for s in result["scale"].values():
        assert s["q05"] < s["mean"] < s["q95"] and s["sd"] > 0
    # More candidates in D: a narrower scale.
    assert result["scale"]["8x4"]["sd"] < result["scale"]["1x4"]["sd"]
    assert 0 < result["truncated_share"] < 1
