"""`make demo` end to end, shortened: it builds and warm-starts the tiny model, then trains it through the
CLI with recipes/cpu-demo.yaml and prints the DPPO summary."""

import json

import pytest

from dppo_trl import demo


@pytest.mark.parametrize("extra", [[], ["--prompt_keep_rate", "0.5"]])
def test_demo_runs_through_the_cli_and_summarises(tmp_path, capsys, extra):
    demo.main(["all", str(tmp_path), "--sft-steps", "2", "--max_steps", "4", "--logging_steps", "1", *extra])
    out = capsys.readouterr().out
    assert "DPPO summary: 4 steps" in out and "completions kept" in out
    assert ("prompts accepted" in out) == bool(extra)
    assert (tmp_path / "run" / "model.safetensors").exists()
    config = json.loads((tmp_path / "warm-start" / "config.json").read_text())
    assert config["hidden_size"] == 128
