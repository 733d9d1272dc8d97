"""`make demo` (`benchmarks/side_by_side.py`): its table from hand-made runs, and a shortened run on the real
model that writes the table, the plot and the record, its two runs in processes of their own taking turns
(`harness.interleave`; tests/test_interleave.py: the ratio of times under a load that changes midway)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import side_by_side  # noqa: E402


def run(method, rewards, wall, heldout, kept=1.0):
    steps = [dict(step=i + 1, wall=wall * (i + 1) / len(rewards), reward=r, kept=kept) for i, r in enumerate(rewards)]
    return dict(method=method, steps=steps, wall=wall, heldout=heldout)


def test_the_summary_compares_each_run_with_grpo():
    runs = [run("DPPO", [0.1, 0.2, 0.3, 0.5, 0.6, 0.7], wall=40.0, heldout=0.5, kept=0.4),
            run("GRPO", [0.0, 0.1, 0.2, 0.4, 0.5, 0.9], wall=100.0, heldout=0.45)]
    dppo, grpo = side_by_side.summary_rows(runs, heldout_start=0.1)
    assert dppo["time_ratio"] == pytest.approx(0.4) and grpo["time_ratio"] == 1.0
    assert dppo["reward_start"] == pytest.approx(0.2) and dppo["reward_end"] == pytest.approx(0.6)
    assert grpo["reward_start"] == pytest.approx(0.1) and grpo["reward_end"] == pytest.approx(0.6)
    assert (dppo["heldout_start"], dppo["heldout_end"], dppo["kept"]) == (0.1, 0.5, 0.4)
    lines = side_by_side.table([dppo, grpo]).splitlines()
    assert lines[2].split()[:4] == ["DPPO", "40", "s", "0.40x"] and lines[3].split()[:4] == ["GRPO", "100", "s", "1.00x"]
    assert "\n".join(lines[4:]) == side_by_side.TIMING  # how the times were taken


# The shortened run's batch: 2 prompts x 4 completions of up to 8 tokens (the demo's: 4 prompts x 8 completions of
# up to 16); everything else is the demo's own (``trainer_settings``).
SHORT_BATCH = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8)


def test_the_demos_settings_are_valid_for_both_trainers(tmp_path):
    """The settings the shortened run below overrides are the demo's own, which both configs accept as they are."""
    from trl import GRPOConfig

    from dppo_trl import DPPOConfig

    settings = side_by_side.trainer_settings(tmp_path, steps=8, seed=0)
    assert all(settings[k] > v for k, v in SHORT_BATCH.items())  # the shortened run is a smaller batch
    for config_cls, own in ((GRPOConfig, {}), (DPPOConfig, side_by_side.DPPO_ONLY)):
        config = config_cls(**settings, **own)  # TRL's and DPPO's checks of the batch and the groups
        assert {k: getattr(config, k) for k in SHORT_BATCH} == {k: settings[k] for k in SHORT_BATCH}


@pytest.mark.real_model
@pytest.mark.slow
def test_a_short_side_by_side_run_writes_its_table_plot_and_record(tmp_path, capsys, monkeypatch):
    from dppo_trl.smollm2 import ensure

    demo_settings = side_by_side.trainer_settings
    monkeypatch.setattr(side_by_side, "trainer_settings", lambda *args: {**demo_settings(*args), **SHORT_BATCH})
    code = side_by_side.main(["--steps", "2", "--heldout", "4", "--output-dir", str(tmp_path),
                              "--model", str(ensure(quiet=True))])
    out = capsys.readouterr().out
    assert code == 0
    assert "GRPO" in out and "DPPO" in out and "held-out" in out
    assert "Warning: --steps 2 is under 6: the reward at the start and at the end average" in out
    assert "Loading SmolLM2-135M-Instruct for GRPO and DPPO, each in a process of its own" in out
    record = json.loads((tmp_path / "grpo_vs_dppo.json").read_text())
    assert [r["method"] for r in record["runs"]] == ["DPPO", "GRPO"]
    assert all(len(r["steps"]) == 2 for r in record["runs"])
    assert {k: record["settings"][k] for k in SHORT_BATCH} == SHORT_BATCH  # what the two runs were given
    grpo_kept = [s["kept"] for s in record["runs"][1]["steps"]]
    assert grpo_kept == [1.0, 1.0]  # GRPO trains on every completion
    assert "in turns" in out and "in turns" in record["timing"]
    spans = sorted((start, end, r["method"]) for r in record["runs"] for start, end in r["spans"])
    assert [method for _, _, method in spans] == ["DPPO", "GRPO", "DPPO", "GRPO"]  # a step each, in turns
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(spans, spans[1:]))
    for run in record["runs"]:  # a method's time: its own steps' spans; each logged step within them
        assert run["wall"] == pytest.approx(sum(end - start for start, end in run["spans"]))
        assert 0 < run["steps"][0]["wall"] < run["steps"][1]["wall"] <= run["wall"]
    assert (tmp_path / "grpo_vs_dppo.png").stat().st_size > 1000
