"""`make demo-tiny` end to end, shortened: it builds and warm-starts the tiny model, then trains it through the
CLI with the shipped cpu-demo recipe and prints the DPPO summary; `prepare` then `dppo-trl --config cpu-demo`
from the same directory does the same in two commands."""

import json

import pytest

from dppo_trl import cli, demo


@pytest.mark.parametrize("extra", [[], ["--prompt_keep_rate", "0.5"]])
def test_demo_runs_through_the_cli_and_summarises(tmp_path, capsys, extra):
    assert (
        demo.main(["all", str(tmp_path), "--sft-steps", "2", "--max_steps", "4", "--logging_steps", "1", *extra]) == 0
    )
    out = capsys.readouterr().out
    assert "DPPO summary: 4 steps" in out and "completions kept" in out
    assert ("prompts accepted" in out) == bool(extra)
    assert (tmp_path / "run" / "model.safetensors").exists()
    config = json.loads((tmp_path / "warm-start" / "config.json").read_text())
    assert config["hidden_size"] == 128


def test_prepare_then_the_shipped_recipe_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # prepare writes demo-output/ here, where the cpu-demo recipe looks
    assert demo.main(["prepare", "--sft-steps", "2"]) == 0
    assert "next, from this directory: dppo-trl --config cpu-demo\n" in capsys.readouterr().out
    assert (tmp_path / "demo-output" / "warm-start" / "config.json").exists()
    assert (tmp_path / "demo-output" / "data" / "train.jsonl").exists()
    assert cli.main(["--config", "cpu-demo", "--max_steps", "2", "--logging_steps", "1"]) == 0
    assert "DPPO summary: 2 steps" in capsys.readouterr().out
    assert (tmp_path / "demo-output" / "run" / "model.safetensors").exists()


def record_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "prepare", lambda directory, sft_steps: calls.append(("prepare", str(directory))))
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(("cli", argv)) or 0)
    return calls


def test_flags_without_a_directory_go_to_the_cli(monkeypatch):
    calls = record_calls(monkeypatch)
    assert demo.main(["--max_steps", "4"]) == 0  # `python -m dppo_trl.demo --max_steps 4`
    assert calls[0] == ("prepare", "demo-output")
    assert calls[1][0] == "cli" and calls[1][1][-2:] == ["--max_steps", "4"]
    assert calls[1][1][1] == str(cli.bundled_recipes()["cpu-demo"])


def test_a_bad_flag_stops_the_demo_before_the_warm_start(monkeypatch, capsys):
    calls = record_calls(monkeypatch)
    with pytest.raises(SystemExit) as error:
        demo.main(["--completion_keep_rat", "0.3"])
    assert error.value.code == 2 and calls == []
    assert "dppo-trl: unknown argument '--completion_keep_rat'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["prepare", "--max_steps", "4"])  # prepare trains nothing
    assert calls == []
