"""Each benchmark program runs on a minimal setting, so none can rot."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import bench_train  # noqa: E402


def test_bench_train_runs_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rows = bench_train.main(["--rounds", "1", "--warmup", "0", "--hidden-size", "32", "--layers", "1",
                             "--json", str(out)])  # fmt: skip
    assert [r["variant"] for r in rows] == ["grpo", "dppo", "dppo+packing"]
    assert json.loads(out.read_text())["results"][0]["time_ratio_to_grpo"] == 1.0
    packed, grpo = rows[2], rows[0]
    assert packed["real_tokens"] < grpo["real_tokens"] and packed["token_density"] > grpo["token_density"]
    assert "x the ideal ratio" in capsys.readouterr().out
